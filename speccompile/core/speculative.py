"""The speculative decoding loop, over the backend-free engine interface of `engine.py`.

One iteration, per sequence (batch rows move in lockstep, each with its own lengths):
  1. the draft proposes d_1..d_γ, one greedy step at a time;
  2. the target scores [last, d_1..d_γ] in ONE verification pass whose SpecAccept node keeps the
     longest agreeing prefix (n drafts), returns the target's own next token, and rolls the target
     cache back to the accepted prefix (a length update);
  3. d_1..d_n and the target's token are emitted; the draft cache is rolled back the same way.

Invariant at the top of each iteration: the target has cached everything before `last`; the draft
has cached everything before `prev` (the token before `last`) and re-reads [prev, last] in its
first step. Re-reading `prev` costs nothing extra (it is one step of T=2) and removes the special
case where all γ drafts were accepted and the draft never saw d_γ.
"""

from collections.abc import Callable

import numpy as np

from speccompile.core.engine import DecoderEngine, VerifierEngine
from speccompile.core.gamma_policy import GammaPolicy
from speccompile.core.sampler import Sampler
from speccompile.core.stats import Clock, GenerationStats

OnTokens = Callable[[int, list[int]], None]  # (sequence index, newly emitted token ids)


def pad_prompts(prompts: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad token lists into [B, T_max]; returns (ids, lengths)."""
    lengths = np.array([len(p) for p in prompts], dtype=np.int64)
    ids = np.zeros((len(prompts), int(lengths.max())), dtype=np.int64)
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt)] = prompt
    return ids, lengths


class _Outputs:
    """Collects emitted tokens per sequence, stopping each at EOS or max_new_tokens."""

    def __init__(self, batch: int, max_new_tokens: int, eos_ids: set[int], on_tokens: OnTokens | None):
        self.tokens: list[list[int]] = [[] for _ in range(batch)]
        self.done = np.zeros(batch, dtype=bool)
        self.max_new_tokens, self.eos_ids, self.on_tokens = max_new_tokens, eos_ids, on_tokens

    def emit(self, row: int, tokens) -> None:
        kept = []
        for token in tokens:
            kept.append(int(token))
            if int(token) in self.eos_ids or len(self.tokens[row]) + len(kept) >= self.max_new_tokens:
                self.done[row] = True
                break
        self.tokens[row].extend(kept)
        if self.on_tokens and kept:
            self.on_tokens(row, kept)


def _next_tokens(engine: DecoderEngine, tokens, token_count, sampler: Sampler | None) -> tuple[np.ndarray, np.ndarray | None]:
    """One forward: greedy next tokens, or sampled ones with the distribution they came from."""
    if sampler is None:
        return engine.forward(tokens, token_count), None
    return engine.forward_sample(tokens, token_count, sampler.inputs, sampler.uniforms())


def _start(target: DecoderEngine, prompts, max_new_tokens, eos_ids, on_tokens, sampler):
    ids, lengths = pad_prompts(prompts)
    target.start(len(prompts))
    last, _ = _next_tokens(target, ids, lengths, sampler)
    outputs = _Outputs(len(prompts), max_new_tokens, eos_ids, on_tokens)
    for row in range(len(prompts)):
        outputs.emit(row, [last[row]])
    return ids, lengths, last, outputs


def autoregressive_generate(target: DecoderEngine, prompts, max_new_tokens, eos_ids, on_tokens=None, sampler=None):
    """The baseline: the target alone, one token per pass, through the same engine."""
    clock = Clock()
    stats = [GenerationStats("autoregressive", 0) for _ in prompts]
    with clock("prefill"):
        _, _, last, outputs = _start(target, prompts, max_new_tokens, eos_ids, on_tokens, sampler)
    _take_times(stats, clock, outputs.done)
    one = np.ones(len(prompts), dtype=np.int64)
    while not outputs.done.all():
        active = ~outputs.done
        lengths_before = target.cache_lengths.copy()
        with clock("decode"):
            last, _ = _next_tokens(target, last[:, None], one, sampler)
        target.cache_lengths[~active] = lengths_before[~active]  # finished rows stand still
        for row in np.flatnonzero(active):
            stats[row].iterations += 1
            outputs.emit(row, [last[row]])
        _take_times(stats, clock, active & outputs.done)
    return _finish(outputs, stats)


def speculative_generate(target: VerifierEngine, draft: DecoderEngine, prompts, gamma: int | GammaPolicy, max_new_tokens,
                         eos_ids, on_tokens=None, sampler: Sampler | None = None):
    """Speculative decoding; greedy when sampler is None, else exact speculative sampling.

    gamma is a fixed γ, or a GammaPolicy that picks γ each iteration from its running estimate of
    acceptance (and learns from every iteration's outcome).
    """
    clock = Clock()
    policy = gamma if isinstance(gamma, GammaPolicy) else None
    stats = [GenerationStats("speculative", "auto" if policy else gamma) for _ in prompts]
    with clock("prefill"):
        ids, lengths, last, outputs = _start(target, prompts, max_new_tokens, eos_ids, on_tokens, sampler)
        draft.start(len(prompts))
        draft.forward(ids, lengths)
    _take_times(stats, clock, outputs.done)
    draft.cache_lengths -= 1  # the draft re-reads the last prompt token together with `last`
    prev = ids[np.arange(len(prompts)), lengths - 1]
    rows = np.arange(len(prompts))
    while not outputs.done.all():
        active = ~outputs.done
        target_before, draft_before = target.cache_lengths.copy(), draft.cache_lengths.copy()
        if policy is not None:
            gamma = policy.choose(allow_zero=False)
        before = clock.ms.get("draft", 0.0), clock.ms.get("verify", 0.0)
        with clock("draft"):
            drafts, draft_probs = _propose(draft, prev, last, gamma, sampler)
        with clock("verify"):
            candidates = np.concatenate([last[:, None], drafts], axis=1)
            if sampler is None:
                accepted, next_token = target.verify(candidates)
            else:
                accepted, next_token = target.verify_sample(candidates, draft_probs, sampler.inputs,
                                                            sampler.uniforms(gamma), sampler.uniforms())
        if policy is not None:
            policy.observe_costs(gamma, clock.ms["draft"] - before[0], clock.ms["verify"] - before[1])
        # Roll the draft back to match: it keeps everything before d_n (or before `last` if n = 0).
        prev = np.where(accepted > 0, drafts[rows, np.maximum(accepted - 1, 0)], last)
        last = next_token
        draft.cache_lengths = target.cache_lengths - 1
        target.cache_lengths[~active] = target_before[~active]  # finished rows stand still
        draft.cache_lengths[~active] = draft_before[~active]
        for row in np.flatnonzero(active):
            stats[row].record_iteration(int(accepted[row]), gamma)
            if policy is not None:
                policy.observe(gamma, int(accepted[row]))
            outputs.emit(row, [*drafts[row, : accepted[row]], next_token[row]])
        _take_times(stats, clock, active & outputs.done)
    return _finish(outputs, stats)


def _propose(draft: DecoderEngine, prev: np.ndarray, last: np.ndarray, gamma: int, sampler: Sampler | None):
    """γ draft tokens [B, γ] (and, when sampling, the draft distributions [B, γ, V] they were drawn
    from): one step over [prev, last], then γ-1 single-token steps."""
    batch = len(last)
    token, probs = _next_tokens(draft, np.stack([prev, last], axis=1), np.full(batch, 2, dtype=np.int64), sampler)
    tokens, distributions = [token], [probs]
    one = np.ones(batch, dtype=np.int64)
    for _ in range(gamma - 1):
        token, probs = _next_tokens(draft, token[:, None], one, sampler)
        tokens.append(token)
        distributions.append(probs)
    return np.stack(tokens, axis=1), (None if sampler is None else np.stack(distributions, axis=1))


def _take_times(stats: list[GenerationStats], clock: Clock, finished: np.ndarray) -> None:
    """Rows that emitted their last token just now: their times stop here (see stats.py)."""
    for row in np.flatnonzero(finished):
        stats[row].take_times(clock)


def _finish(outputs: _Outputs, stats: list[GenerationStats]):
    for row, s in enumerate(stats):
        s.new_tokens = len(outputs.tokens[row])
    return outputs.tokens, stats
