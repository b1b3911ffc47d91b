"""Session graphs as ONNX Runtime optimized them, saved once per machine in the user's cache, reading
their weights from the bundle's own files.

Why: opening a session for a real-size model starts with work that gives the same result every
time. ONNX Runtime optimizes the graph (inlines our functions, fuses SiLU, folds constants: about
0.2 s of the 1.1B int4 target's 0.85 s, more on larger graphs), then pre-packs every weight for its
kernels (MLAS's SGEMM panels for float32, MatMulNBits' blocks for int8/int4). Pre-packing cannot be
skipped (unpacked, a 1.1B int4 decode step took 5 s instead of 40 ms) nor saved: ONNX Runtime 1.32
can write the packed blobs beside an optimized graph (`session.save_external_prepacked_constant_initializers`),
but opening that graph packs the original weights again and compares the result with the saved blobs
(measured: 0.65 s against 0.68 s packing anew for the int4 target, the same for float32), while the
copy took 1.7-2x the bundle's bytes on disk and twice the reading on a cold start.

So what is saved is the optimization alone: the optimized graph, whose initializers ONNX Runtime left
as they were (all the large ones, checked byte for byte) point back into the bundle's weights file,
and the few it made (folded constants) are written into the graph itself. A later load opens it
from memory with the bundle's directory as the folder of its external data, optimization off. The
cache holds graphs, not weights: a few hundred KB per graph.

The graph depends on the CPU's instruction sets and on the ONNX Runtime version (both in
runtime.hardware.fingerprint), so each machine gets its own, made by the first load there: under
`<user cache>/optimized/<bundle contents>/<machine>/<graph>/`, where a read-only bundle gets one too.
The least recently used graphs are removed beyond $SPECCOMPILE_SAVED_GRAPHS_GB (default 1 GB); 0
turns saving off.

Trust and races: a saved graph is made in a private directory and renamed into place whole, so two
processes loading one bundle at once never mix their files (the second rename loses, and its
session is used as made). A stamp beside it records the sha256 of the bundle file it was made from
and the size, inode and change time of what was written; a saved file touched since is not used
(and is made again). The bundle's own files are the bundle's to vouch for (bundle.open_bundle), and
every bundle file's sha256 is in the cache key.
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

from speccompile.bundle import Bundle, graph_initializers
from speccompile.errors import SpecCompileError
from speccompile.runtime.hardware import fingerprint, fingerprint_key
from speccompile.user_cache import cache_dir

log = logging.getLogger("speccompile")

DIRECTORY = "optimized"
LIMIT_ENV = "SPECCOMPILE_SAVED_GRAPHS_GB"
DEFAULT_LIMIT_GB = 1.0
MODEL, STAMP = "model.onnx", "stamp.json"  # one saved graph's files
SAVING_DATA = "optimized.data"  # where ONNX Runtime writes the optimized graph's tensors; not kept
# Tensors the optimizer made (not found in the bundle) are written into the graph; beyond this many
# bytes of them the graph is not saved (a protobuf holds 2 GB; none of our graphs come near).
MADE_TENSORS_MAX_BYTES = 256 << 20
# An older layout of this cache held pre-packed copies of the weights (gigabytes per bundle).
LEGACY_DIRECTORY = "prepacked"


class NotSaved(Exception):
    """The optimized graph cannot point back into the bundle; the session runs as made."""


def saved_graphs_root() -> Path:
    return cache_dir() / DIRECTORY


def saved_dir(bundle: Bundle) -> Path:
    """This machine's saved graphs of this bundle: keyed by every file's sha256 (a rebuilt bundle, even
    one whose graphs are the same, gets its own) and by the machine's fingerprint."""
    contents = hashlib.sha256(json.dumps(sorted(bundle.manifest.files.items())).encode()).hexdigest()[:16]
    return saved_graphs_root() / contents / fingerprint_key(fingerprint())


def limit_bytes() -> int:
    text = os.environ.get(LIMIT_ENV)
    try:
        return int((DEFAULT_LIMIT_GB if text is None else float(text)) * 1e9)
    except ValueError:
        raise SpecCompileError(f"{LIMIT_ENV} must be a number of GB (0: save nothing), got {text!r}") from None


def open_session(bundle: Bundle, file: str, options, providers):
    """A session for the bundle's graph `file`: from this machine's saved optimized graph when there
    is a valid one; otherwise created as usual, and its optimized graph saved for the next start when
    the cache allows. (session, how: "saved", "saving" or "plain")."""
    import onnxruntime as ort

    saved = saved_dir(bundle) / Path(file).stem
    if _valid(bundle, file, saved):
        with contextlib.suppress(OSError):  # a read-only cache is used as it is
            os.utime(saved)  # recently used: the last to be removed
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # done when it was saved
        options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(bundle.path))
        model = (saved / MODEL).read_bytes()
        return ort.InferenceSession(model, options, providers=providers), "saved"
    making = _private_dir(saved) if limit_bytes() > 0 else None
    if making is None:  # saving is off, or the cache cannot be written here
        return ort.InferenceSession(str(bundle.path / file), options, providers=providers), "plain"
    started = time.perf_counter()
    try:
        options.optimized_model_filepath = str(making / MODEL)
        options.add_session_config_entry("session.optimized_model_external_initializers_file_name", SAVING_DATA)
        options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
        session = ort.InferenceSession(str(bundle.path / file), options, providers=providers)
        try:
            _point_into_bundle(bundle.path / file, making / MODEL, making / SAVING_DATA)
            (making / SAVING_DATA).unlink()
            _write_stamp(bundle, file, making)
            _move_into_place(making, saved)
        except (NotSaved, OSError) as why:  # the cache's trouble (a full disk too), not the load's
            log.info(f"{file}: its optimized graph is not saved ({why})")
            return session, "plain"
    finally:
        shutil.rmtree(making, ignore_errors=True)  # gone already where it was moved into place
    log.info(f"{file}: optimized for this machine in {time.perf_counter() - started:.1f} s, "
             f"its graph saved in {saved} for the next start")
    _evict(keep=saved)
    return session, "saving"


def _point_into_bundle(source: Path, model_path: Path, data_path: Path) -> None:
    """Rewrite the optimized graph ONNX Runtime saved at `model_path` (its large tensors in `data_path`)
    so that each tensor byte-identical to one of the bundle graph `source` reads the bundle's weights
    file where that one does, and every other tensor is written into the graph."""
    import numpy as np
    import onnx

    bundle_tensors = {tensor.name: _external(tensor) for tensor in graph_initializers(onnx.load(
        str(source), load_external_data=False).graph) if tensor.data_location == onnx.TensorProto.EXTERNAL}
    model = onnx.load(str(model_path), load_external_data=False)
    data = np.memmap(data_path, np.uint8, "r") if data_path.stat().st_size else np.zeros(0, np.uint8)
    made = 0
    for tensor in graph_initializers(model.graph):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        entry = _external(tensor)
        values = data[entry["offset"]:entry["offset"] + entry["length"]]
        origin = bundle_tensors.get(tensor.name)
        if origin is not None and origin["length"] == entry["length"] and np.array_equal(
                values, np.memmap(source.parent / origin["location"], np.uint8, "r", origin["offset"],
                                  (origin["length"],))):
            _set_external(tensor, origin)
            continue
        made += entry["length"]
        if made > MADE_TENSORS_MAX_BYTES:
            raise NotSaved(f"the optimizer made more than {MADE_TENSORS_MAX_BYTES >> 20} MiB of tensors")
        del tensor.external_data[:]
        tensor.data_location = onnx.TensorProto.DEFAULT
        tensor.raw_data = values.tobytes()
    model_path.write_bytes(model.SerializeToString())


def _external(tensor) -> dict:
    entry = {e.key: e.value for e in tensor.external_data}
    return {"location": entry["location"], "offset": int(entry.get("offset", 0)), "length": int(entry["length"])}


def _set_external(tensor, entry: dict) -> None:
    del tensor.external_data[:]
    for key in ("location", "offset", "length"):
        item = tensor.external_data.add()
        item.key, item.value = key, str(entry[key])


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
    """Remove the least recently used saved graphs until the cache is within its limit, and the
    pre-packed weights an older layout of the cache kept."""
    legacy = saved_graphs_root().parent / LEGACY_DIRECTORY
    if legacy.is_dir():
        shutil.rmtree(legacy, ignore_errors=True)
        log.info(f"removed {legacy} (pre-packed copies of weights, no longer used)")
    graphs = [path for path in saved_graphs_root().glob("*/*/*") if path.is_dir() and not path.name.startswith(".")]
    sizes = {path: sum(f.stat().st_size for f in path.iterdir() if f.is_file()) for path in graphs}
    total = sum(sizes.values())
    for path in sorted(graphs, key=lambda p: p.stat().st_mtime):
        if total <= limit_bytes():
            break
        if path != keep:
            shutil.rmtree(path, ignore_errors=True)
            total -= sizes[path]
            log.info(f"removed the saved graph {path} (least recently used; {LIMIT_ENV})")


def _file_stamp(path: Path) -> list[int]:
    st = os.stat(path)
    return [st.st_size, st.st_ino, st.st_ctime_ns]


def _write_stamp(bundle: Bundle, file: str, saved: Path) -> None:
    stamp = {"source": file, "source_sha256": bundle.manifest.files[file], "files": {MODEL: _file_stamp(saved / MODEL)}}
    (saved / STAMP).write_text(json.dumps(stamp))


def _valid(bundle: Bundle, file: str, saved: Path) -> bool:
    try:
        if not (saved / STAMP).is_file():  # none, or not a regular file (a pipe would block)
            return False
        stamp = json.loads((saved / STAMP).read_text())
        return (stamp["source_sha256"] == bundle.manifest.files[file]
                and set(stamp["files"]) == {MODEL}
                and all(_file_stamp(saved / name) == recorded for name, recorded in stamp["files"].items()))
    except (OSError, ValueError, KeyError, TypeError):
        return False
