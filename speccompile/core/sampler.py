"""Sampling controls and per-sequence random streams.

Every sequence of a batch draws from its own generator, spawned from the request's seed by row
index, so a run is reproducible from its seed and a sequence's samples do not depend on what else is
in the batch. Uniforms are drawn in float32 directly: a float64 draw cast to float32 can round up
to 1.0, which inverse-CDF sampling must never see.
"""

from dataclasses import dataclass

import numpy as np

from speccompile.errors import SpecCompileError


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


class Sampler:
    """Graph inputs for the sampling controls, and uniforms from per-row generators."""

    def __init__(self, params: SamplingParams, batch: int, seed: int | None):
        self.params = params
        self.inputs = {
            "temperature": np.full(batch, params.temperature, dtype=np.float32),
            "top_k": np.full(batch, params.top_k, dtype=np.int64),
            "top_p": np.full(batch, params.top_p, dtype=np.float32),
        }
        self._rngs = [np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(batch)]

    def uniforms(self, count: int | None = None) -> np.ndarray:
        """[B] (count None) or [B, count] float32 uniforms in [0, 1), one row per sequence."""
        draws = [rng.random(1 if count is None else count, dtype=np.float32) for rng in self._rngs]
        return np.stack(draws)[:, 0] if count is None else np.stack(draws)
