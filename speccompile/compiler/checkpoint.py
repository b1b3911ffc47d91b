"""Read a local Hugging Face checkpoint (config.json + safetensors) into the canonical layout.

Only safetensors are read (never pickle), and nothing is fetched or executed from the checkpoint.
Weights stay on disk as lazy tensors (see tensors.py) until the bundle writer needs their bytes:
loading a checkpoint reads its config and the shards' headers only.
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path

from speccompile.compiler.architectures import ACTIVATIONS, ARCHITECTURES, Architecture
from speccompile.compiler.rope import SCALINGS, Rope, trained_positions
from speccompile.compiler.tensors import (
    LazyTensor,
    safetensors_tensors,
    split_part,
    transposed,
)
from speccompile.errors import SpecCompileError, read_json_object


@dataclass
class ModelSpec:
    """A checkpoint reduced to what the graph builder needs."""

    path: Path
    model_type: str
    arch: Architecture
    hp: dict  # canonical hyper-parameters (see _hyper_parameters)
    config: dict  # the checkpoint's config.json, kept verbatim for the manifest
    weights: dict[str, LazyTensor]  # canonical name -> fp32 tensor, read from the checkpoint when loaded

    @property
    def num_params(self) -> int:
        tied = self.hp["tie_embeddings"]
        return sum(w.size for name, w in self.weights.items() if not (tied and name == "lm_head"))


def load_checkpoint(path) -> ModelSpec:
    path = Path(path)
    config = _read_config(path)
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise SpecCompileError(f"{path}: unsupported model_type {model_type!r} (supported: {supported})")
    arch = ARCHITECTURES[model_type]
    hp = _hyper_parameters(path, config, arch)
    tensors = _read_safetensors(path)
    weights = _canonical_weights(path, tensors, arch, hp)
    return ModelSpec(path, model_type, arch, hp, config, weights)


def check_max_seq(spec: ModelSpec, max_seq: int) -> None:
    """Refuse a cache capacity this model cannot attend over exactly."""
    window = spec.hp["sliding_window"]
    if window is not None and max_seq > window:
        raise SpecCompileError(
            f"{spec.path}: sliding-window attention (window {window}) is not supported; "
            f"build with --max-seq {window} or less, where full attention is identical"
        )
    limit, rule = _trained_positions(spec.hp)
    if max_seq > limit:
        raise SpecCompileError(
            f"{spec.path}: --max-seq {max_seq} exceeds the model's {limit} positions ({rule}); "
            f"build with --max-seq {limit} or less"
        )


def _trained_positions(hp: dict) -> tuple[int, str]:
    """How many positions the model attends over, and the rule that says so: learned positions are
    a table of that size; RoPE's span depends on its scaling (see rope.SCALINGS)."""
    if hp["rope"] is None:
        return hp["max_positions"], "learned positions"
    return trained_positions(hp["rope"])


# ---------------------------------------------------------------------------------------------
# config


def _read_config(path: Path) -> dict:
    if not path.is_dir():
        raise SpecCompileError(f"checkpoint directory not found: {path}")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise SpecCompileError(f"{path}: no config.json (expected a Hugging Face checkpoint directory)")
    return read_json_object(config_file)


def _hyper_parameters(path: Path, config: dict, arch: Architecture) -> dict:
    hp = {}
    for ours, key in arch.fields.items():
        if key in config and config[key] is not None:
            hp[ours] = config[key]
        elif ours in arch.defaults:
            hp[ours] = arch.defaults[ours]
        else:
            raise SpecCompileError(f"{path}/config.json: missing {key!r}")
    hp["num_kv_heads"] = hp.get("num_kv_heads") or hp["num_heads"]
    hp["head_dim"] = hp.get("head_dim") or hp["hidden_size"] // hp["num_heads"]
    hp["intermediate_size"] = hp["intermediate_size"] or 4 * hp["hidden_size"]
    if hp["num_heads"] % hp["num_kv_heads"]:
        raise SpecCompileError(f"{path}: {hp['num_heads']} attention heads is not a multiple of "
                               f"{hp['num_kv_heads']} KV heads")
    if hp["activation"] not in ACTIVATIONS[arch.block]:
        raise SpecCompileError(f"{path}: activation {hp['activation']!r} is not supported for {config['model_type']}")
    hp["rope"] = _rope(path, config, hp["max_positions"]) if arch.block == "llama" else None
    hp["sliding_window"] = _sliding_window(config)
    hp["attn_scale"] = _attention_scale(path, config, hp)
    return hp


def _rope(path: Path, config: dict, max_positions: int) -> Rope:
    """The rotary settings as transformers reads them (RotaryEmbeddingConfigMixin), checked."""
    rope_type, theta, params = _rope_parameters(config)
    if rope_type not in SCALINGS:
        supported = ", ".join(SCALINGS)
        raise SpecCompileError(f"{path}: rope scaling {rope_type!r} is not supported (supported: {supported})")
    partial = params.pop("partial_rotary_factor", None) or config.get("partial_rotary_factor") or 1.0
    if partial != 1.0:
        raise SpecCompileError(f"{path}: partial_rotary_factor {partial} is not supported (RoPE over whole heads only)")
    if rope_type in ("llama3", "yarn"):
        # HF: a top-level value wins (Phi-3 style), then the dict's, then max_position_embeddings
        original = config.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
        params["original_max_position_embeddings"] = original or max_positions
    missing = [key for key in SCALINGS[rope_type].required if params.get(key) is None]
    if missing:
        raise SpecCompileError(f"{path}: rope scaling {rope_type!r} needs {', '.join(missing)} in its parameters")
    return Rope(rope_type, theta, max_positions, params)


def _rope_parameters(config: dict) -> tuple[str, float, dict]:
    """rope_type, rope_theta and the scaling's other parameters, from either style of config."""
    # transformers >= 5 nests everything, rope_theta included, under rope_parameters; older configs
    # have a rope_scaling dict (rope_type, or the legacy `type`) next to a top-level rope_theta.
    # HF takes rope_scaling first when a config has both.
    params = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    theta = params.pop("rope_theta", None) or config.get("rope_theta") or 10000.0
    return rope_type, float(theta), params


def _sliding_window(config: dict):
    if config["model_type"] == "mistral":
        return config.get("sliding_window")
    if config["model_type"] == "qwen2" and config.get("use_sliding_window"):
        return config.get("sliding_window")
    return None


def _attention_scale(path: Path, config: dict, hp: dict) -> float:
    if config.get("scale_attn_by_inverse_layer_idx"):
        raise SpecCompileError(f"{path}: scale_attn_by_inverse_layer_idx is not supported")
    if config["model_type"] == "gpt2" and config.get("scale_attn_weights") is False:
        return 1.0
    return 1.0 / math.sqrt(hp["head_dim"])


# ---------------------------------------------------------------------------------------------
# weights


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as e:
            raise SpecCompileError(f"{index}: malformed index ({e})") from None
        files = [path / shard for shard in shards]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise SpecCompileError(f"{path}: shards listed in {index.name} are missing: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    if any(path.glob("*.bin")) or any(path.glob("*.pt")):
        raise SpecCompileError(f"{path}: only pickle weights (.bin/.pt) found; convert them to safetensors")
    raise SpecCompileError(f"{path}: no *.safetensors weights")


def _read_safetensors(path: Path) -> dict[str, LazyTensor]:
    """Every tensor of the checkpoint by name, lazily: only the shards' headers are read here."""
    tensors = {}
    for file in _safetensors_files(path):
        tensors.update(safetensors_tensors(file))
    return tensors


def _transform(tensor: LazyTensor, transform: str) -> LazyTensor:
    if transform == "same":
        return tensor
    if transform == "linear":
        return transposed(tensor)
    assert transform.startswith("qkv/"), f"unknown weight transform {transform}"
    return split_part(tensor, 3, int(transform[4:]))


def _find(tensors: dict, arch: Architecture, hf_name: str):
    for prefix in arch.name_prefixes:
        if prefix + hf_name in tensors:
            return tensors[prefix + hf_name]
    return None


def _canonical_weights(path: Path, tensors: dict, arch: Architecture, hp: dict) -> dict[str, LazyTensor]:
    weights = {}
    for ours, (theirs, transform) in arch.weights.items():
        layers = range(hp["num_layers"]) if "{i}" in ours else [None]
        for i in layers:
            name, hf_name = ours.format(i=i), theirs.format(i=i)
            tensor = _find(tensors, arch, hf_name)
            if tensor is None:
                if ours in arch.optional:
                    continue
                raise SpecCompileError(f"{path}: weight {hf_name!r} missing from the safetensors files")
            weights[name] = _transform(tensor, transform)
    if hp["tie_embeddings"] or "lm_head" not in weights:
        if not hp["tie_embeddings"]:
            raise SpecCompileError(f"{path}: weight 'lm_head.weight' missing and embeddings are not tied")
        weights["lm_head"] = transposed(weights["embed"])
    _check_shapes(path, weights, hp)
    return weights


def _check_shapes(path: Path, weights: dict, hp: dict) -> None:
    expected = {
        "embed": (hp["vocab_size"], hp["hidden_size"]),
        "lm_head": (hp["hidden_size"], hp["vocab_size"]),
        "layers.0.q_w": (hp["hidden_size"], hp["num_heads"] * hp["head_dim"]),
        "layers.0.k_w": (hp["hidden_size"], hp["num_kv_heads"] * hp["head_dim"]),
        "layers.0.up_w": (hp["hidden_size"], hp["intermediate_size"]),
    }
    for name, shape in expected.items():
        if name in weights and weights[name].shape != shape:
            raise SpecCompileError(f"{path}: weight {name} has shape {weights[name].shape}, config implies {shape}")
