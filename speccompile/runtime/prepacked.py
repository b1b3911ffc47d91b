"""Session graphs as ONNX Runtime left them after optimizing and pre-packing, saved once per machine.

Why: creating a session for a real-size model is mostly work that gives the same result every time.
ONNX Runtime optimizes the graph, then re-lays every weight out for its kernels (pre-packing: MLAS's
packed SGEMM panels for float32, MatMulNBits' blocks for int8/int4). On the 1.1B float32 target that
took 6-10 s of a 7-11 s `load()`, on two cores, every start. Without pre-packing a step is two times
slower (the kernels pack on every call), so it cannot simply be skipped.

ONNX Runtime can save the optimized graph with the pre-packed weights in its external data file
(`session.save_external_prepacked_constant_initializers`) and load it back memory-mapped, with
optimization off: no packing at all. The packed layout depends on the CPU's instruction sets and
on the ONNX Runtime version (both in runtime.hardware.fingerprint), so each machine gets its own,
under `prepacked/<fingerprint key>/` in the bundle, made by the first load there (or by
`speccompile build`, for the machine that builds). The first load pays the usual time plus the
writing, and the disk holds the weights once more: the packed blobs beside the original weights.

Trust: the saved graph is derived from a verified bundle file. A stamp beside it records which
manifest hash it was made from and the size, inode and change time of what was written; a bundle
rebuilt, or a saved file touched since, is not used (and is made again where the bundle is
writable).
"""

import json
import logging
import os
import tempfile
import time
from pathlib import Path

from speccompile.bundle import Bundle, inside
from speccompile.errors import SpecCompileError
from speccompile.runtime.hardware import fingerprint, fingerprint_key

log = logging.getLogger("speccompile")

DIRECTORY = "prepacked"
SAVE_OPTIONS = {
    "session.optimized_model_external_initializers_min_size_in_bytes": "1024",
    "session.save_external_prepacked_constant_initializers": "1",
}


def prepacked_dir(bundle: Bundle) -> Path:
    return bundle.path / DIRECTORY / fingerprint_key(fingerprint())


def open_session(bundle: Bundle, file: str, options, providers, create: bool = True):
    """A session for the bundle's graph `file`: from this machine's saved pre-packed graph when there
    is a valid one; otherwise created as usual, and saved for the next start when `create` and the
    bundle is writable. (session, how: "saved", "saving" or "plain")."""
    import onnxruntime as ort

    saved = prepacked_dir(bundle) / file
    try:  # a bundle made elsewhere may link its prepacked/ out of itself: then it is neither read nor written
        inside(bundle.path, str(saved.relative_to(bundle.path)))
    except SpecCompileError as outside:
        log.warning(f"{outside}; its graph is optimized at every start instead")
        return ort.InferenceSession(str(bundle.path / file), options, providers=providers), "plain"
    if _valid(bundle, file, saved):
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # done when it was saved
        return ort.InferenceSession(str(saved), options, providers=providers), "saved"
    if create and _writable(saved.parent):
        started = time.perf_counter()
        partial = saved.with_name(saved.name + ".partial")
        options.optimized_model_filepath = str(partial)
        options.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                         _data_name(saved))
        for key, value in SAVE_OPTIONS.items():
            options.add_session_config_entry(key, value)
        try:
            session = ort.InferenceSession(str(bundle.path / file), options, providers=providers)
            partial.replace(saved)
            _write_stamp(bundle, file, saved)
        except Exception:
            for leftover in (partial, saved.parent / _data_name(saved)):
                leftover.unlink(missing_ok=True)
            raise
        log.info(f"{file}: optimized and pre-packed for this machine in {time.perf_counter() - started:.1f} s, "
                 f"saved in {saved.parent} for the next start")
        return session, "saving"
    return ort.InferenceSession(str(bundle.path / file), options, providers=providers), "plain"


def _data_name(saved: Path) -> str:
    return saved.name + ".data"


def _stamp_path(saved: Path) -> Path:
    return saved.with_name(saved.name + ".stamp.json")


def _file_stamp(path: Path) -> list[int]:
    st = os.stat(path)
    return [st.st_size, st.st_ino, st.st_ctime_ns]


def _write_stamp(bundle: Bundle, file: str, saved: Path) -> None:
    stamp = {"source": file, "source_sha256": bundle.manifest.files[file],
             "files": {name: _file_stamp(saved.parent / name) for name in (saved.name, _data_name(saved))}}
    _stamp_path(saved).write_text(json.dumps(stamp))


def _valid(bundle: Bundle, file: str, saved: Path) -> bool:
    try:
        if not _stamp_path(saved).is_file():  # none, or not a regular file (a pipe would block)
            return False
        stamp = json.loads(_stamp_path(saved).read_text())
        return (stamp["source_sha256"] == bundle.manifest.files[file]
                and all(_file_stamp(saved.parent / name) == recorded for name, recorded in stamp["files"].items())
                and set(stamp["files"]) == {saved.name, _data_name(saved)})
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _writable(directory: Path) -> bool:
    """Whether files can be made in `directory` (made if missing). Each asker probes with a file of
    its own: a bundle's models open their sessions at once (backends.make_models)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            return True
    except OSError:
        return False
