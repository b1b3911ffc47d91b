"""Text corpora, tokenized into one flat id array: what `distill` trains on and `build --draft-vocab-corpus`
counts tokens of (so both the training and the compiler side import it).

The demo corpus is the Python standard library of the interpreter running this code: present on
every machine with Python, offline. It is split by file, deterministically: a file is held out when
the first byte of sha256(relative path) is below 256 * heldout_fraction, so the split does not
depend on file order, file contents, or the machine.
"""

import hashlib
import sysconfig
from pathlib import Path

import numpy as np

from speccompile.errors import SpecCompileError

TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ".json", ".c", ".h", ".js", ".ts", ".rs", ".go", ".java", ".toml",
                 ".yaml", ".yml"}


def stdlib_files() -> list[Path]:
    """The standard library's .py files (third-party site-packages excluded), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts)


def is_heldout(relative_path: str, heldout_fraction: float) -> bool:
    return hashlib.sha256(relative_path.encode()).digest()[0] < 256 * heldout_fraction


def stdlib_split(heldout_fraction: float = 0.05) -> tuple[list[Path], list[Path]]:
    """(train files, held-out files) of the stdlib corpus."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, heldout = [], []
    for path in stdlib_files():
        (heldout if is_heldout(str(path.relative_to(root)), heldout_fraction) else train).append(path)
    return train, heldout


def corpus_files(path) -> list[Path]:
    """A corpus given by the user: one text file, or every text file under a directory."""
    path = Path(path)
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
    else:
        raise SpecCompileError(f"corpus not found: {path}")
    if not any(_read_text(f).strip() for f in files):
        raise SpecCompileError(f"corpus {path} contains no text (looked for {', '.join(sorted(TEXT_SUFFIXES))} files)")
    return files


def read_texts(files: list[Path]) -> list[str]:
    """The non-empty UTF-8 texts among `files` (others are skipped: a few stdlib test files are latin-1)."""
    return [t for t in (_read_text(f) for f in files) if t.strip()]


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return ""


def tokenize_files(files: list[Path], encode_batch, separator_id: int) -> np.ndarray:
    """All files' token ids, each followed by `separator_id`, as one uint32 array."""
    texts = read_texts(files)
    pieces = []
    for start in range(0, len(texts), 256):
        for ids in encode_batch(texts[start : start + 256]):
            pieces.append(np.asarray(ids, dtype=np.uint32))
            pieces.append(np.array([separator_id], dtype=np.uint32))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.uint32)


STDLIB = "stdlib"  # the corpus argument naming the Python standard library (its train split)


def corpus_tokens(corpus, encode_batch, separator_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) token ids of a corpus argument: "stdlib" (split by file, see above), or a
    user's file or directory, whose last 5% of tokens are held out."""
    if str(corpus) == STDLIB:
        train_files, heldout_files = stdlib_split()
        train = tokenize_files(train_files, encode_batch, separator_id)
        return train, tokenize_files(heldout_files, encode_batch, separator_id)
    tokens = tokenize_files(corpus_files(corpus), encode_batch, separator_id)
    cut = int(len(tokens) * 0.95)
    return tokens[:cut], tokens[cut:]


def sample_windows(tokens: np.ndarray, batch: int, length: int, rng: np.random.Generator) -> np.ndarray:
    """`batch` random windows of `length` tokens (int64 [batch, length])."""
    if len(tokens) <= length:
        raise SpecCompileError(f"corpus has {len(tokens)} tokens, fewer than one window of {length + 1}")
    starts = rng.integers(0, len(tokens) - length, size=batch)
    return np.stack([tokens[s : s + length] for s in starts]).astype(np.int64)
