"""`inspect`: what a bundle holds, from its manifest (graphs, engines, shapes, op counts)."""

from speccompile.bundle import Bundle, GraphEntry, kv_cache_bytes_per_sequence


def _is_cache(name: str) -> bool:
    return name.startswith(("past_key", "past_value", "present_key", "present_value"))


def describe(bundle: Bundle) -> dict:
    m = bundle.manifest
    size = sum(p.stat().st_size for p in bundle.path.rglob("*") if p.is_file())
    return {
        "path": str(bundle.path),
        "format_version": m.format_version,
        "size_mb": round(size / 1e6, 2),
        "gammas": list(m.gammas),
        "max_seq": m.max_seq,
        "max_batch": m.max_batch,
        "vocab_size": m.vocab_size,
        "models": {role: {**{k: getattr(info, k) for k in MODEL_KEYS}, "source_format": info.source_format.to_json()}
                   for role, info in m.models.items()},
        "graphs": {name: _graph(g) for name, g in m.graphs.items()},
        "engines": {name: engine.to_json() for name, engine in m.engines.items()},
        "memory": memory(bundle),
    }


MODEL_KEYS = ("model_type", "num_params", "num_layers", "hidden_size", "num_heads", "num_kv_heads")


def _graph(entry: GraphEntry) -> dict:
    """A manifest graph entry as inspect shows it: inputs and outputs without the KV cache's."""
    return {"nodes": entry.nodes, "op_counts": entry.op_counts,
            "inputs": {i.name: [i.dtype, list(i.shape)] for i in entry.inputs if not _is_cache(i.name)},
            "outputs": {o.name: [o.dtype, list(o.shape)] for o in entry.outputs if not _is_cache(o.name)},
            "tensorrt_needs_plugin": bool(entry.tensorrt_needs_plugin),
            "single_sequence_nodes": entry.single_sequence.nodes if entry.single_sequence else None}


def memory(bundle: Bundle) -> dict:
    """What running the bundle costs in memory, per model (docs/performance.md "Memory"): its weights, whether
    the ONNX Runtime backend holds them once (one session graph) or once per graph it runs, and its
    float32 KV cache per sequence and for a full batch of `max_batch` sequences at `max_seq`."""
    from speccompile.runtime.onnxruntime_engine import ONE_SESSION_MIN_BYTES

    out = {}
    for role, info in bundle.manifest.models.items():
        weights = (bundle.path / info.weights_file).stat().st_size
        per_sequence = kv_cache_bytes_per_sequence(info, bundle.max_seq)
        one = info.session is not None and weights >= ONE_SESSION_MIN_BYTES
        out[role] = {"weights_bytes": weights, "matmul_weights": info.matmul_weights,
                     "weight_copies": "one" if one else "one per graph run",
                     "kv_cache_bytes_per_sequence": per_sequence,
                     "kv_cache_bytes_at_max_batch": per_sequence * bundle.max_batch}
    return out

