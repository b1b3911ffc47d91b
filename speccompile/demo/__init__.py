"""The embedded demo pair: a small Python-code target and its distilled draft, shipped in the package
with an EAGLE-3 head (in the demo bundle beside the draft) and Medusa heads (in a bundle of their
own) trained on the same target.

Every command that takes a bundle uses the demo bundle when given none. It is built on first use
into the user cache directory (or $SPECCOMPILE_CACHE), under a name keyed by the sha256 of the demo
checkpoint files, of the compiler's source and of the bundle format version, so a changed pair, compiler
or format is rebuilt and an unchanged one never is.
"""

import hashlib
import logging
import shutil
from pathlib import Path

from speccompile.bundle import FORMAT_VERSION, open_bundle
from speccompile.errors import SpecCompileError
from speccompile.user_cache import cache_dir

DEMO_ROOT = Path(__file__).resolve().parent
DEMO_TARGET = DEMO_ROOT / "target"
DEMO_DRAFT = DEMO_ROOT / "draft"
DEMO_MEDUSA = DEMO_ROOT / "medusa"  # Medusa heads for the target (`speccompile distill --medusa 4`)
DEMO_EAGLE = DEMO_ROOT / "eagle"  # an EAGLE-3 head for the target (`speccompile distill --eagle3 7`)
DEMO_PROMPTS = DEMO_ROOT / "prompts.json"  # what `bench` and `profile` run when given no --prompts
COMPILER_ROOT = DEMO_ROOT.parent / "compiler"
DEMO_GAMMAS = [4, 2, 6]  # the first is the default γ
DEMO_MAX_SEQ = 1024
DEMO_MAX_BATCH = 8
DEMO_DRAFT_VOCAB = 3072  # greedy draft steps score the 3072 most frequent tokens (see compiler/draft_vocab.py)
DEMO_EAGLE_VOCAB = 3072  # and so do the EAGLE-3 head's (build --eagle-vocab)
logger = logging.getLogger(__name__)


def demo_key(target: Path | None = None, draft: Path | None = None) -> str:
    """sha256 over the build settings and format version, and the file names and contents of the demo
    checkpoints and the compiler package (the format lives outside it, in bundle.py)."""
    settings = (DEMO_GAMMAS, DEMO_MAX_SEQ, DEMO_MAX_BATCH, DEMO_DRAFT_VOCAB, FORMAT_VERSION)
    digest = hashlib.sha256(repr(settings).encode())
    for root in (target or DEMO_TARGET, draft or DEMO_DRAFT, COMPILER_ROOT):
        for path in sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
            digest.update(str(path.relative_to(root.parent)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def demo_bundle(target: Path | None = None, draft: Path | None = None, head: bool = True) -> Path:
    """The demo bundle's path, building it first if the cache has none for this pair: the target and
    its draft model, and beside them the target's EAGLE-3 head where the target is the demo's and the
    installation ships the head (`build --eagle`, its vocabulary cut as the draft's), so that
    `proposer="eagle"` runs on it and `auto` weighs the head against the draft model. head=False: the
    pair alone (what carrying the head costs is measured against it)."""
    target, draft = target or DEMO_TARGET, draft or DEMO_DRAFT
    if not (target / "config.json").is_file() or not (draft / "config.json").is_file():
        raise SpecCompileError("this installation has no embedded demo pair; pass a bundle directory")
    key, options = demo_key(target, draft), {"draft_vocab": DEMO_DRAFT_VOCAB}
    if head and target == DEMO_TARGET and (DEMO_EAGLE / "config.json").is_file():
        key = hashlib.sha256((key + demo_key(DEMO_EAGLE, DEMO_EAGLE) + str(DEMO_EAGLE_VOCAB)).encode()).hexdigest()
        options.update(eagle_dir=DEMO_EAGLE, eagle_vocab=DEMO_EAGLE_VOCAB)
    name = "the demo bundle" if "eagle_dir" in options else "the demo bundle (no EAGLE-3 head)"
    return _built(cache_dir() / f"demo-{key[:16]}", name, target, draft, **options)


def demo_medusa_bundle() -> Path:
    """The demo target with its Medusa heads (`build --medusa`), built on first use like the demo bundle."""
    if not (DEMO_TARGET / "config.json").is_file() or not (DEMO_MEDUSA / "medusa_config.json").is_file():
        raise SpecCompileError("this installation has no embedded demo target with Medusa heads")
    return _built(cache_dir() / f"demo-medusa-{demo_key(DEMO_TARGET, DEMO_MEDUSA)[:16]}", "the demo Medusa bundle",
                  DEMO_TARGET, None, medusa_dir=DEMO_MEDUSA)


def _built(bundle: Path, what: str, target: Path, draft: Path | None, **options) -> Path:
    """The cached build, checked (cheaply, by its stamp); one a crash or a full disk damaged is rebuilt."""
    if bundle.exists():
        try:
            open_bundle(bundle)
            return bundle
        except SpecCompileError as damaged:
            logger.warning(f"{what} in the cache is damaged ({damaged}): rebuilding it")
            shutil.rmtree(bundle, ignore_errors=True)
    try:
        from speccompile.compiler.build import build_bundle
    except ImportError as e:
        raise SpecCompileError(f"building {what} needs the build extras ({e.name} is missing): "
                               "pip install 'speccompile[build]'") from None
    logger.info(f"building {what} once into {bundle}")
    bundle.parent.mkdir(parents=True, exist_ok=True)
    try:
        build_bundle(target, draft, bundle, gammas=DEMO_GAMMAS, max_seq=DEMO_MAX_SEQ, max_batch=DEMO_MAX_BATCH,
                     **options)
    except (OSError, SpecCompileError):
        if not (bundle / "manifest.json").is_file():  # another process finished the same build first
            raise
    return bundle
