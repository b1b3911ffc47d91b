"""One generation request and everything it owns: its token history, sampling parameters and
random stream, its proposer, its limits and stop conditions, its statistics, and where its tokens go.

The scheduler (`scheduler.py`) is the only writer of a request's state, on its own thread; other
threads read a request after it finished, or set `cancelled` or `stop_at` (a stop string found at the
edge, runtime/edge.py).

Random numbers. A sampled request draws from its own stream (`seed`), by one of two rules (see
core/acceptance.py). Coupled (the default): the token at output position i is the Gumbel-max draw of
the target's distribution there with the noise of position i, the i-th block of the stream, whoever
proposes that position and however many drafts an iteration carries; the draft model proposes for
position i by Gumbel-max with the same noise, and the target's draw decides. So a seeded request's
tokens depend on its prompt, seed and sampling parameters only: not on γ, the proposer, or the
requests beside it. Rejection: draws are taken in the order the iterations consume them (each draft's
acceptance test, each correction), so the tokens also depend on γ and on what was proposed.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from speccompile.core.params import GenerationParams
from speccompile.core.processors import Processors
from speccompile.core.sampling import SamplingParams
from speccompile.core.stats import GenerationStats

AUTO = "auto"  # γ chosen each iteration by the scheduler's policy for the current load
FINISH_REASONS = ("stop", "length", "cancelled", "error")
SAMPLING_RULES = ("coupled", "rejection")


@dataclass(eq=False)
class Request:
    prompt: list[int]
    max_new_tokens: int
    params: SamplingParams = SamplingParams()
    seed: int | np.random.SeedSequence | None = None
    gamma: int | str = AUTO  # drafts per iteration at most: a γ the bundle verifies at, 0 (plain decoding) or AUTO
    allow_plain: bool = True  # under AUTO: may the policy decode plainly (γ = 0) where speculation does not pay?
    stop_token_ids: frozenset[int] = frozenset()  # besides the model's EOS; kept in the tokens, as EOS
    ignore_eos: bool = False  # go on past the model's EOS (stop_token_ids still stop)
    on_tokens: Callable[[list[int]], None] | None = None  # newly accepted tokens, as they are accepted
    on_finish: Callable[["Request"], None] | None = None
    # a kind's name (core/proposers: made by the scheduler's `Proposers` when queued) or a Proposer
    proposer: object = "draft"
    p_min: float = 0.0  # the draft model stops drafting at a token it gives less probability (0: never)
    sampling_rule: str = "coupled"  # how sampled tokens are drawn and verified: SAMPLING_RULES, above
    # Medusa trees (core/tree.py): "exact" (greedy, lossless) or "typical" (approximate, opt-in: its
    # (epsilon, delta)); a typical request batched with exact ones is verified exactly meanwhile
    acceptance_rule: str = "exact"
    typical: tuple[float, float] = (0.09, 0.3)
    processors: Processors = Processors()  # penalties, logit bias, min_tokens, min_p (core/processors.py)
    # log-probabilities to report: each generated token's with this many top tokens (None: none),
    # and each prompt token's (echo) with this many
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # another sample of the same prompt (n samples): its cached prompt is copied, not prefilled again
    shares_prefill_with: "Request | None" = None
    spec: "GenerationParams | None" = None  # what was asked (core/params.py); the fields above are its resolution
    # -- state, written by the scheduler --
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: Exception | None = None
    cancelled: bool = False  # set by any thread; the scheduler retires the request at its next iteration
    stop_keep: int | None = None  # set by any thread (`stop_at`): a stop string ends the text here
    stats: GenerationStats = field(init=False)

    def __post_init__(self):
        self.tokens = list(self.prompt)  # prompt + generated: the history the draft catches up from
        self.prefilled = 0  # prompt tokens in the caches so far (chunked prefill)
        self.rng = None if self.params.greedy else np.random.default_rng(self.seed)
        self.stats = GenerationStats("autoregressive" if self.gamma == 0 else "speculative", self.gamma)
        self.submitted = time.perf_counter()
        self.stats.acceptance = self.acceptance_rule
        assert self.sampling_rule in SAMPLING_RULES, self.sampling_rule
        self.coupled = self.sampling_rule == "coupled" and self.rng is not None
        self._noise: dict[int, np.ndarray] = {}  # coupled: output position -> its noise, while it may be asked for
        self._noise_drawn = 0  # positions drawn from the stream so far
        self._last_emit_ms = 0.0  # since submission: when tokens were last delivered
        self.processing = None  # a ProcessorState when processors apply: made by the runtime
        self.grammar = None  # a core.grammar.GrammarState when the output is constrained: made by the runtime
        # per generated token / per prompt token after the first: (log-probability, top ids, top log-probabilities)
        self.token_logprobs: list[tuple[float, list[int], list[float]]] = []
        self.prompt_scores: list[tuple[float, list[int], list[float]]] = []
        self.gamma_cap: int | None = None  # the most drafts an iteration may carry: set by the scheduler when queued

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.generated)

    @property
    def gamma_is_auto(self) -> bool:
        return self.gamma == AUTO

    def uniforms(self, count: int) -> np.ndarray:
        """Rejection rule: the next `count` draws of this request's stream (float32 in [0, 1)). Draws
        happen in a fixed order per iteration, so its samples depend on its seed and γ, not its company."""
        return self.rng.random(count, dtype=np.float32)

    def noise(self, offset: int, out: np.ndarray) -> None:
        """Coupled rule: write into out [count, V] the Gumbel-max noise (uniforms) of output positions
        len(generated) + offset onwards. Position i's noise is the i-th block of V draws of the
        request's stream, drawn in order whenever first asked for, so it is the same whoever asks."""
        count, vocab = out.shape
        start = len(self.generated) + offset
        for position in [p for p in self._noise if p < len(self.generated)]:  # behind us: never asked again
            del self._noise[position]
        while self._noise_drawn < start + count:
            self._noise[self._noise_drawn] = self.rng.random(vocab, dtype=np.float32)
            self._noise_drawn += 1
        for k in range(count):
            out[k] = self._noise[start + k]

    def stop_at(self, keep: int) -> None:
        """A stop condition found at the edge (any thread): the request ends with its first `keep`
        generated tokens, at the scheduler's next iteration."""
        if self.stop_keep is None or keep < self.stop_keep:
            self.stop_keep = keep

    def emit(self, tokens, eos_ids: set[int], scores=None) -> None:
        """Append accepted tokens, stopping at EOS or a stop token (kept), max_new_tokens, or a
        stop check; pass the kept ones on. scores: their log-probabilities, when the request asks
        (one per token, as Logprobs.row gives them)."""
        kept = []
        eos_ids = () if self.ignore_eos else eos_ids
        for token in map(int, tokens):
            kept.append(token)
            if token in eos_ids or token in self.stop_token_ids:
                self.finish_reason = "stop"
                break
            if len(self.generated) + len(kept) >= self.max_new_tokens:
                self.finish_reason = "length"
                break
        if self.grammar is not None:
            allowed = self.grammar.commit(kept)
            if allowed < len(kept):  # see GrammarState.commit: the grammar cannot go on
                kept, self.finish_reason = kept[:allowed], "stop"
        start = len(self.generated)
        self.generated.extend(kept)
        self.tokens.extend(kept)
        if self.processing is not None:
            self.processing.observe(kept)
        if scores is not None:
            self.token_logprobs.extend(scores[: len(kept)])
        if self.on_tokens is not None and len(self.generated) > start:
            self.on_tokens(self.generated[start:])
        if len(self.generated) > start:
            now = (time.perf_counter() - self.submitted) * 1e3
            if start == 0:
                self.stats.ttft_ms = now
            else:
                self.stats.gaps_ms.append(now - self._last_emit_ms)
            self._last_emit_ms = now

    def finish(self, reason: str, error: Exception | None = None) -> None:
        assert reason in FINISH_REASONS, reason
        if self.stop_keep is not None and reason != "error":  # a stop string came first
            del self.generated[self.stop_keep :]
            self.finish_reason = "stop"
        self.finish_reason = self.finish_reason or reason
        self.error = error
        self.stats.new_tokens = len(self.generated)
        self.stats.total_ms = (time.perf_counter() - self.submitted) * 1e3
        if self.grammar is not None:
            self.stats.grammar_ms = self.grammar.busy_s * 1e3
        if self.stats.gamma == AUTO and self.stats.iterations and not self.stats.draft_tokens:
            self.stats.mode = "autoregressive"  # the policy judged that speculation does not pay here
        if self.on_finish is not None:
            self.on_finish(self)

