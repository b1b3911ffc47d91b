"""Per-sequence generation statistics."""

import time
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class GenerationStats:
    mode: str  # "speculative" or "autoregressive"
    gamma: int  # draft tokens per iteration (0 for autoregressive; the largest used when γ is adaptive)
    new_tokens: int = 0
    iterations: int = 0  # target passes after prefill (verifications, or decode steps)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_at: list[int] = field(default_factory=list)  # accepted_at[k]: iterations whose draft k+1 was kept
    prefill_ms: float = 0.0
    draft_ms: float = 0.0  # batch-wide: sequences of one batch share these clocks
    verify_ms: float = 0.0
    decode_ms: float = 0.0
    total_ms: float = 0.0
    gammas_used: dict[int, int] = field(default_factory=dict)  # γ -> iterations run at it

    def __post_init__(self):
        self.accepted_at = self.accepted_at or [0] * self.gamma

    def record_iteration(self, accepted: int, gamma: int | None = None) -> None:
        """One iteration that proposed `gamma` drafts (default: self.gamma) and kept `accepted`."""
        self.iterations += 1
        self.draft_tokens += self.gamma if gamma is None else gamma
        self.accepted_tokens += accepted
        used = self.gamma if gamma is None else gamma
        self.gammas_used[used] = self.gammas_used.get(used, 0) + 1
        for k in range(accepted):
            self.accepted_at[k] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Draft tokens kept per iteration (0..γ); each iteration also emits one target token."""
        return self.accepted_tokens / self.iterations if self.iterations else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """Fraction of iterations in which draft k (1-based, index k-1) was accepted."""
        return [count / self.iterations if self.iterations else 0.0 for count in self.accepted_at]

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / (self.total_ms / 1e3) if self.total_ms else 0.0

    def to_dict(self) -> dict:
        return {
            "mode": self.mode,
            "gamma": self.gamma,
            "gammas_used": self.gammas_used,
            "new_tokens": self.new_tokens,
            "iterations": self.iterations,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "acceptance_by_position": self.acceptance_by_position,
            "prefill_ms": self.prefill_ms,
            "draft_ms": self.draft_ms,
            "verify_ms": self.verify_ms,
            "decode_ms": self.decode_ms,
            "total_ms": self.total_ms,
            "tokens_per_s": self.tokens_per_s,
        }


class Clock:
    """Accumulates wall time per phase name."""

    def __init__(self):
        self.ms: dict[str, float] = {}
        self._start = time.perf_counter()

    @contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.ms[phase] = self.ms.get(phase, 0.0) + (time.perf_counter() - start) * 1e3

    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self._start) * 1e3
