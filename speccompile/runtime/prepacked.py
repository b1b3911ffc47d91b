"""Session graphs as ONNX Runtime left them after optimizing and pre-packing, saved once per machine
in the user's cache.

Why: creating a session for a real-size model is mostly work that gives the same result every time.
ONNX Runtime optimizes the graph, then re-lays every weight out for its kernels (pre-packing: MLAS's
packed SGEMM panels for float32, MatMulNBits' blocks for int8/int4). On the 1.1B float32 target that
took 6-10 s of a 7-11 s `load()`, on two cores, every start. Without pre-packing a step is two times
slower (the kernels pack on every call), so it cannot simply be skipped.

ONNX Runtime can save the optimized graph with the pre-packed weights in its external data file
(`session.save_external_prepacked_constant_initializers`) and load it back with optimization off: no
packing at all. The packed layout depends on the CPU's instruction sets and on the ONNX Runtime
version (both in runtime.hardware.fingerprint), so each machine gets its own, made by the first load
there. It holds the weights again (the originals and the packed blobs: about 1.7x the bundle's for
the 1.1B int8 pair), so it is a cache, not part of the bundle: under
`<user cache>/prepacked/<bundle contents>/<machine>/<graph>/`, where a read-only bundle gets one too
and a bundle stays the size it was built. The least recently used graphs are removed beyond
$SPECCOMPILE_PREPACKED_GB (default 16 GB); 0 turns saving off.

Trust and races: a saved graph is made in a private directory and renamed into place whole, so two
processes loading one bundle at once never mix their files (the second rename loses, and its
session is used as made). A stamp beside it records the sha256 of the bundle file it was made from
and the size, inode and change time of what was written; a saved file touched since is not used
(and is made again).
"""

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from speccompile.bundle import Bundle
from speccompile.errors import SpecCompileError
from speccompile.runtime.hardware import fingerprint, fingerprint_key
from speccompile.user_cache import cache_dir

log = logging.getLogger("speccompile")

DIRECTORY = "prepacked"
LIMIT_ENV = "SPECCOMPILE_PREPACKED_GB"
DEFAULT_LIMIT_GB = 16.0
MODEL, DATA, STAMP = "model.onnx", "model.onnx.data", "stamp.json"  # one saved graph's files
SAVE_OPTIONS = {
    "session.optimized_model_external_initializers_min_size_in_bytes": "1024",
    "session.save_external_prepacked_constant_initializers": "1",
}


def prepacked_root() -> Path:
    return cache_dir() / DIRECTORY


def prepacked_dir(bundle: Bundle) -> Path:
    """This machine's saved graphs of this bundle: keyed by every file's sha256 (a rebuilt bundle, even
    one whose graphs are the same, gets its own) and by the machine's fingerprint."""
    contents = hashlib.sha256(json.dumps(sorted(bundle.manifest.files.items())).encode()).hexdigest()[:16]
    return prepacked_root() / contents / fingerprint_key(fingerprint())


def limit_bytes() -> int:
    text = os.environ.get(LIMIT_ENV)
    try:
        return int((DEFAULT_LIMIT_GB if text is None else float(text)) * 1e9)
    except ValueError:
        raise SpecCompileError(f"{LIMIT_ENV} must be a number of GB (0: save nothing), got {text!r}") from None


def open_session(bundle: Bundle, file: str, options, providers, create: bool = True):
    """A session for the bundle's graph `file`: from this machine's saved pre-packed graph when there
    is a valid one; otherwise created as usual, and saved for the next start when `create` and the
    cache allows. (session, how: "saved", "saving" or "plain")."""
    import onnxruntime as ort

    saved = prepacked_dir(bundle) / Path(file).stem
    if _valid(bundle, file, saved):
        with contextlib.suppress(OSError):  # a read-only cache is used as it is
            os.utime(saved)  # recently used: the last to be removed
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # done when it was saved
        return ort.InferenceSession(str(saved / MODEL), options, providers=providers), "saved"
    if not (create and limit_bytes() > 0):
        return ort.InferenceSession(str(bundle.path / file), options, providers=providers), "plain"
    making = _private_dir(saved)
    if making is None:  # the cache cannot be written here
        return ort.InferenceSession(str(bundle.path / file), options, providers=providers), "plain"
    started = time.perf_counter()
    try:
        options.optimized_model_filepath = str(making / MODEL)
        options.add_session_config_entry("session.optimized_model_external_initializers_file_name", DATA)
        for key, value in SAVE_OPTIONS.items():
            options.add_session_config_entry(key, value)
        session = ort.InferenceSession(str(bundle.path / file), options, providers=providers)
        _write_stamp(bundle, file, making)
        _move_into_place(making, saved)
    finally:
        shutil.rmtree(making, ignore_errors=True)  # gone already where it was moved into place
    log.info(f"{file}: optimized and pre-packed for this machine in {time.perf_counter() - started:.1f} s, "
             f"saved in {saved} for the next start")
    _evict(keep=saved)
    return session, "saving"


def _private_dir(saved: Path) -> Path | None:
    """A new directory of this process's own beside where `saved` goes, or None where none can be made."""
    try:
        saved.parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{saved.name}.", dir=saved.parent))
    except OSError:
        return None


def _move_into_place(made: Path, saved: Path) -> None:
    """Rename the whole directory into place; where a stale or touched copy is there, replace it;
    where another process got there first with a valid one, keep theirs."""
    try:
        made.rename(saved)
    except OSError:  # there already: a copy that failed _valid, or one another process just made
        stale = saved.with_name(f".{saved.name}.stale-{os.getpid()}")
        try:
            saved.rename(stale)
            made.rename(saved)
        except OSError:
            pass  # another process is replacing it too: theirs stays
        shutil.rmtree(stale, ignore_errors=True)


def _evict(keep: Path) -> None:
    """Remove the least recently used saved graphs until the cache is within its limit."""
    graphs = [path for path in prepacked_root().glob("*/*/*") if path.is_dir() and not path.name.startswith(".")]
    sizes = {path: sum(f.stat().st_size for f in path.iterdir() if f.is_file()) for path in graphs}
    total = sum(sizes.values())
    for path in sorted(graphs, key=lambda p: p.stat().st_mtime):
        if total <= limit_bytes():
            break
        if path != keep:
            shutil.rmtree(path, ignore_errors=True)
            total -= sizes[path]
            log.info(f"removed the saved pre-packed graph {path} (least recently used; {LIMIT_ENV})")


def _file_stamp(path: Path) -> list[int]:
    st = os.stat(path)
    return [st.st_size, st.st_ino, st.st_ctime_ns]


def _write_stamp(bundle: Bundle, file: str, saved: Path) -> None:
    stamp = {"source": file, "source_sha256": bundle.manifest.files[file],
             "files": {name: _file_stamp(saved / name) for name in (MODEL, DATA)}}
    (saved / STAMP).write_text(json.dumps(stamp))


def _valid(bundle: Bundle, file: str, saved: Path) -> bool:
    try:
        if not (saved / STAMP).is_file():  # none, or not a regular file (a pipe would block)
            return False
        stamp = json.loads((saved / STAMP).read_text())
        return (stamp["source_sha256"] == bundle.manifest.files[file]
                and set(stamp["files"]) == {MODEL, DATA}
                and all(_file_stamp(saved / name) == recorded for name, recorded in stamp["files"].items()))
    except (OSError, ValueError, KeyError, TypeError):
        return False
