"""EAGLE-3 draft heads (Li et al. 2025) as published: read, checked against a target, written.

An EAGLE-3 head drafts from the target's own hidden states. The target exposes the hidden state
*entering* three of its N decoder layers (`aux_layer_ids`, each in 0..N-1: id i is the input of
layer i, the output of layer i - 1, HF's `output_hidden_states[i]`; vLLM captures them so). They are
concatenated in ascending layer order, as the target's forward meets them, into 3·Ht features, and
at each position t:

    g_t   = fc(aux_t)                                            fused feature, [3·Ht] -> [H]
    x     = [input_layernorm(embed(token_{t+1})), hidden_norm(g_t)]          [2H]
    r     = hidden_norm(g_t) if norm_before_residual else g_t                the residual
    a     = r + o_proj(attention(q_proj x, k_proj x, v_proj x))    GQA, RoPE at position t
    h_t   = a + down_proj(silu(gate_proj y) * up_proj y),  y = post_attention_layernorm(a)
    draft = argmax(lm_head(norm(h_t)))           a draft-vocabulary id; target id = draft + d2t[draft]

token_{t+1} is the token the target produced from position t (the prompt's next token, or the one
just sampled after the last position). The head keeps its own one-layer KV cache over these
positions. From the second draft on, the head's own h (pre-`norm`) replaces g, with the previous
draft's embedding, one position further on. `t2d` marks the target ids the draft can produce.

Two layouts of the same weights are in the wild; both load to one record (`Eagle3Head`):

    EAGLE     (SafeAILab/EAGLE)     config.json architectures ["LlamaForCausalLMEagle3"], Llama fields at
                                    the top plus draft_vocab_size; tensors fc, midlayer.*, norm,
                                    lm_head, d2t, t2d (embed_tokens in some). The residual is g.
    SPECULATORS (vllm-project/      config.json speculators_model_type "eagle3", the layer's Llama fields
                 speculators)       under transformer_layer_config, draft_vocab_size,
                                    norm_before_residual (absent means true, as vLLM reads it),
                                    target_hidden_size, eagle_aux_hidden_state_layer_ids; tensors as
                                    above with layers.0.* for midlayer.*.

numpy + safetensors only: the compiler reads it without torch. bfloat16 files are widened here.
"""

import enum
import json
import math
import os
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np

from speccompile.errors import SpecCompileError, read_json_object, read_safetensors_header


class Layout(enum.Enum):
    EAGLE = "eagle"
    SPECULATORS = "speculators"


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int            # H, the head's width
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None   # HF's rope_scaling (rope_type, factor, ...); None for plain RoPE
    draft_vocab_size: int       # rows of lm_head
    vocab_size: int             # the target's vocabulary: t2d's length, embed_tokens' rows
    target_hidden_size: int     # Ht: fc reads 3·Ht
    aux_layer_ids: tuple[int, ...] | None  # None: the default (2, N // 2, N - 3) of an N-layer target
    norm_before_residual: bool


@dataclass(frozen=True, eq=False)
class Eagle3Head:
    """The head's weights, float32 ([out, in] as nn.Linear stores them), under one naming."""

    config: Eagle3Config
    fc: np.ndarray                        # [H, 3·Ht]
    input_layernorm: np.ndarray           # [H], on the token embedding
    hidden_norm: np.ndarray               # [H], on the fused feature
    q_proj: np.ndarray                    # [heads·head_dim, 2H]
    k_proj: np.ndarray                    # [kv_heads·head_dim, 2H]
    v_proj: np.ndarray                    # [kv_heads·head_dim, 2H]
    o_proj: np.ndarray                    # [H, heads·head_dim]
    post_attention_layernorm: np.ndarray  # [H]
    gate_proj: np.ndarray                 # [I, H]
    up_proj: np.ndarray                   # [I, H]
    down_proj: np.ndarray                 # [H, I]
    norm: np.ndarray                      # [H], before lm_head
    lm_head: np.ndarray                   # [draft vocab, H]
    d2t: np.ndarray                       # [draft vocab] int64: target id = draft id + d2t[draft id]
    t2d: np.ndarray                       # [vocab] bool: the target ids a draft can be
    embed_tokens: np.ndarray | None = None  # [vocab, H] where the checkpoint carries a copy of the target's


def head_tensors(head: Eagle3Head) -> dict[str, np.ndarray]:
    """The record's arrays by canonical name (embed_tokens only where present)."""
    found = {f.name: getattr(head, f.name) for f in fields(head) if f.name != "config"}
    return {name: array for name, array in found.items() if array is not None}


# ---------------------------------------------------------------------------------------------
# the two layouts' names: canonical name -> published tensor name (the layer's after its prefix)

CONFIG, WEIGHTS, INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
EAGLE_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
LAYER_PREFIX = {Layout.EAGLE: "midlayer.", Layout.SPECULATORS: "layers.0."}
LAYER_TENSORS = {
    "input_layernorm": "input_layernorm.weight", "hidden_norm": "hidden_norm.weight",
    "q_proj": "self_attn.q_proj.weight", "k_proj": "self_attn.k_proj.weight", "v_proj": "self_attn.v_proj.weight",
    "o_proj": "self_attn.o_proj.weight", "post_attention_layernorm": "post_attention_layernorm.weight",
    "gate_proj": "mlp.gate_proj.weight", "up_proj": "mlp.up_proj.weight", "down_proj": "mlp.down_proj.weight",
}
HEAD_TENSORS = {"fc": "fc.weight", "norm": "norm.weight", "lm_head": "lm_head.weight", "d2t": "d2t", "t2d": "t2d",
                "embed_tokens": "embed_tokens.weight"}
# saved by some trainers, unused when drafting (speculators' copies of the target's final norm and head)
IGNORED = ("verifier_lm_head.weight", "verifier_norm.weight")
DEFAULT_ROPE_THETA = 10000.0  # transformers' LlamaConfig default, which the EAGLE authors' configs rely on


def published_names(layout: Layout) -> dict[str, str]:
    prefix = LAYER_PREFIX[layout]
    return {**{name: prefix + suffix for name, suffix in LAYER_TENSORS.items()}, **HEAD_TENSORS}


def expected_shapes(c: Eagle3Config) -> dict[str, tuple[int, ...]]:
    h, q, kv, i = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, \
        c.intermediate_size
    return {"fc": (h, 3 * c.target_hidden_size), "input_layernorm": (h,), "hidden_norm": (h,), "q_proj": (q, 2 * h),
            "k_proj": (kv, 2 * h), "v_proj": (kv, 2 * h), "o_proj": (h, q), "post_attention_layernorm": (h,),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i), "norm": (h,),
            "lm_head": (c.draft_vocab_size, h), "d2t": (c.draft_vocab_size,), "t2d": (c.vocab_size,),
            "embed_tokens": (c.vocab_size, h)}


# ---------------------------------------------------------------------------------------------
# reading


def load_eagle3_head(path) -> Eagle3Head:
    """The head in directory `path` (either layout), or a SpecCompileError saying what is wrong."""
    path = Path(path)
    if not (path / CONFIG).is_file():
        raise SpecCompileError(f"{path}: not an EAGLE-3 head (no {CONFIG})")
    raw = read_json_object(path / CONFIG)
    layout = _layout(path, raw)
    config = _config(path / CONFIG, raw, layout)
    tensors = _named(path, _read_weights(path), config)
    return _checked(path, Eagle3Head(config=config, **tensors))


def _layout(path: Path, raw: dict) -> Layout:
    if "speculators_model_type" in raw:
        if raw["speculators_model_type"] != "eagle3":
            raise SpecCompileError(f"{path}: a speculators {raw['speculators_model_type']!r} model, "
                                   "not an EAGLE-3 head (speculators_model_type 'eagle3')")
        return Layout.SPECULATORS
    if any(a in EAGLE_ARCHITECTURES for a in raw.get("architectures") or []):
        return Layout.EAGLE
    raise SpecCompileError(f"{path}: not an EAGLE-3 head ({CONFIG} names architectures {raw.get('architectures')}; "
                           f"expected {EAGLE_ARCHITECTURES[0]} or speculators_model_type 'eagle3')")


def _config(file: Path, raw: dict, layout: Layout) -> Eagle3Config:
    """The head's fields from either config.json (the layer's own under transformer_layer_config in speculators')."""
    layer = raw.get("transformer_layer_config") if layout is Layout.SPECULATORS else raw
    if not isinstance(layer, dict):
        raise SpecCompileError(f"{file}: transformer_layer_config is missing or not an object")
    if layer.get("num_hidden_layers", 1) != 1:
        raise SpecCompileError(f"{file}: {layer.get('num_hidden_layers')} decoder layers; only one-layer EAGLE-3 "
                               "heads are supported")
    if layer.get("hidden_act", "silu") != "silu":
        raise SpecCompileError(f"{file}: activation {layer.get('hidden_act')!r}; only SiLU is supported")
    if raw.get("norm_before_fc") or layer.get("attention_bias") or layer.get("mlp_bias"):
        raise SpecCompileError(f"{file}: norm_before_fc, attention_bias and mlp_bias are not supported")
    hidden, heads = _positive(file, layer, "hidden_size"), _positive(file, layer, "num_attention_heads")
    theta, scaling = rope_of(file, layer)
    return Eagle3Config(
        hidden_size=hidden, num_attention_heads=heads,
        num_key_value_heads=_positive(file, layer, "num_key_value_heads", heads),
        head_dim=_positive(file, layer, "head_dim", hidden // heads),
        intermediate_size=_positive(file, layer, "intermediate_size"),
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
        draft_vocab_size=_positive(file, raw, "draft_vocab_size", layer.get("vocab_size")),
        vocab_size=_positive(file, layer, "vocab_size"),
        target_hidden_size=_positive(file, raw, "target_hidden_size", hidden),
        aux_layer_ids=_aux_ids(file, raw),
        # the EAGLE authors' layer takes the residual before hidden_norm; vLLM reads a missing
        # speculators field as true
        norm_before_residual=bool(raw.get("norm_before_residual", layout is Layout.SPECULATORS)))


def _positive(file: Path, config: dict, key: str, default=None) -> int:
    value = config.get(key)
    value = default if value is None else value
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise SpecCompileError(f"{file}: {key} is {value!r}, expected a positive integer")
    return value


def rope_of(file: Path, layer: dict) -> tuple[float, dict | None]:
    """(theta, scaling) from rope_theta + rope_scaling, or transformers 5's rope_parameters."""
    params = layer.get("rope_parameters") or layer.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise SpecCompileError(f"{file}: rope_scaling is {params!r}, expected an object")
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "type")}
    scaling.setdefault("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta") or layer.get("rope_theta") or DEFAULT_ROPE_THETA)
    return theta, None if scaling["rope_type"] == "default" else scaling


def _aux_ids(file: Path, raw: dict) -> tuple[int, ...] | None:
    """eagle_aux_hidden_state_layer_ids, as input-of-layer ids in ascending order (the order the
    target's forward meets them, whatever the file's). NVIDIA model-optimizer's exports keep theirs
    under eagle_config and mean the layer whose *output* they hooked: the input of the next one."""
    nested = raw.get("eagle_config") if isinstance(raw.get("eagle_config"), dict) else {}
    ids, offset = raw.get("eagle_aux_hidden_state_layer_ids"), 0
    if not ids and nested.get("eagle_aux_hidden_state_layer_ids"):
        ids, offset = nested["eagle_aux_hidden_state_layer_ids"], 1
    if not ids:
        return None
    if not isinstance(ids, list) or len(ids) != 3 or len(set(ids)) != 3 \
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise SpecCompileError(f"{file}: eagle_aux_hidden_state_layer_ids is {ids!r}, "
                               "expected three distinct layer ids >= 0")
    return tuple(sorted(i + offset for i in ids))


def _read_weights(path: Path) -> dict[str, np.ndarray]:
    if (path / WEIGHTS).is_file():
        return _read_safetensors(path / WEIGHTS)
    if (path / INDEX).is_file():
        weight_map = read_json_object(path / INDEX).get("weight_map")
        if not isinstance(weight_map, dict):
            raise SpecCompileError(f"{path / INDEX}: no weight_map object")
        tensors = {}
        for shard in sorted(set(weight_map.values())):
            tensors.update(_read_safetensors(path / shard))
        return tensors
    if (path / "pytorch_model.bin").is_file():
        raise SpecCompileError(f"{path}: weights are in pytorch_model.bin, which is read only with torch; "
                               f"save them as {WEIGHTS} (safetensors.torch.save_file) and load again")
    raise SpecCompileError(f"{path}: not an EAGLE-3 head (no {WEIGHTS} or {INDEX})")


def _named(path: Path, found: dict[str, np.ndarray], config: Eagle3Config) -> dict[str, np.ndarray]:
    """The published tensors under canonical names; an unknown tensor (a bias, a second layer, a
    q/k norm) would change the maths, so it is refused rather than left out."""
    layout = Layout.SPECULATORS if any(n.startswith(LAYER_PREFIX[Layout.SPECULATORS]) for n in found) \
        else Layout.EAGLE
    names = published_names(layout)
    unknown = sorted(set(found) - set(names.values()) - set(IGNORED))
    if unknown:
        raise SpecCompileError(f"{path}: tensor {unknown[0]} is not part of a one-layer EAGLE-3 head "
                               f"({len(unknown)} such tensors)")
    tensors = {canonical: found[name] for canonical, name in names.items() if name in found}
    if config.draft_vocab_size == config.vocab_size:  # an unreduced vocabulary may leave the maps out
        tensors.setdefault("d2t", np.zeros(config.vocab_size, np.int64))
        tensors.setdefault("t2d", np.ones(config.vocab_size, bool))
    missing = [names[n] for n in names if n not in tensors and n != "embed_tokens"]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise SpecCompileError(f"{path}: tensor {missing[0]} is missing{more}")
    return {name: _as_kind(name, array) for name, array in tensors.items()}


def _as_kind(name: str, array: np.ndarray) -> np.ndarray:
    if name == "d2t":
        return array.astype(np.int64)
    if name == "t2d":
        return array != 0
    return np.ascontiguousarray(array, dtype=np.float32)


def _checked(path: Path, head: Eagle3Head) -> Eagle3Head:
    """Every shape as the config implies, and d2t landing on target ids that t2d marks."""
    c, shapes = head.config, expected_shapes(head.config)
    for name, array in head_tensors(head).items():
        if array.shape != shapes[name]:
            raise SpecCompileError(f"{path}: tensor {name} has shape {list(array.shape)}, but {CONFIG} implies "
                                   f"{list(shapes[name])}")
    if c.draft_vocab_size > c.vocab_size:
        raise SpecCompileError(f"{path}: draft_vocab_size {c.draft_vocab_size} exceeds vocab_size {c.vocab_size}")
    targets = draft_to_target(head, np.arange(c.draft_vocab_size))
    wrong = np.flatnonzero((targets < 0) | (targets >= c.vocab_size))
    if wrong.size:
        raise SpecCompileError(f"{path}: d2t maps draft id {wrong[0]} to {targets[wrong[0]]}, outside the "
                               f"vocabulary of {c.vocab_size}")
    unmarked = np.flatnonzero(~head.t2d[targets])
    if unmarked.size:
        raise SpecCompileError(f"{path}: d2t maps draft id {unmarked[0]} to target id {targets[unmarked[0]]}, "
                               "which t2d does not mark")
    return head


def draft_to_target(head: Eagle3Head, draft_ids: np.ndarray) -> np.ndarray:
    return np.asarray(draft_ids, np.int64) + head.d2t[draft_ids]


def with_draft_vocab(head: Eagle3Head, target_ids: np.ndarray) -> Eagle3Head:
    """The head drafting only `target_ids`, a subset of the target ids it can draft: lm_head keeps their
    rows (in draft-id order), d2t and t2d map the fewer draft ids. Its greedy draft is unchanged
    wherever it was one of them, and each step scores fewer rows (as --draft-vocab cuts a draft's)."""
    targets = draft_to_target(head, np.arange(head.config.draft_vocab_size))
    keep = np.flatnonzero(np.isin(targets, np.asarray(target_ids, np.int64)))
    if len(keep) != len(np.unique(target_ids)):
        raise SpecCompileError("the EAGLE-3 head's vocabulary can only be cut to target ids it drafts")
    t2d = np.zeros_like(head.t2d)
    t2d[targets[keep]] = True
    config = replace(head.config, draft_vocab_size=len(keep))
    return replace(head, config=config, lm_head=head.lm_head[keep], d2t=targets[keep] - np.arange(len(keep)), t2d=t2d)


# safetensors' dtypes as numpy reads them; BF16 is read as its 16 bits and widened to float32
_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2", "I64": "<i8", "I32": "<i4", "I16": "<i2",
           "I8": "i1", "U8": "u1", "BOOL": "?"}


def _read_safetensors(file: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file, read whole."""
    header, data_start = read_safetensors_header(file)
    try:
        with open(file, "rb") as f:
            return {name: _read_tensor(f, data_start, name, info) for name, info in header.items()
                    if name != "__metadata__"}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise SpecCompileError(f"{file}: unreadable safetensors file ({e})") from None


def _read_tensor(f, data_start: int, name: str, info: dict) -> np.ndarray:
    dtype, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
    if dtype not in _DTYPES:
        raise ValueError(f"tensor {name} has dtype {dtype}")
    stored = np.dtype(_DTYPES[dtype])
    if end - begin != math.prod(shape) * stored.itemsize or begin < 0:
        raise ValueError(f"tensor {name}'s byte range does not fit its shape")
    f.seek(data_start + begin)
    array = np.fromfile(f, dtype=stored, count=math.prod(shape))
    if array.size != math.prod(shape):
        raise ValueError(f"tensor {name} lies outside the file")
    if dtype == "BF16":
        array = (array.astype(np.uint32) << 16).view(np.float32)
    return array.reshape(shape)


# ---------------------------------------------------------------------------------------------
# fitting a target


def _target_fields(target_config: dict) -> tuple[int | None, int | None, int | None]:
    """(hidden size, vocabulary, layers) of a HF config.json (a multimodal one's text_config; GPT-2's names)."""
    c = target_config.get("text_config") if isinstance(target_config.get("text_config"), dict) else target_config
    return (c.get("hidden_size", c.get("n_embd")), c.get("vocab_size"),
            c.get("num_hidden_layers", c.get("n_layer")))


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """EAGLE's default layers for an N-layer target, (2, N // 2, N - 3): three distinct ones only from N = 7."""
    ids = (2, num_layers // 2, num_layers - 3)
    if len(set(ids)) != 3 or ids[2] < 0:
        raise SpecCompileError(f"the EAGLE-3 head names no eagle_aux_hidden_state_layer_ids and the default "
                               f"{list(ids)} is not three distinct layers of a {num_layers}-layer target")
    return tuple(sorted(ids))


def aux_layer_ids(head: Eagle3Head, num_layers: int) -> tuple[int, int, int]:
    """The three target layers whose input hidden states the head reads, ascending: the head's own,
    or EAGLE's default (default_aux_layer_ids)."""
    return config_aux_layer_ids(head.config, num_layers)


def config_aux_layer_ids(config: "Eagle3Config", num_layers: int) -> tuple[int, int, int]:
    """aux_layer_ids of a head's config (what a trainer has before the head exists)."""
    ids = config.aux_layer_ids
    if ids is None:
        ids = default_aux_layer_ids(num_layers)
    if max(ids) >= num_layers:
        raise SpecCompileError(f"the EAGLE-3 head reads the input of target layer {max(ids)} (of {list(ids)}), but "
                               f"the target has {num_layers} layers (ids 0..{num_layers - 1})")
    return ids


def check_fits(head: Eagle3Head, target_config: dict) -> None:
    """Refuse, in one line, a head made for another target: a different hidden size (fc reads 3·Ht;
    a head without its own embedding borrows the target's, of width H), a vocabulary larger than the
    target's, or auxiliary layers the target does not have."""
    c = head.config
    hidden, vocab, layers = _target_fields(target_config)
    if not all(isinstance(v, int) for v in (hidden, vocab, layers)):
        raise SpecCompileError(f"the target's config has no integer hidden_size, vocab_size and num_hidden_layers "
                               f"(found {hidden!r}, {vocab!r}, {layers!r})")
    borrowed = head.embed_tokens is None
    if hidden != c.target_hidden_size or (borrowed and hidden != c.hidden_size):
        raise SpecCompileError(f"the EAGLE-3 head is for a target of hidden size {c.target_hidden_size}"
                               f"{'' if c.target_hidden_size == c.hidden_size else f' (its own {c.hidden_size})'}; "
                               f"this target's is {hidden}")
    if c.vocab_size > vocab:
        raise SpecCompileError(f"the EAGLE-3 head drafts over a vocabulary of {c.vocab_size} tokens; "
                               f"this target's has {vocab}")
    aux_layer_ids(head, layers)


# ---------------------------------------------------------------------------------------------
# writing


def write_eagle3_head(out_dir, head: Eagle3Head, layout: Layout, dtype: str = "float32") -> Path:
    """`head` as `layout` publishes it: model.safetensors (floats as `dtype`, float32 or float16;
    d2t int64, t2d bool) and config.json; each file written atomically."""
    from safetensors.numpy import save

    assert dtype in ("float32", "float16"), f"dtype {dtype}"
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = published_names(layout)
    tensors = {names[name]: np.ascontiguousarray(array if name in ("d2t", "t2d") else array.astype(dtype))
               for name, array in head_tensors(head).items()}
    config = _eagle_config(head.config) if layout is Layout.EAGLE else _speculators_config(head.config)
    config["torch_dtype"] = dtype
    write_atomically(out_dir / WEIGHTS, save(tensors))  # save_file would make it readable by its owner only
    write_atomically(out_dir / CONFIG, json.dumps(config, indent=1).encode())
    return out_dir


def _layer_fields(c: Eagle3Config) -> dict:
    rope = {"rope_theta": c.rope_theta, **({"rope_scaling": c.rope_scaling} if c.rope_scaling else {})}
    return {"model_type": "llama", "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.head_dim, "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": c.rms_norm_eps,
            "vocab_size": c.vocab_size, "tie_word_embeddings": False, **rope}


def _eagle_config(c: Eagle3Config) -> dict:
    config = {"architectures": [EAGLE_ARCHITECTURES[0]], **_layer_fields(c), "draft_vocab_size": c.draft_vocab_size}
    if c.target_hidden_size != c.hidden_size:
        config["target_hidden_size"] = c.target_hidden_size
    if c.aux_layer_ids is not None:
        config["eagle_aux_hidden_state_layer_ids"] = list(c.aux_layer_ids)
    if c.norm_before_residual:  # not the EAGLE authors' own layer, but vLLM reads the field in this layout
        config["norm_before_residual"] = True
    return config


def _speculators_config(c: Eagle3Config) -> dict:
    return {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "transformer_layer_config": _layer_fields(c), "draft_vocab_size": c.draft_vocab_size,
            "norm_before_residual": c.norm_before_residual,
            "target_hidden_size": None if c.target_hidden_size == c.hidden_size else c.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": None if c.aux_layer_ids is None else list(c.aux_layer_ids),
            "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                   "verifier": {"name_or_path": None, "architectures": []}}}


def write_atomically(file: Path, data: bytes) -> None:
    (file.parent / (file.name + ".tmp")).write_bytes(data)
    os.replace(file.parent / (file.name + ".tmp"), file)
