"""Which backend runs a bundle's models, and the models it makes: ONNX Runtime sessions over the ONNX
graphs, or TensorRT engines (the bundle's, built by `speccompile build --backend tensorrt`); and the
runners that draft with them."""

import logging
from concurrent.futures import ThreadPoolExecutor

from speccompile.bundle import HEAD_ROLE, Bundle
from speccompile.core.proposers import Proposers, TreeShape
from speccompile.core.proposers.draft_model import DraftRunner
from speccompile.core.proposers.eagle import EagleRunner
from speccompile.errors import SpecCompileError

BACKENDS = ("auto", "onnxruntime", "tensorrt")
log = logging.getLogger("speccompile")


def resolve_backend(bundle: Bundle, backend: str) -> str:
    """backend "auto": the bundle's engines where it has them and TensorRT is installed, else ONNX
    Runtime, saying so in one line when the engines go unused."""
    if backend not in BACKENDS:
        raise SpecCompileError(f"backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    if backend != "auto":
        return backend
    if not bundle.manifest.engines:
        return "onnxruntime"
    from speccompile.tensorrt_setup import require_tensorrt

    try:
        require_tensorrt()
    except SpecCompileError as missing:
        log.warning(f"{bundle.path} has TensorRT engines, which cannot run here ({missing}): running its ONNX "
                    "graphs on ONNX Runtime")
        return "onnxruntime"
    return "tensorrt"


def make_models(bundle: Bundle, backend: str, threads: int | None, shared_threads: bool | None,
                one_session: bool | None) -> tuple:
    """(target, draft or None, EAGLE-3 head or None) on `backend` (see speccompile.load for the ONNX
    Runtime options; the head has no session graph: a session per graph, whatever one_session says)."""
    if backend == "onnxruntime":
        from speccompile.runtime.onnxruntime_engine import OrtModel, shared_thread_pool

        shared = shared_thread_pool(threads, create=bool(shared_threads))
        # Both models on every core: a pool releases its threads when its run ends, so the draft's
        # no longer competes with the target's (a real-size draft ran at half speed on one thread:
        # the 1.1B pair's 2-layer draft, 7.0-8.0 ms a step against 4.7 on two).
        # Opened side by side: ONNX Runtime releases the GIL while it initializes (pre-packs) a session,
        # mostly on one core. 1.1B int8 pair, 2 cores: target and draft sessions in 2.0-2.35 s, against
        # 2.5-2.7 s one after the other.
        with ThreadPoolExecutor(max_workers=3) as pool:
            target = pool.submit(OrtModel, bundle, "target", threads=threads, shared_pool=shared,
                                 one_session=one_session)
            draft = pool.submit(OrtModel, bundle, "draft", threads=threads, shared_pool=shared,
                                one_session=one_session) if bundle.has_draft else None
            eagle = pool.submit(OrtModel, bundle, HEAD_ROLE, threads=threads,
                                shared_pool=shared) if bundle.has_eagle else None
            return tuple(model.result() if model is not None else None for model in (target, draft, eagle))
    if backend == "tensorrt":
        from speccompile.runtime.tensorrt_engine import TrtModel

        # TrtModel refuses a bundle built for an EAGLE-3 head
        return TrtModel(bundle, "target"), TrtModel(bundle, "draft") if bundle.has_draft else None, None
    raise SpecCompileError(f"unknown backend {backend!r} (available: onnxruntime, tensorrt)")


def make_proposers(draft, eagle, max_seq: int, tree: TreeShape | None, lookup_priors: dict | None) -> Proposers:
    """What the requests' proposers share: a runner for each model that drafts (the draft model, the
    EAGLE-3 head; None where the bundle has none), a Medusa bundle's tree shape, prompt lookup's priors."""
    return Proposers(DraftRunner(draft, max_seq) if draft is not None else None, tree, lookup_priors,
                     eagle=EagleRunner(eagle, max_seq) if eagle is not None else None)
