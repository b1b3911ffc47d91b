"""One generation request and everything it owns: its token history, sampling parameters and
random stream, its limits and stop conditions, its statistics, and where its tokens go.

The scheduler (`scheduler.py`) is the only writer of a request's state, on its own thread; other
threads read a request after it finished, or set `cancelled`.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from speccompile.core.proposers import NgramIndex, new_acceptance
from speccompile.core.sampler import SamplingParams
from speccompile.core.stats import GenerationStats

AUTO = "auto"  # γ chosen each iteration by the scheduler's policy for the current load
FINISH_REASONS = ("stop", "length", "cancelled", "error")

# Given a request's generated tokens so far, the number of them to keep if a stop condition (a stop
# string, in the runtime) completed in them, else None.
StopCheck = Callable[[list[int]], int | None]


@dataclass(eq=False)
class Request:
    prompt: list[int]
    max_new_tokens: int
    params: SamplingParams = SamplingParams()
    seed: int | np.random.SeedSequence | None = None
    gamma: int | str = AUTO  # drafts per iteration at most: a compiled γ, 0 (plain decoding) or AUTO
    allow_plain: bool = True  # under AUTO: may the policy decode plainly (γ = 0) where speculation does not pay?
    stop_token_ids: frozenset[int] = frozenset()  # besides the model's EOS; kept in the tokens, as EOS
    stop_check: StopCheck | None = None
    on_tokens: Callable[[list[int]], None] | None = None  # newly accepted tokens, as they are accepted
    on_finish: Callable[["Request"], None] | None = None
    proposer: str = "draft"  # "draft" (the draft model), "ngram" (prompt lookup) or "auto": see proposers.py
    p_min: float = 0.0  # the draft model stops drafting at a token it gives less probability (0: never)
    lookup_priors: dict[int, float] | None = None  # prompt lookup's kept rate per matched length (a profile's)
    # Medusa trees (core/tree.py): "exact" (greedy, lossless) or "typical" (approximate, opt-in: its
    # (epsilon, delta)); a typical request batched with exact ones is verified exactly meanwhile
    acceptance_rule: str = "exact"
    typical: tuple[float, float] = (0.09, 0.3)
    # -- state, written by the scheduler --
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: Exception | None = None
    cancelled: bool = False  # set by any thread; the scheduler retires the request at its next iteration
    stats: GenerationStats = field(init=False)

    def __post_init__(self):
        self.tokens = list(self.prompt)  # prompt + generated: the history the draft catches up from
        self.prefilled = 0  # prompt tokens in the caches so far (chunked prefill)
        self.rng = None if self.params.greedy else np.random.default_rng(self.seed)
        self.stats = GenerationStats("autoregressive" if self.gamma == 0 else "speculative", self.gamma)
        self.submitted = time.perf_counter()
        self.stats.acceptance = self.acceptance_rule
        self.ngram = NgramIndex() if self.proposer in ("ngram", "auto") else None
        self.next_tree = None  # Medusa: the heads' tree from the last verification (None: none yet)
        # this request's own acceptance per draft position, per proposer (what "auto" chooses by)
        self.acceptance = new_acceptance(self.lookup_priors)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.generated)

    def uniforms(self, count: int) -> np.ndarray:
        """The next `count` draws of this request's own stream (float32 in [0, 1)). Draws happen in a
        fixed order per iteration, so its samples depend on its seed and its γ, not its company."""
        return self.rng.random(count, dtype=np.float32)

    def emit(self, tokens, eos_ids: set[int]) -> None:
        """Append accepted tokens, stopping at EOS or a stop token (kept), max_new_tokens, or a
        stop check; pass the kept ones on."""
        kept = []
        for token in map(int, tokens):
            kept.append(token)
            if token in eos_ids or token in self.stop_token_ids:
                self.finish_reason = "stop"
                break
            if len(self.generated) + len(kept) >= self.max_new_tokens:
                self.finish_reason = "length"
                break
        start = len(self.generated)
        self.generated.extend(kept)
        self.tokens.extend(kept)
        if self.stop_check is not None:
            keep = self.stop_check(self.generated)
            if keep is not None:
                del self.generated[keep:]
                self.finish_reason = "stop"
        if self.on_tokens is not None and len(self.generated) > start:
            self.on_tokens(self.generated[start:])
        if start == 0 and self.generated:
            self.stats.ttft_ms = (time.perf_counter() - self.submitted) * 1e3

    def finish(self, reason: str, error: Exception | None = None) -> None:
        assert reason in FINISH_REASONS, reason
        self.finish_reason = self.finish_reason or reason
        self.error = error
        self.stats.new_tokens = len(self.generated)
        self.stats.total_ms = (time.perf_counter() - self.submitted) * 1e3
        if self.stats.gamma == AUTO and self.stats.iterations and not self.stats.draft_tokens:
            self.stats.mode = "autoregressive"  # the policy judged that speculation does not pay here
        if self.on_finish is not None:
            self.on_finish(self)
