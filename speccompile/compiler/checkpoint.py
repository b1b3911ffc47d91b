"""Read a local Hugging Face checkpoint (config.json + safetensors) or a GGUF file into the
canonical layout.

Only safetensors and GGUF are read (never pickle), and nothing is fetched or executed from the
checkpoint. Weights stay on disk as lazy tensors (see tensors.py) until the bundle writer needs
their bytes: loading a checkpoint reads its config and the shards' headers only. A GGUF file is
read as the Hugging Face checkpoint it was converted from (gguf.py): the same config keys, tensor
names and values, with its blocks (gguf.KEPT_BLOCKS: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K)
kept beside the values.
"""

import collections
import json
import logging
import math
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

from speccompile.compiler.architectures import ACTIVATIONS, ARCHITECTURES, Architecture
from speccompile.compiler.gguf import KEPT_BLOCKS, gguf_checkpoint, is_gguf
from speccompile.compiler.rope import SCALINGS, Rope, trained_positions
from speccompile.compiler.tensors import (
    LazyTensor,
    embedding_in_int8_blocks,
    rows,
    safetensors_tensors,
    shifted,
    split_part,
    transposed,
)
from speccompile.errors import SpecCompileError, read_json_object

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Source:
    """What a model was read from: "safetensors" or "gguf", and for a GGUF the tensors' formats, by
    what the build does with them (kept: blocks compiled as the file holds them; converted: the rest,
    dequantized to float32 and stored at the build's --*-weights)."""

    format: str
    kept: dict[str, int] = field(default_factory=dict)  # GGUF type name -> tensors
    converted: dict[str, int] = field(default_factory=dict)

    def describe(self) -> str:
        if self.format != "gguf":
            return self.format
        parts = [f"{n} {t}" for t, n in sorted(self.kept.items())]
        kept = f"kept {', '.join(parts)}" if parts else "nothing kept"
        moved = ", ".join(f"{n} {t}" for t, n in sorted(self.converted.items()))
        return f"GGUF: {kept} as blocks; dequantized {moved or 'nothing'}"


@dataclass
class ModelSpec:
    """A checkpoint reduced to what the graph builder needs."""

    path: Path
    model_type: str
    arch: Architecture
    hp: dict  # canonical hyper-parameters (see _hyper_parameters)
    config: dict  # the checkpoint's config.json, kept verbatim for the manifest
    weights: dict[str, LazyTensor]  # canonical name -> fp32 tensor, read from the checkpoint when loaded
    # where the tokenizer, generation_config.json and token frequencies are: the checkpoint directory,
    # or for a GGUF a temporary one written from the file's metadata (held open by `_keep`)
    files: Path = None
    source: Source = field(default_factory=lambda: Source("safetensors"))
    _keep: object = field(default=None, repr=False)

    def __post_init__(self):
        self.files = self.files or self.path

    def compile_at(self, matmul_weights: str, tensorrt: bool = False) -> None:
        """A GGUF's kept blocks stay for a quantized build (int8, int4: the file's own numbers beat a
        requantization); a float build multiplies by their exact values instead, as transformers'
        model of the file does. A build for TensorRT keeps the 4-bit ones only: it block-dequantizes
        INT4 but not INT8, so 5-8-bit blocks are compiled at `matmul_weights`. Says in one line what
        the build does with each format."""
        kept_bits = () if matmul_weights not in ("int8", "int4") else (4,) if tensorrt else (4, 8)
        if any(KEPT_BLOCKS[kind].bits not in kept_bits for kind in self.source.kept):
            self.weights = {name: w if w.blocks is None or w.blocks.bits in kept_bits else replace(w, blocks=None)
                            for name, w in self.weights.items()}
            kept, converted = {}, collections.Counter(self.source.converted)
            for kind, count in self.source.kept.items():
                (kept if KEPT_BLOCKS[kind].bits in kept_bits else converted)[kind] = count
            self.source = Source(self.source.format, kept, dict(converted))
        logger.info(f"  {self.path.name}: {self.source.describe()}; at {matmul_weights}")

    def store_embedding_at(self, matmul_weights: str) -> None:
        """A low-bit model (int8, int4, w8a8) keeps its token embedding in int8 blocks too, as llama.cpp's
        quantized files do (tensors.embedding_in_int8_blocks): on the 1.1B pair, 262 MB of float32
        per model where its int4 matrices are 550 MB. A float model keeps float32."""
        if matmul_weights in ("int8", "int4", "w8a8") and "embed" in self.weights:
            self.weights = {**self.weights, "embed": embedding_in_int8_blocks(self.weights["embed"])}

    @property
    def num_params(self) -> int:
        tied = self.hp["tie_embeddings"]
        return sum(w.size for name, w in self.weights.items() if not (tied and name == "lm_head"))


def load_checkpoint(path) -> ModelSpec:
    """A checkpoint directory, or a .gguf file."""
    path = Path(path)
    if path.is_file() and is_gguf(path):
        return _load_gguf(path)
    config = _read_config(path)
    arch = _architecture(path, config)
    hp = _hyper_parameters(path, config, arch)
    tensors = _read_safetensors(path)
    weights = _canonical_weights(path, tensors, arch, hp)
    return ModelSpec(path, config["model_type"], arch, hp, config, weights)


def _architecture(path: Path, config: dict) -> Architecture:
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise SpecCompileError(f"{path}: unsupported model_type {model_type!r} (supported: {supported})")
    return ARCHITECTURES[model_type]


def _load_gguf(path: Path) -> ModelSpec:
    """A GGUF file as the Hugging Face checkpoint it holds; its tokenizer, chat template and EOS ids
    are written as Hugging Face files into a temporary directory the spec keeps."""
    checkpoint = gguf_checkpoint(path)
    config = checkpoint.config
    arch = _architecture(path, config)
    hp = _hyper_parameters(path, config, arch)
    weights = _canonical_weights(path, checkpoint.tensors, arch, hp)
    files = tempfile.TemporaryDirectory(prefix="speccompile-gguf-")
    checkpoint.save_tokenizer(Path(files.name))
    generation = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": checkpoint.eos_token_ids}
    (Path(files.name) / "generation_config.json").write_text(json.dumps(generation))
    source = _gguf_source(checkpoint.formats, checkpoint.tensors)
    return ModelSpec(path, config["model_type"], arch, hp, config, weights, Path(files.name), source, files)


def _gguf_source(formats: dict[str, str], tensors: dict[str, LazyTensor]) -> Source:
    kept, converted = collections.Counter(), collections.Counter()
    for name, kind in formats.items():
        if kind == "F32":
            continue
        (kept if tensors[name].blocks is not None else converted)[kind] += 1
    return Source("gguf", dict(kept), dict(converted))


def check_max_seq(spec: ModelSpec, max_seq: int) -> None:
    """Refuse a cache capacity this model cannot attend over exactly. A sliding window is no limit:
    windowed layers mask keys beyond it (transformer._attention_mask), as HF does."""
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
    return min(trained_positions(rope) for rope in hp["layer_ropes"])


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
    _refuse_unsupported(path, config)
    types = _layer_types(path, config, hp["num_layers"])
    hp["layer_windows"] = _layer_windows(path, config, types)
    hp["sliding_window"] = next((w for w in hp["layer_windows"] if w is not None), None)
    hp["rope"], hp["layer_ropes"], hp["rotary_dim"] = None, None, None
    if arch.block == "llama":
        ropes = _ropes(path, config, hp["max_positions"])
        hp["layer_ropes"] = [ropes[kind] for kind in types]
        hp["rope"] = ropes["full_attention"]
        hp["rotary_dim"] = _rotary_dim(path, config, hp["head_dim"])
    hp["attn_scale"] = _attention_scale(path, config, hp)
    return hp


def _refuse_unsupported(path: Path, config: dict) -> None:
    """Config switches that change the maths in ways the graphs do not implement."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if config.get(key) is not None:
            raise SpecCompileError(f"{path}: {key} is not supported")
    if config.get("use_bidirectional_attention"):
        raise SpecCompileError(f"{path}: use_bidirectional_attention is not supported (decoders are causal here)")


# ---------------------------------------------------------------------------------------------
# attention layers: which see a sliding window, and with which rotary settings


LAYER_TYPES = ("full_attention", "sliding_attention")


def _layer_types(path: Path, config: dict, num_layers: int) -> list[str]:
    """Each layer's kind, as transformers derives it for the family when the config does not list them."""
    model_type = config["model_type"]
    types = config.get("layer_types")
    if types is None:
        window = config.get("sliding_window")
        if model_type == "gemma3_text":  # configs on the Hub give a pattern: every Nth layer is global
            pattern = config.get("sliding_window_pattern") or 6
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
        elif model_type in ("qwen2", "qwen3"):
            first = config.get("max_window_layers", num_layers) if config.get("use_sliding_window") and window else None
            types = ["sliding_attention" if first is not None and i >= first else "full_attention"
                     for i in range(num_layers)]
        elif model_type in ("mistral", "phi3") and window is not None:
            types = ["sliding_attention"] * num_layers
        else:
            types = ["full_attention"] * num_layers
    if not isinstance(types, list) or len(types) != num_layers or not set(types) <= set(LAYER_TYPES):
        raise SpecCompileError(f"{path}: layer_types must list {num_layers} of {', '.join(LAYER_TYPES)}")
    return types


def _layer_windows(path: Path, config: dict, types: list[str]) -> list:
    """Per layer: the number of keys (the query's own included) a query sees, or None for all of them."""
    model_type, window = config["model_type"], config.get("sliding_window")
    if model_type in ("qwen2", "qwen3") and not config.get("use_sliding_window"):
        window = None  # transformers ignores the stated window unless use_sliding_window is set
    if window is not None and (not isinstance(window, int) or window < 1):
        raise SpecCompileError(f"{path}: sliding_window must be a positive integer, got {window!r}")
    return [window if kind == "sliding_attention" and window is not None else None for kind in types]


def _ropes(path: Path, config: dict, max_positions: int) -> dict[str, Rope]:
    """The rotary settings of each layer type. Gemma 3 gives its sliding layers their own base
    (rope_local_base_freq) and no scaling; transformers 5 nests both under rope_parameters."""
    nested = config.get("rope_parameters") or {}
    if set(LAYER_TYPES) & set(nested):
        return {kind: _rope(path, {**config, "rope_scaling": None, "rope_parameters": nested.get(kind)}, max_positions)
                for kind in LAYER_TYPES}
    full = _rope(path, config, max_positions)
    if config["model_type"] != "gemma3_text":
        return dict.fromkeys(LAYER_TYPES, full)
    local = Rope("default", float(config.get("rope_local_base_freq") or 10000.0), max_positions)
    return {"full_attention": full, "sliding_attention": local}


def _rope(path: Path, config: dict, max_positions: int) -> Rope:
    """The rotary settings as transformers reads them (RotaryEmbeddingConfigMixin), checked."""
    rope_type, theta, params = _rope_parameters(config)
    if rope_type not in SCALINGS:
        supported = ", ".join(SCALINGS)
        raise SpecCompileError(f"{path}: rope scaling {rope_type!r} is not supported (supported: {supported})")
    params.pop("partial_rotary_factor", None)  # read by _rotary_dim
    if rope_type in ("llama3", "yarn", "longrope"):
        # HF: a top-level value wins (Phi-3 style), then the dict's, then max_position_embeddings
        original = config.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
        params["original_max_position_embeddings"] = original or max_positions
    missing = [key for key in SCALINGS[rope_type].required if params.get(key) is None]
    if missing:
        raise SpecCompileError(f"{path}: rope scaling {rope_type!r} needs {', '.join(missing)} in its parameters")
    return Rope(rope_type, theta, max_positions, params)


def _rotary_dim(path: Path, config: dict, head_dim: int) -> int:
    """How many of each head's dimensions RoPE turns (the first ones): Phi-4-mini turns 3/4 of them."""
    params = config.get("rope_parameters") or {}
    if set(LAYER_TYPES) & set(params):
        params = params.get("full_attention") or {}
    factor = params.get("partial_rotary_factor") or config.get("partial_rotary_factor") or 1.0
    dim = int(head_dim * factor)  # as HF computes it
    if not 0 < factor <= 1 or dim % 2:
        raise SpecCompileError(f"{path}: partial_rotary_factor {factor} turns {dim} of {head_dim} dimensions; "
                               f"it must turn an even number of them")
    return dim


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


def _attention_scale(path: Path, config: dict, hp: dict) -> float:
    if config.get("scale_attn_by_inverse_layer_idx"):
        raise SpecCompileError(f"{path}: scale_attn_by_inverse_layer_idx is not supported")
    if config["model_type"] == "gpt2" and config.get("scale_attn_weights") is False:
        return 1.0
    if config["model_type"] == "gemma3_text":  # Gemma scales by a stated number, not the head size
        return float(config.get("query_pre_attn_scalar") or hp["head_dim"]) ** -0.5
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


def _transform(tensor: LazyTensor, transform: str, hp: dict) -> LazyTensor:
    if transform == "same":
        return tensor
    if transform == "linear":
        return transposed(tensor)
    if transform == "plus_one":
        return shifted(tensor, 1.0)
    if transform.startswith("rows/"):  # a fused nn.Linear: its output rows, then [in, out] as "linear"
        q, kv = hp["num_heads"] * hp["head_dim"], hp["num_kv_heads"] * hp["head_dim"]
        half = tensor.shape[0] // 2
        spans = {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv), "gate": (0, half), "up": (half, 2 * half)}
        return transposed(rows(tensor, *spans[transform[5:]]))
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
            weights[name] = _transform(tensor, transform, hp)
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
