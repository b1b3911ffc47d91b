"""`build --backend tensorrt`: the bundle's ONNX graphs -> TensorRT engines, with our SpecAccept plugin.

The same ONNX files ONNX Runtime runs are parsed by TensorRT (through Polygraphy's loaders). The
plugin library is loaded first and the parser's ENABLE_PLUGIN_OVERRIDE flag is set where the parser
has it, so speccompile-domain nodes that carry plugin attributes go to the plugin instead of being
inlined. Graphs are fp32 in the ONNX and the network is strongly typed (TensorRT 10.x/11.x), so the
precision is the ONNX's. Engines and their manifest entries are added to the bundle atomically.
"""

import dataclasses
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

from speccompile.bundle import EngineEntry, GraphEntry, Manifest, open_bundle, sha256_file, write_manifest
from speccompile.compiler.gguf import KEPT_BLOCKS
from speccompile.core.tree import MAX_TREE_NODES
from speccompile.errors import SpecCompileError
from speccompile.progress import Progress
from speccompile.tensorrt_setup import gpu as gpu_info
from speccompile.tensorrt_setup import plugin_library, require_tensorrt

ENGINES_DIR = "engines"
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TensorRTOptions:
    """How TensorRT engines are built: the SpecAccept plugin library (default: $SPECCOMPILE_PLUGIN_LIB,
    else the repository's build/plugins), a timing cache file to load and update, and engines portable
    across Ampere+ GPUs (hardware_compat) or loadable by later TensorRT versions (version_compat)."""

    plugin_lib: str | Path | None = None
    timing_cache: str | Path | None = None
    hardware_compat: bool = False
    version_compat: bool = False


def require_tensorrt_build(options: TensorRTOptions):
    """(tensorrt, the plugin library's path), or one line saying what this machine lacks to build engines."""
    return require_tensorrt(), plugin_library(options.plugin_lib)


def optimization_profiles(entry: GraphEntry, max_batch: int, max_seq: int) -> list[list[tuple]]:
    """Per graph: [(input name, min, opt, max)] per profile.

    forward/sample graphs: one profile for prefill (tokens 1..max_seq) and one for decode/draft
    steps (tokens 1..2). Verification graphs have a fixed γ+1 and one profile. Batch is 1..max_batch.
    Token-tree graphs take any tree up to the largest a runtime sizes (their topology is an input).
    """
    nodes = (1, 16, MAX_TREE_NODES)
    token_ranges = [(1, max_seq // 4, max_seq), (1, 1, 2)] if not entry.id.verifies else [None]
    profiles = []
    for tokens in token_ranges:
        shapes = []
        for spec in entry.inputs:
            dims = spec.shape
            lo = [1 if d == "batch" else (tokens[0] if d == "tokens" else nodes[0] if d == "tree_nodes" else d)
                  for d in dims]
            opt = [1 if d == "batch" else (tokens[1] if d == "tokens" else nodes[1] if d == "tree_nodes" else d)
                   for d in dims]
            hi = [max_batch if d == "batch" else (tokens[2] if d == "tokens" else nodes[2] if d == "tree_nodes" else d)
                  for d in dims]
            shapes.append((spec.name, lo, opt, hi))
        profiles.append(shapes)
    return profiles


def build_engine(trt, onnx_path: Path, profiles, plugin: Path, timing_cache: Path | None, hardware_compat: bool,
                 version_compat: bool) -> bytes:
    from polygraphy.backend.trt import CreateConfig, EngineBytesFromNetwork, LoadPlugins, NetworkFromOnnxPath, Profile

    flags = [trt.OnnxParserFlag.ENABLE_PLUGIN_OVERRIDE] if hasattr(trt.OnnxParserFlag, "ENABLE_PLUGIN_OVERRIDE") else []
    parsed = NetworkFromOnnxPath(str(onnx_path), flags=flags, strongly_typed=True)
    network = LoadPlugins(plugins=[str(plugin)], obj=parsed)
    trt_profiles = []
    for shapes in profiles:
        profile = Profile()
        for name, lo, opt, hi in shapes:
            profile.add(name, min=lo, opt=opt, max=hi)
        trt_profiles.append(profile)
    config = CreateConfig(
        profiles=trt_profiles,
        load_timing_cache=str(timing_cache) if timing_cache and timing_cache.exists() else None,
        hardware_compatibility_level=trt.HardwareCompatibilityLevel.AMPERE_PLUS if hardware_compat else None,
        version_compatible=version_compat or None,
    )
    save_timing_cache = str(timing_cache) if timing_cache else None
    return EngineBytesFromNetwork(network, config=config, save_timing_cache=save_timing_cache)()


def check_tensorrt_weights(manifest: Manifest) -> None:
    """Whether TensorRT takes the bundle's weights (see check_tensorrt_sources)."""
    check_tensorrt_sources({role: model.source_format.kept for role, model in manifest.models.items()})


def check_tensorrt_sources(kept: dict[str, dict[str, int]]) -> None:
    """`kept`: per model, the GGUF block formats its weights keep (tensors per format). TensorRT
    block-dequantizes INT4 (and FP8/FP4) only: 4-bit formats are INT4 blocks it reads, 5-8-bit ones
    (kept as int8 blocks) do not parse. A build for TensorRT compiles those at its precision
    (ModelSpec.compile_at); a bundle built for ONNX Runtime keeps them."""
    for role, formats in kept.items():
        eight_bit = sorted(kind for kind in formats if KEPT_BLOCKS[kind].bits != 4)
        if eight_bit:
            raise SpecCompileError(f"the {role}'s GGUF {', '.join(eight_bit)} blocks are kept as int8 blocks, which "
                                   f"TensorRT does not dequantize; build the bundle with --backend tensorrt, which "
                                   f"compiles them at --{role}-weights")


def build_tensorrt_engines(bundle_dir, options: TensorRTOptions | None = None) -> dict[str, EngineEntry]:
    """Build one engine per graph of the bundle and record them in its manifest."""
    options = options or TensorRTOptions()
    bundle = open_bundle(bundle_dir)
    check_tensorrt_weights(bundle.manifest)
    trt, plugin = require_tensorrt_build(options)
    timing_cache = Path(options.timing_cache) if options.timing_cache else None
    manifest = bundle.manifest
    staging = bundle.path / f".{ENGINES_DIR}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    engines, gpu, progress = {}, gpu_info(), Progress(len(manifest.graphs), logger)
    try:
        for name, entry in manifest.graphs.items():
            progress.step(f"TensorRT engine for {name}")
            profiles = optimization_profiles(entry, manifest.max_batch, manifest.max_seq)
            data = build_engine(trt, bundle.graph_path(name), profiles, plugin, timing_cache, options.hardware_compat,
                                options.version_compat)
            (staging / f"{name}.engine").write_bytes(data)
            engines[name] = EngineEntry(f"{ENGINES_DIR}/{name}.engine", trt.__version__, gpu["gpu"],
                                        gpu["compute_capability"], len(profiles), options.hardware_compat,
                                        options.version_compat)
        shutil.rmtree(bundle.path / ENGINES_DIR, ignore_errors=True)
        staging.rename(bundle.path / ENGINES_DIR)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    hashes = {entry.file: sha256_file(bundle.path / entry.file) for entry in engines.values()}
    # the graphs were verified at open, the engines hashed here
    write_manifest(bundle.path, dataclasses.replace(manifest, engines=engines, files={**manifest.files, **hashes}))
    return engines
