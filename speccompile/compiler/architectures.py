"""Supported architectures, declared as data.

Each entry says which HF config keys hold the hyper-parameters and where each weight lives in the
checkpoint. The graph builder (`transformer.py`) reads only the canonical names used here, so adding
a family is a few lines in `ARCHITECTURES`, not a new class.

Canonical weight layout (what the graph builder consumes), with every matrix stored as
[in_features, out_features] so that the graph computes `x @ W`:

    embed [V, H]; pos_embed [P, H] (learned positions only)
    layers.{i}.attn_norm_w / attn_norm_b, q_w/q_b, k_w/k_b, v_w/v_b, o_w/o_b
    layers.{i}.q_norm_w / k_norm_w [D] (per-head norms of q and k, `qk_norm` families only)
    layers.{i}.attn_out_norm_w / mlp_out_norm_w (norms of the attention and MLP outputs, `sandwich_norms` only)
    layers.{i}.mlp_norm_w / mlp_norm_b, gate_w (gated MLP only), up_w/up_b, down_w/down_b
    final_norm_w / final_norm_b; lm_head [H, V] (absent when tied to `embed`)

Where a family differs from Llama in its graph (Qwen3's q/k norms, Gemma 3's four norms per block
and scaled embeddings), the difference is a flag of the block read by transformer.py; where it
differs in storage only (Phi-3's fused projections, Gemma's norms of x·(1+w)), it is a transform.
"""

from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class Architecture:
    block: str  # "llama": RMSNorm, rotary, gated SiLU MLP.  "gpt2": LayerNorm, learned positions, GELU MLP.
    fields: dict[str, str]  # canonical hyper-parameter -> HF config key
    defaults: dict[str, object]  # canonical hyper-parameter -> value when the key is absent
    weights: dict[str, tuple[str, str]]  # canonical weight -> (HF tensor name, transform)
    optional: frozenset[str] = field(default_factory=frozenset)  # weights a checkpoint may omit
    name_prefixes: tuple[str, ...] = ("",)  # tried in order in front of every HF tensor name
    # graph features of the "llama" block (transformer.py)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # norms on the attention and MLP outputs too, before each residual add (Gemma 3)
    embed_scale: bool = False  # embeddings multiplied by sqrt(hidden_size) (Gemma)


# Transforms applied to an HF tensor to reach the canonical layout.
#   "same":   stored as we need it
#   "linear": torch.nn.Linear stores [out, in]; we want [in, out]
#   "qkv/N":  GPT-2's fused Conv1D c_attn holds [q | k | v] along the last axis; take part N
#   "rows/q", "rows/k", "rows/v": Phi-3's fused nn.Linear qkv_proj holds q, k and v rows ([Hq·D | Hkv·D |
#             Hkv·D] along its output axis); take one, as "linear" does
#   "rows/gate", "rows/up": Phi-3's fused gate_up_proj holds the gate's rows, then the up projection's
#   "plus_one": Gemma's RMSNorm computes x·(1 + w); the graph's RMSNormalization scales by 1 + w
TRANSFORMS = ("same", "linear", "qkv/0", "qkv/1", "qkv/2", "rows/q", "rows/k", "rows/v", "rows/gate", "rows/up",
              "plus_one")


def _llama_weights() -> dict[str, tuple[str, str]]:
    layer = "model.layers.{i}."
    weights = {
        "embed": ("model.embed_tokens.weight", "same"),
        "final_norm_w": ("model.norm.weight", "same"),
        "lm_head": ("lm_head.weight", "linear"),
        "layers.{i}.attn_norm_w": (layer + "input_layernorm.weight", "same"),
        "layers.{i}.mlp_norm_w": (layer + "post_attention_layernorm.weight", "same"),
    }
    for ours, theirs in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "o_proj")):
        weights[f"layers.{{i}}.{ours}_w"] = (layer + f"self_attn.{theirs}.weight", "linear")
        weights[f"layers.{{i}}.{ours}_b"] = (layer + f"self_attn.{theirs}.bias", "same")
    for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
        weights[f"layers.{{i}}.{ours}_w"] = (layer + f"mlp.{theirs}.weight", "linear")
        weights[f"layers.{{i}}.{ours}_b"] = (layer + f"mlp.{theirs}.bias", "same")
    return weights


def _qk_norm_weights(transform: str = "same") -> dict[str, tuple[str, str]]:
    layer = "model.layers.{i}.self_attn."
    return {"layers.{i}.q_norm_w": (layer + "q_norm.weight", transform),
            "layers.{i}.k_norm_w": (layer + "k_norm.weight", transform)}


def _gemma3_weights() -> dict[str, tuple[str, str]]:
    weights = {**_llama_weights(), **_qk_norm_weights("plus_one")}
    layer = "model.layers.{i}."
    norms = {"final_norm_w": "model.norm.weight",
             "layers.{i}.attn_norm_w": layer + "input_layernorm.weight",
             "layers.{i}.attn_out_norm_w": layer + "post_attention_layernorm.weight",
             "layers.{i}.mlp_norm_w": layer + "pre_feedforward_layernorm.weight",
             "layers.{i}.mlp_out_norm_w": layer + "post_feedforward_layernorm.weight"}
    weights.update({ours: (theirs, "plus_one") for ours, theirs in norms.items()})
    return weights


def _phi3_weights() -> dict[str, tuple[str, str]]:
    weights = {name: entry for name, entry in _llama_weights().items() if not name.endswith("_b")}
    layer = "model.layers.{i}."
    for part in ("q", "k", "v"):
        weights[f"layers.{{i}}.{part}_w"] = (layer + "self_attn.qkv_proj.weight", f"rows/{part}")
    for part in ("gate", "up"):
        weights[f"layers.{{i}}.{part}_w"] = (layer + "mlp.gate_up_proj.weight", f"rows/{part}")
    return weights


def _gpt2_weights() -> dict[str, tuple[str, str]]:
    layer = "h.{i}."
    weights = {
        "embed": ("wte.weight", "same"),
        "pos_embed": ("wpe.weight", "same"),
        "final_norm_w": ("ln_f.weight", "same"),
        "final_norm_b": ("ln_f.bias", "same"),
        "lm_head": ("lm_head.weight", "linear"),
        "layers.{i}.attn_norm_w": (layer + "ln_1.weight", "same"),
        "layers.{i}.attn_norm_b": (layer + "ln_1.bias", "same"),
        "layers.{i}.mlp_norm_w": (layer + "ln_2.weight", "same"),
        "layers.{i}.mlp_norm_b": (layer + "ln_2.bias", "same"),
        "layers.{i}.o_w": (layer + "attn.c_proj.weight", "same"),
        "layers.{i}.o_b": (layer + "attn.c_proj.bias", "same"),
        "layers.{i}.up_w": (layer + "mlp.c_fc.weight", "same"),
        "layers.{i}.up_b": (layer + "mlp.c_fc.bias", "same"),
        "layers.{i}.down_w": (layer + "mlp.c_proj.weight", "same"),
        "layers.{i}.down_b": (layer + "mlp.c_proj.bias", "same"),
    }
    for part, ours in enumerate("qkv"):
        weights[f"layers.{{i}}.{ours}_w"] = (layer + "attn.c_attn.weight", f"qkv/{part}")
        weights[f"layers.{{i}}.{ours}_b"] = (layer + "attn.c_attn.bias", f"qkv/{part}")
    return weights


_LLAMA_BIASES = frozenset(f"layers.{{i}}.{p}_b" for p in ("q", "k", "v", "o", "gate", "up", "down"))

LLAMA = Architecture(
    block="llama",
    fields={
        "vocab_size": "vocab_size",
        "hidden_size": "hidden_size",
        "num_layers": "num_hidden_layers",
        "num_heads": "num_attention_heads",
        "num_kv_heads": "num_key_value_heads",
        "head_dim": "head_dim",
        "intermediate_size": "intermediate_size",
        "norm_eps": "rms_norm_eps",
        "max_positions": "max_position_embeddings",
        "tie_embeddings": "tie_word_embeddings",
        "activation": "hidden_act",
    },
    defaults={"num_kv_heads": None, "head_dim": None, "tie_embeddings": False, "activation": "silu"},
    weights=_llama_weights(),
    # Biases exist only where the family or config says so (Qwen2: q/k/v; Llama attention_bias: all four).
    optional=_LLAMA_BIASES | {"lm_head"},
)

GPT2 = Architecture(
    block="gpt2",
    fields={
        "vocab_size": "vocab_size",
        "hidden_size": "n_embd",
        "num_layers": "n_layer",
        "num_heads": "n_head",
        "intermediate_size": "n_inner",
        "norm_eps": "layer_norm_epsilon",
        "max_positions": "n_positions",
        "tie_embeddings": "tie_word_embeddings",
        "activation": "activation_function",
    },
    defaults={"intermediate_size": None, "tie_embeddings": True, "activation": "gelu_new"},
    weights=_gpt2_weights(),
    optional=frozenset({"lm_head"}),
    # Checkpoints saved from GPT2LMHeadModel prefix the body with "transformer."; the original ones do not.
    name_prefixes=("transformer.", ""),
)

QWEN3 = replace(LLAMA, weights={**_llama_weights(), **_qk_norm_weights()}, qk_norm=True)

GEMMA3 = replace(
    LLAMA,
    fields={**LLAMA.fields, "activation": "hidden_activation"},
    defaults={**LLAMA.defaults, "tie_embeddings": True, "activation": "gelu_pytorch_tanh"},
    weights=_gemma3_weights(),
    qk_norm=True, sandwich_norms=True, embed_scale=True,
)

PHI3 = replace(LLAMA, weights=_phi3_weights(), optional=frozenset({"lm_head"}))

ARCHITECTURES: dict[str, Architecture] = {
    "llama": LLAMA,  # also SmolLM, TinyLlama (model_type "llama")
    "mistral": LLAMA,  # sliding windows: checkpoint._layer_windows
    "qwen2": LLAMA,
    "qwen3": QWEN3,
    "gemma3_text": GEMMA3,
    "phi3": PHI3,  # Phi-3, Phi-3.5 and Phi-4-mini
    "gpt2": GPT2,
}

# Activation names each block accepts (HF spellings): the llama block's gated MLP is SiLU or GELU-tanh.
ACTIVATIONS = {"llama": {"silu", "swish", "gelu_pytorch_tanh"}, "gpt2": {"gelu_new", "gelu_pytorch_tanh"}}
