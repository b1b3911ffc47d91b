"""speccompile: compile HF draft/target pairs into speculative-decoding bundles, and run them.

    import speccompile
    runtime = speccompile.load("bundle/")
    [result] = runtime.generate(["def parse_args(argv):"], max_new_tokens=32)
    [sampled] = runtime.generate(["def f("], speccompile.GenerationParams(temperature=0.8, seed=1))
    print(result.text, result.stats.acceptance_rate)

Importing this package loads neither torch nor transformers; only `speccompile.compiler` needs them.
"""

from speccompile.errors import SpecCompileError

__version__ = "0.1.0"
__all__ = ["SpecCompileError", "load", "build", "GenerationParams", "TensorRTOptions", "__version__"]


def load(bundle_dir=None, backend: str = "auto", threads: int | None = None,
         shared_threads: bool | None = None, one_session: bool | None = None, prefill_chunk: int = 64,
         max_batch: int | None = None):
    """Open a bundle (default: the embedded demo pair's) and return a `Runtime` ready to `generate`.

    backend: "onnxruntime", "tensorrt", or "auto" (the default: the bundle's TensorRT engines where it
    has them and TensorRT is installed, else ONNX Runtime; one logged line says when engines go unused).

    Left at its defaults, each ONNX Runtime session has its own thread pool, released at the end of
    every run so that the other model's next run finds the cores free: as fast as one process-wide
    pool on the demo pair, and safe beside any ONNX Runtime sessions of the application's own.
    shared_threads=True runs on one process-wide pool instead, after which every other session this
    process creates must be made with `use_per_session_threads = False`
    (see runtime.onnxruntime_engine.shared_thread_pool).
    one_session: each model's calls all run on its one session graph, one copy of its weights in
    memory (True), or on a session per graph, faster for small models (False); default: one session
    for a target with 256 MiB of weights or more, and for its draft beside it. prefill_chunk: prompt
    tokens prefilled per engine iteration while other requests decode (see core/scheduler.py).
    max_batch: requests decoding at once, at most the bundle's (its default).

    The runtime serves requests on one engine thread, started on first use (`submit`, `generate`);
    `close()` or a `with` block stops it."""
    from pathlib import Path

    from speccompile.bundle import open_bundle

    if bundle_dir is None:
        from speccompile.demo import demo_bundle

        bundle_dir = demo_bundle()
    bundle = open_bundle(Path(bundle_dir))
    if backend == "onnxruntime" or (backend == "auto" and not bundle.manifest.engines):
        bundle.read_ahead()  # the weights come off the disk while the runtime's modules import
    from speccompile.runtime.runtime import load as _load

    return _load(bundle, backend=backend, threads=threads, shared_threads=shared_threads, one_session=one_session,
                 prefill_chunk=prefill_chunk, max_batch=max_batch)


def build(target_dir, draft_dir, out_dir, **options):
    """Compile a target/draft pair of HF checkpoints (or GGUF files) into a bundle: what `speccompile
    build` does, TensorRT engines included (backend="tensorrt", made as `tensorrt=TensorRTOptions(...)`
    says); the options are compiler.build.build_bundle's. Returns the bundle's path."""
    from speccompile.compiler.build import build_bundle

    return build_bundle(target_dir, draft_dir, out_dir, **options)


def __getattr__(name: str):
    # imported when asked for, so that `import speccompile` stays light (no numpy, no compiler):
    # TensorRTOptions lives with the TensorRT build, GenerationParams (a request's options) in core
    if name == "TensorRTOptions":
        from speccompile.compiler.tensorrt_build import TensorRTOptions

        return TensorRTOptions
    if name == "GenerationParams":
        from speccompile.core.params import GenerationParams

        return GenerationParams
    raise AttributeError(f"module 'speccompile' has no attribute {name!r}")
