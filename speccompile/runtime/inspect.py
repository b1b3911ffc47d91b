"""`inspect`: what a bundle holds, from its manifest (graphs, engines, shapes, op counts), as records
whose `to_json()` is `speccompile inspect --json`'s output (speccompile/present.py renders them)."""

from dataclasses import asdict, dataclass

from speccompile.bundle import Bundle, EngineEntry, GraphEntry, ModelEntry, SourceFormat, kv_cache_bytes_per_sequence


def _is_cache(name: str) -> bool:
    return name.startswith(("past_key", "past_value", "present_key", "present_value"))


@dataclass(frozen=True)
class ModelInfo:
    model_type: str
    num_params: int
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    source_format: SourceFormat

    @classmethod
    def of(cls, entry: ModelEntry) -> "ModelInfo":
        return cls(entry.model_type, entry.num_params, entry.num_layers, entry.hidden_size, entry.num_heads,
                   entry.num_kv_heads, entry.source_format)

    def to_json(self) -> dict:
        return {**{k: v for k, v in asdict(self).items() if k != "source_format"},
                "source_format": self.source_format.to_json()}


@dataclass(frozen=True)
class GraphInfo:
    """A manifest graph entry as inspect shows it: inputs and outputs without the KV cache's."""

    nodes: int
    op_counts: dict[str, int]
    inputs: dict[str, list]  # name -> [dtype, shape]
    outputs: dict[str, list]
    tensorrt_needs_plugin: bool
    single_sequence_nodes: int | None

    @classmethod
    def of(cls, entry: GraphEntry) -> "GraphInfo":
        return cls(entry.nodes, dict(entry.op_counts),
                   {i.name: [i.dtype, list(i.shape)] for i in entry.inputs if not _is_cache(i.name)},
                   {o.name: [o.dtype, list(o.shape)] for o in entry.outputs if not _is_cache(o.name)},
                   bool(entry.tensorrt_needs_plugin), entry.single_sequence.nodes if entry.single_sequence else None)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ModelMemory:
    """What running a model costs in memory: its weights, whether the ONNX Runtime backend holds them
    once (one session graph) or once per graph it runs, and its float32 KV cache per sequence and for
    a full batch of `max_batch` sequences at `max_seq` (docs/performance.md "Memory")."""

    weights_bytes: int
    matmul_weights: str
    weight_copies: str  # "one" or "one per graph run"
    kv_cache_bytes_per_sequence: int
    kv_cache_bytes_at_max_batch: int

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class BundleInfo:
    path: str
    format_version: int
    size_mb: float
    gammas: list[int]
    max_seq: int
    max_batch: int
    vocab_size: int
    models: dict[str, ModelInfo]
    graphs: dict[str, GraphInfo]
    engines: dict[str, EngineEntry]
    memory: dict[str, ModelMemory]

    def to_json(self) -> dict:
        plain = {k: getattr(self, k) for k in ("path", "format_version", "size_mb", "gammas", "max_seq", "max_batch",
                                               "vocab_size")}
        return {**plain, **{name: {key: value.to_json() for key, value in getattr(self, name).items()}
                            for name in ("models", "graphs", "engines", "memory")}}


def describe(bundle: Bundle) -> BundleInfo:
    m = bundle.manifest
    size = sum(p.stat().st_size for p in bundle.path.rglob("*") if p.is_file())
    return BundleInfo(str(bundle.path), m.format_version, round(size / 1e6, 2), list(m.gammas), m.max_seq,
                      m.max_batch, m.vocab_size, {role: ModelInfo.of(info) for role, info in m.models.items()},
                      {name: GraphInfo.of(g) for name, g in m.graphs.items()}, dict(m.engines), memory(bundle))


def memory(bundle: Bundle) -> dict[str, ModelMemory]:
    """Each model's ModelMemory."""
    from speccompile.runtime.onnxruntime_engine import runs_one_session

    out = {}
    for role, info in bundle.manifest.models.items():
        weights = (bundle.path / info.weights_file).stat().st_size
        per_sequence = kv_cache_bytes_per_sequence(info, bundle.max_seq)
        one = runs_one_session(bundle, role)
        out[role] = ModelMemory(weights, info.matmul_weights, "one" if one else "one per graph run", per_sequence,
                                per_sequence * bundle.max_batch)
    return out
