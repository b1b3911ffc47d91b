"""Rotary position embeddings as data: HF's RoPE scaling types, each one numpy function.

transformers (`modeling_rope_utils.py`) turns a config's rope parameters into inverse frequencies
and an attention factor, and applies q*cos + rotate_half(q)*sin with cos, sin = cos/sin(position ×
inv_freq) × attention factor. Each function below is the numpy twin of HF's for one `rope_type`,
in float32 and in HF's order of operations: the inverse frequencies equal HF's bit for bit, and the
tables built from them (transformer.rope_tables) are within an ulp of torch's cos/sin. Each type
also says how many positions a model that uses it is meant to attend over (`Scaling.span`): the
limit a build's --max-seq is checked against.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Rope:
    """A model's rotary settings as its config states them (read by checkpoint._rope)."""

    rope_type: str  # a key of SCALINGS
    theta: float
    max_positions: int  # the config's max_position_embeddings: dynamic and yarn read it, as HF does
    params: dict = field(default_factory=dict)  # the type's other keys: factor, original_max_position_embeddings, ...


@dataclass(frozen=True)
class Scaling:
    """One rope_type: its maths, and the --max-seq it allows (see the registry's notes)."""

    # (rope, rotary dim, the build's cache capacity) -> inv_freq [D/2], factor
    frequencies: Callable[[Rope, int, int], tuple[np.ndarray, float]]
    span: Callable[[Rope], int]  # positions a model with this scaling attends over
    span_rule: str  # how span is derived, for the --max-seq error
    required: tuple[str, ...] = ()  # parameters the config must give (as HF's validation requires)


def inverse_frequencies(rope: Rope, head_dim: int, max_seq: int = 0) -> tuple[np.ndarray, float]:
    """inv_freq [head_dim/2] (float32) and the factor HF multiplies cos and sin by. `head_dim` is the
    rotary dimension (all of a head but for partial rotary); `max_seq` the cache capacity the tables
    are built for, which only LongRoPE reads (its factor set)."""
    inv_freq, attention = SCALINGS[rope.rope_type].frequencies(rope, head_dim, max_seq)
    return inv_freq.astype(np.float32), float(attention)


def trained_positions(rope: Rope) -> tuple[int, str]:
    """The longest cache a build may have for this model, and the rule that gives it."""
    scaling = SCALINGS[rope.rope_type]
    return scaling.span(rope), scaling.span_rule


# ---------------------------------------------------------------------------------------------
# one function per rope_type (numpy keeps float32 with Python scalars, as torch does)


def _plain(theta: float, head_dim: int) -> np.ndarray:
    # HF: 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim))


def _default(rope: Rope, head_dim: int, max_seq: int) -> tuple[np.ndarray, float]:
    return _plain(rope.theta, head_dim), 1.0


def _linear(rope: Rope, head_dim: int, max_seq: int) -> tuple[np.ndarray, float]:
    # Position interpolation: position / factor, applied to the frequencies instead.
    return _plain(rope.theta, head_dim) / rope.params["factor"], 1.0


def _dynamic(rope: Rope, head_dim: int, max_seq: int) -> tuple[np.ndarray, float]:
    # HF enlarges the base only once a call's last position reaches past max_position_embeddings
    # (seq_len > max_positions); below that seq_len is clamped to max_positions, where the
    # expression is the plain base. Static tables can hold just that, so the span stops there too.
    factor, seq_len = rope.params["factor"], rope.max_positions
    base = rope.theta * ((factor * seq_len / rope.max_positions) - (factor - 1)) ** (head_dim / (head_dim - 2))
    return _plain(base, head_dim), 1.0


def _llama3(rope: Rope, head_dim: int, max_seq: int) -> tuple[np.ndarray, float]:
    # Wavelengths shorter than original/high_freq_factor are kept, longer than original/low_freq_factor
    # are divided by factor, and those in between are interpolated between the two.
    p = rope.params
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_context = p["original_max_position_embeddings"]
    inv_freq = _plain(rope.theta, head_dim)
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_context / high) & ~(wavelen > old_context / low)
    return np.where(medium, smoothed, scaled), 1.0


def _yarn_mscale(scale: float, mscale: float = 1) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_attention_factor(p: dict, factor: float) -> float:
    # YaRN's "mscale": a temperature on the attention logits, applied (as HF does) to cos and sin.
    if p.get("attention_factor") is not None:
        return p["attention_factor"]
    if p.get("mscale") and p.get("mscale_all_dim"):
        return _yarn_mscale(factor, p["mscale"]) / _yarn_mscale(factor, p["mscale_all_dim"])
    return _yarn_mscale(factor)


def _yarn_correction_range(p: dict, head_dim: int, theta: float) -> tuple[float, float]:
    """The dimensions between full extrapolation (fast rotations) and full interpolation (slow ones)."""
    def dim_of(rotations):  # the dimension that turns `rotations` times over the original context
        span = p["original_max_position_embeddings"] / (rotations * 2 * math.pi)
        return head_dim * math.log(span) / (2 * math.log(theta))

    low, high = dim_of(p.get("beta_fast") or 32), dim_of(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, head_dim - 1)


def _yarn_factor(rope: Rope) -> float:
    # HF: a null factor is the ratio of the stated to the original context (DeepSeek-V3 style)
    return rope.params.get("factor") or rope.max_positions / rope.params["original_max_position_embeddings"]


def _yarn(rope: Rope, head_dim: int, max_seq: int) -> tuple[np.ndarray, float]:
    factor = _yarn_factor(rope)
    low, high = _yarn_correction_range(rope.params, head_dim, rope.theta)
    high = high + 0.001 if low == high else high  # HF: prevents a division by zero
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # per dimension, the weight of the unscaled frequency
    pos_freqs = rope.theta ** (np.arange(0, head_dim, 2).astype(np.float32) / head_dim)
    interpolated, extrapolated = 1.0 / (factor * pos_freqs), 1.0 / pos_freqs
    inv_freq = interpolated * (1 - extrapolation) + extrapolated * extrapolation
    return inv_freq, _yarn_attention_factor(rope.params, factor)


def _longrope(rope: Rope, head_dim: int, max_seq: int) -> tuple[np.ndarray, float]:
    # Phi-3's LongRoPE: per-dimension factors dividing the frequencies, a short set for contexts up
    # to original_max_position_embeddings and a long set beyond. HF switches sets when a call's last
    # position passes the original length (keys already cached keep their old rotation); static
    # tables cannot follow that, so the set is chosen once per build by its capacity, as llama.cpp
    # chooses it by its context size: a bundle within the original length is HF's short-context
    # model exactly, a longer one is the long-context model from its first token.
    p = rope.params
    original = p["original_max_position_embeddings"]
    factors = np.asarray(p["long_factor"] if max_seq > original else p["short_factor"], np.float32)
    factor = p.get("factor") or rope.max_positions / original
    attention = p.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    shape = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
    return 1.0 / (factors * rope.theta ** shape), attention


# ---------------------------------------------------------------------------------------------
# the registry
#
# Spans follow what vLLM takes as a model's length (config._get_and_verify_max_len), which is also
# what each scaling was trained or tuned for:
#   default, llama3  max_position_embeddings as stated: Meta's Llama 3.1/3.2 configs give the extended
#                    length there (131072, with original 8192 and factor 8: original × factor undercounts)
#   linear           max_position_embeddings × factor: positions are divided by factor, so factor times
#                    the configured positions land on angles the model has seen
#   yarn             original_max_position_embeddings × factor: Qwen2.5 enables YaRN (factor 4, original
#                    32768) on a config whose max_position_embeddings stays 32768
#   longrope         max_position_embeddings (Phi-3's long-context configs state the extended length there)
#   dynamic          vLLM would allow × factor too, but HF's dynamic NTK recomputes the frequencies from
#                    each call's length beyond max_position_embeddings (and the cache keeps keys rotated
#                    with earlier ones), which no static table reproduces: up to there it is plain RoPE

SCALINGS: dict[str, Scaling] = {
    "default": Scaling(_default, lambda r: r.max_positions, "max_position_embeddings"),
    "linear": Scaling(_linear, lambda r: int(r.max_positions * r.params["factor"]),
                      "max_position_embeddings × linear factor", ("factor",)),
    "dynamic": Scaling(_dynamic, lambda r: r.max_positions,
                       "max_position_embeddings: beyond it dynamic NTK changes its frequencies with each call's "
                       "length, which static tables cannot follow", ("factor",)),
    "llama3": Scaling(_llama3, lambda r: r.max_positions, "max_position_embeddings",
                      ("factor", "low_freq_factor", "high_freq_factor")),
    "yarn": Scaling(_yarn, lambda r: int(r.params["original_max_position_embeddings"] * _yarn_factor(r)),
                    "original_max_position_embeddings × yarn factor"),
    "longrope": Scaling(_longrope, lambda r: r.max_positions, "max_position_embeddings",
                        ("long_factor", "short_factor")),
}

