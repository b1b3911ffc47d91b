"""`inspect`: what a bundle holds, from its manifest (graphs, engines, shapes, op counts)."""

from speccompile.bundle import Bundle, kv_cache_bytes_per_sequence


def _is_cache(name: str) -> bool:
    return name.startswith(("past_key", "past_value", "present_key", "present_value"))


def describe(bundle: Bundle) -> dict:
    m = bundle.manifest
    size = sum(p.stat().st_size for p in bundle.path.rglob("*") if p.is_file())
    return {
        "path": str(bundle.path),
        "format_version": m["format_version"],
        "size_mb": round(size / 1e6, 2),
        "gammas": m["gammas"],
        "max_seq": m["max_seq"],
        "max_batch": m["max_batch"],
        "vocab_size": m["vocab_size"],
        "models": {role: {**{k: info[k] for k in MODEL_KEYS}, "source_format": info.get("source_format")}
                   for role, info in m["models"].items()},
        "graphs": {name: _graph(g) for name, g in m["graphs"].items()},
        "engines": m.get("engines", {}),
        "memory": memory(bundle),
    }


MODEL_KEYS = ("model_type", "num_params", "num_layers", "hidden_size", "num_heads", "num_kv_heads")


def _graph(entry: dict) -> dict:
    """A manifest graph entry as inspect shows it: inputs and outputs without the KV cache's."""
    return {"nodes": entry["nodes"], "op_counts": entry["op_counts"],
            "inputs": {i["name"]: [i["dtype"], i["shape"]] for i in entry["inputs"] if not _is_cache(i["name"])},
            "outputs": {o["name"]: [o["dtype"], o["shape"]] for o in entry["outputs"] if not _is_cache(o["name"])},
            "tensorrt_needs_plugin": bool(entry.get("tensorrt_needs_plugin")),
            "single_sequence_nodes": entry["single_sequence"]["nodes"] if "single_sequence" in entry else None}


def memory(bundle: Bundle) -> dict:
    """What running the bundle costs in memory, per model (README "Memory"): its weights, whether
    the ONNX Runtime backend holds them once (one session graph) or once per graph it runs, and its
    float32 KV cache per sequence and for a full batch of `max_batch` sequences at `max_seq`."""
    from speccompile.runtime.onnxruntime_engine import ONE_SESSION_MIN_BYTES

    m = bundle.manifest
    out = {}
    for role, info in m["models"].items():
        weights = (bundle.path / info["weights_file"]).stat().st_size
        per_sequence = kv_cache_bytes_per_sequence(info, m["max_seq"])
        one = "session" in info and weights >= ONE_SESSION_MIN_BYTES
        out[role] = {"weights_bytes": weights, "matmul_weights": info.get("matmul_weights", "float32"),
                     "weight_copies": "one" if one else "one per graph run",
                     "kv_cache_bytes_per_sequence": per_sequence,
                     "kv_cache_bytes_at_max_batch": per_sequence * m["max_batch"]}
    return out


def _source(source: dict | None) -> str:
    """", from GGUF: kept 12 Q8_0; dequantized 30 Q4_K" for a GGUF source; nothing for safetensors."""
    if not source or source["format"] != "gguf":
        return ""
    kept = ", ".join(f"{n} {kind}" for kind, n in sorted(source["kept"].items())) or "nothing"
    converted = ", ".join(f"{n} {kind}" for kind, n in sorted(source["converted"].items())) or "nothing"
    return f"; from GGUF: kept {kept} as blocks, dequantized {converted}"


def render(info: dict) -> str:
    lines = [f"bundle {info['path']}  ({info['size_mb']} MB, format {info['format_version']})",
             f"γ {info['gammas']}  max_seq {info['max_seq']}  max_batch {info['max_batch']}  "
             f"vocab {info['vocab_size']}"]
    for role, model in info["models"].items():
        lines.append(f"{role}: {model['model_type']}, {model['num_params'] / 1e6:.2f}M params, "
                     f"{model['num_layers']} layers, hidden {model['hidden_size']}, {model['num_heads']} heads / "
                     f"{model['num_kv_heads']} KV heads{_source(model['source_format'])}")
    for role, mem in info["memory"].items():
        folded = ", float32 in memory" if mem["matmul_weights"] in ("float16", "bfloat16") else ""
        lines.append(f"{role} memory: weights {mem['weights_bytes'] / 1e6:.1f} MB "
                     f"({mem['matmul_weights']} matmuls{folded}), {mem['weight_copies']} copy at run time; "
                     f"KV cache {mem['kv_cache_bytes_per_sequence'] / 1e6:.1f} MB per sequence, "
                     f"{mem['kv_cache_bytes_at_max_batch'] / 1e6:.1f} MB at max_batch")
    lines.append("graphs (the KV cache inputs/outputs past_*/present_* are omitted):")
    for name, graph in info["graphs"].items():
        top = ", ".join(f"{op} {n}" for op, n in sorted(graph["op_counts"].items(), key=lambda kv: -kv[1])[:6])
        plugin = "  [TensorRT: plugin needed]" if graph["tensorrt_needs_plugin"] else ""
        variant = graph["single_sequence_nodes"]
        single = "" if variant is None else f"; batch-1 variant {variant} nodes"
        lines.append(f"  {name}: {graph['nodes']} nodes ({top}){plugin}{single}")
        lines.append("    in:  " + "; ".join(f"{k} {v[0]}{v[1]}" for k, v in graph["inputs"].items()))
        lines.append("    out: " + "; ".join(f"{k} {v[0]}{v[1]}" for k, v in graph["outputs"].items()))
    if info["engines"]:
        lines.append("TensorRT engines:")
        for name, engine in info["engines"].items():
            lines.append(f"  {name}: {engine['file']} (TensorRT {engine['tensorrt_version']}, {engine['gpu']}, "
                         f"sm {engine['compute_capability']})")
    else:
        lines.append("TensorRT engines: none (build with --backend tensorrt on an NVIDIA machine)")
    return "\n".join(lines)
