"""Who proposes a request's drafts each iteration: the draft model, prompt lookup, or a choice between them.

- "draft": the bundle's draft model, γ steps (the scheduler runs it, batched over its rows).
- "ngram": prompt lookup (HF transformers' `prompt_lookup_num_tokens`, vLLM's `ngram`, llama.cpp's
  `--spec-type ngram`): the last n tokens of the request's history (prompt and generated text), for n
  from `max_n` down to `min_n`, are looked up in that history, and the tokens that followed their
  latest earlier occurrence are proposed. No model runs: the iteration costs its verification only.
  A request with no match that iteration carries no drafts (its verification is a plain step).
- "auto": each iteration, per request, the one of the two with the better predicted rate, tokens per
  millisecond: each proposer's expected tokens per iteration (1 + Σ P_k, from that request's own
  acceptance at each draft position, learned as it runs, from a prior) over its iteration time
  (draft steps + verification + the loop's own work; prompt lookup has no draft steps). Code and
  edits repeat their own text, and where they do a lookup is accepted as often as a draft model, for
  nothing; elsewhere it finds no match and the draft model drafts.

Sampling stays exact with lookup proposals: they are point masses (q = one-hot), so a draft is kept
with probability p(x) and the correction is drawn from p without x (SpecAccept's residual).
"""

from speccompile.core.cost_model import LoopCosts, expected_tokens
from speccompile.core.gamma_policy import Acceptance

PROPOSERS = ("draft", "ngram", "auto", "medusa")  # "medusa": a Medusa bundle's heads (core/tree.py); "auto" there
DEFAULT_PROPOSER = "auto"
NGRAM_MAX, NGRAM_MIN = 4, 2  # matching 1 token proposes too often and is kept 0.69 of the time (demo pair)
# What a match is believed worth before a request has any of its own, by the length of the suffix
# that matched: on the demo target's greedy output over held-out code, the first proposed token was
# kept 0.93 to 0.99 of the time after a 4-token match, 0.65 to 1.0 after 3, 0.35 to 0.80 after 2.
NGRAM_PRIORS, NGRAM_PRIOR_WEIGHT = {4: 0.9, 3: 0.75, 2: 0.5}, 4.0
DRAFT_PRIOR, DRAFT_PRIOR_WEIGHT = 0.7, 2.0  # without a γ policy (a fixed γ): the request's own, from this


class NgramIndex:
    """One request's history indexed by n-gram: for every n in min_n..max_n, the latest position at
    which each n-gram ended, over every position but the last (the suffix being looked up must find
    an earlier occurrence, not itself). Indexing is incremental: each token is indexed once."""

    def __init__(self, max_n: int = NGRAM_MAX, min_n: int = NGRAM_MIN):
        assert 1 <= min_n <= max_n, f"n-gram sizes {min_n}..{max_n}"
        self.sizes = range(max_n, min_n - 1, -1)
        self.latest: dict[int, dict[tuple, int]] = {n: {} for n in self.sizes}
        self.indexed = 0  # positions 0..indexed-1 are indexed as n-gram ends
        self.matched = 0  # the suffix length the last proposal matched (0: none)

    def propose(self, history: list[int], count: int) -> list[int]:
        """`count` tokens that followed the latest earlier occurrence of the longest suffix of
        `history` (max_n down to min_n tokens) that occurred before; [] when none did.

        The copy may overlap what it proposes, as LZ77's does: a suffix that last occurred p tokens
        earlier starts a period of p, and the proposal repeats it (a line repeated line after line
        proposes the whole next line, not the p tokens left before the history ends)."""
        for end in range(self.indexed, len(history) - 1):
            for n in self.sizes:
                if end + 1 >= n:
                    self.latest[n][tuple(history[end + 1 - n : end + 1])] = end
        self.indexed = max(self.indexed, len(history) - 1)
        self.matched = 0
        if count <= 0:
            return []
        for n in self.sizes:
            if len(history) > n:
                end = self.latest[n].get(tuple(history[-n:]))
                if end is not None:
                    self.matched = n
                    return _copy(history, end + 1, count)
        return []


def _copy(history: list[int], start: int, count: int) -> list[int]:
    """history[start:] continued by itself: `count` tokens of history + proposal from `start` on."""
    out: list[int] = []
    for k in range(count):
        i = start + k
        out.append(history[i] if i < len(history) else out[i - len(history)])
    return out


def new_acceptance(lookup_priors: dict[int, float] | None = None) -> dict:
    """A request's acceptance per proposer, before it has any of its own: the draft model's, and
    prompt lookup's per matched suffix length ("ngram", n), a longer match being a surer one.
    lookup_priors: n -> conditional rate, as a γ profile measured them (default NGRAM_PRIORS)."""
    priors = {**NGRAM_PRIORS, **(lookup_priors or {})}
    return {"draft": Acceptance([DRAFT_PRIOR], DRAFT_PRIOR_WEIGHT),
            **{("ngram", n): Acceptance([prior], NGRAM_PRIOR_WEIGHT) for n, prior in priors.items()}}


def lookup_source(index: NgramIndex) -> tuple[str, int]:
    """The acceptance key of the proposal `index` made last."""
    return "ngram", index.matched


def draft_rate(costs: LoopCosts | None, acceptance: list[float], drafts: int) -> float:
    """Expected tokens per ms of an iteration with `drafts` draft-model steps (per iteration when
    costs are unknown), verified by the smallest compiled γ that holds them."""
    tokens = expected_tokens(acceptance[:drafts])
    if costs is None:
        return tokens
    gamma = _graph(costs, drafts)
    return tokens / (costs.draft[gamma] * drafts / gamma + costs.verify[gamma] + costs.overhead)


def lookup_rate(costs: LoopCosts | None, acceptance: list[float], drafts: int) -> float:
    """Expected tokens per ms of an iteration with `drafts` lookup proposals: no draft steps."""
    tokens = expected_tokens(acceptance[:drafts])
    if costs is None:
        return tokens
    return tokens / (costs.verify[_graph(costs, drafts)] + costs.overhead)


def _graph(costs: LoopCosts, drafts: int) -> int:
    return min((g for g in costs.gammas if g >= drafts), default=max(costs.gammas))
