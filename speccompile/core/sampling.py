"""Sampling controls, and the numpy reference of the sampling transforms and of inverse-CDF sampling.

These define the distribution speculative sampling preserves: the target's next-token distribution
after temperature, top-k and top-p, exactly as computed here (the in-graph ops and the plugin
kernels are tested against these functions). Every cut-off is a value threshold, so ties are kept
or dropped together and the result never depends on sort order.
"""

from dataclasses import dataclass

import numpy as np

from speccompile.errors import SpecCompileError


@dataclass
class Logprobs:
    """Log-probabilities a graph call reported (compiler/logits.py): at each row's scored positions,
    the emitted (or scored) token's, and the most likely tokens with theirs, best first."""

    token: np.ndarray  # [B, R]
    top: np.ndarray  # [B, R, K]
    top_ids: np.ndarray  # [B, R, K]

    def row(self, row: int, count: int, top: int) -> list[tuple[float, list[int], list[float]]]:
        """Row `row`'s first `count` positions: (token's log-probability, top ids, their log-probabilities)."""
        return [(float(self.token[row, r]), self.top_ids[row, r, :top].tolist(), self.top[row, r, :top].tolist())
                for r in range(count)]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off

    def __post_init__(self):
        if not self.temperature >= 0:
            raise SpecCompileError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise SpecCompileError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise SpecCompileError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def without_effect(self) -> list[str]:
        """Controls set but inert: top-k and top-p always keep the most likely token, so greedy
        decoding (temperature 0) is the same with or without them."""
        if not self.greedy:
            return []
        settings = ((f"top_k={self.top_k}", self.top_k > 0), (f"top_p={self.top_p}", self.top_p < 1))
        return [name for name, on in settings if on]


def transform(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """Probabilities (fp32, last axis) after temperature, top-k, top-p.

    temperature == 0: one-hot on the argmax (first maximum): greedy as a special case of sampling.
    top_k > 0: keep tokens whose scaled logit is >= the k-th largest.
    top_p < 1: keep the tokens whose probability is >= that of the m-th most likely token, where m is
               the smallest count whose cumulative probability reaches top_p; then renormalise.
    """
    logits = np.asarray(logits, dtype=np.float32)
    vocab = logits.shape[-1]
    if temperature == 0:
        return np.eye(vocab, dtype=np.float32)[logits.argmax(-1)]
    z = logits / np.float32(temperature)
    if 0 < top_k < vocab:
        kth = -np.sort(-z, axis=-1)[..., top_k - 1 : top_k]
        z = np.where(z >= kth, z, -np.inf)
    z = z - z.max(-1, keepdims=True)
    probs = np.exp(z)
    probs = (probs / probs.sum(-1, keepdims=True)).astype(np.float32)
    if top_p < 1.0:
        ordered = -np.sort(-probs, axis=-1)
        needed = np.minimum((np.cumsum(ordered, -1) < np.float32(top_p)).sum(-1, keepdims=True) + 1, vocab)
        threshold = np.take_along_axis(ordered, needed - 1, axis=-1)
        probs = np.where(probs >= threshold, probs, 0.0)
        probs = (probs / probs.sum(-1, keepdims=True)).astype(np.float32)
    return probs


def sample_from(weights: np.ndarray, uniform: np.ndarray) -> np.ndarray:
    """Inverse-CDF sampling along the last axis, one uniform in [0, 1) per row.

    Token t is chosen iff c_{t-1} <= u * c_{V-1} < c_t with c the inclusive prefix sums, so a token
    of zero weight is never chosen. Weights need not be normalised.
    """
    cdf = np.cumsum(np.asarray(weights, dtype=np.float32), axis=-1)
    scaled = np.asarray(uniform, dtype=np.float32)[..., None] * cdf[..., -1:]
    return np.minimum((cdf <= scaled).sum(-1), weights.shape[-1] - 1).astype(np.int64)


def gumbel_argmax(probs: np.ndarray, noise: np.ndarray) -> np.ndarray:
    """Gumbel-max sampling along the last axis: argmax of log p + G, G = -log(-log u) for the noise u
    (uniforms in [0, 1), shaped like probs). A token of zero probability scores -inf, never chosen."""
    with np.errstate(divide="ignore"):
        scores = np.log(np.asarray(probs, np.float32)) - np.log(-np.log(np.asarray(noise, np.float32)))
    return scores.argmax(-1).astype(np.int64)


def draws(rows: list, vocab: int, offset: int = 0, active=None) -> tuple:
    """What one sampled token of each row is drawn with (a sampling step's graph inputs): (uniform [B]
    for the rows by inverse CDF, coupled [B], noise [B, V] for the coupled rows, by Gumbel-max; both
    None when no row is coupled). offset: the output position after the row's last token (a draft
    step k: k); `active` rows only draw (others get inputs that are never read). Rows are requests
    (core/request.py), whose streams these draws advance."""
    uniform = np.full(len(rows), 0.5, dtype=np.float32)
    coupled = np.array([r.coupled for r in rows])
    noise = np.zeros((len(rows), vocab), dtype=np.float32) if coupled.any() else None
    for row, request in enumerate(rows):
        if request.rng is None or (active is not None and not active[row]):
            continue
        if request.coupled:
            request.noise(offset, noise[row : row + 1])
        else:
            uniform[row] = request.uniforms(1)[0]
    return uniform, (coupled if noise is not None else None), noise
