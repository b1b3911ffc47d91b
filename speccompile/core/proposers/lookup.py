"""Prompt lookup (HF transformers' `prompt_lookup_num_tokens`, vLLM's `ngram`, llama.cpp's
`--spec-type ngram`): the last n tokens of the request's history (prompt and generated text), for n
from `max_n` down to `min_n`, are looked up in that history, and the tokens that followed their
latest earlier occurrence are proposed. No model runs: the iteration costs its verification only. A
request with no match that iteration carries no drafts (its verification is a plain step for it).

Sampling stays exact with lookup proposals: they are point masses (q = one-hot), so a draft is kept
with probability p(x) and the correction is drawn from p without x (SpecAccept's residual); under
the coupled rule a proposal is kept when it equals the target's own draw.
"""

from speccompile.core.gamma_policy import Acceptance, GammaPolicy
from speccompile.core.proposers.base import Offer, Proposer

NGRAM_MAX, NGRAM_MIN = 4, 2  # matching 1 token proposes too often and is kept 0.69 of the time (demo pair)
# What a match is believed worth before a request has any of its own, by the length of the suffix
# that matched: on the demo target's greedy output over held-out code, the first proposed token was
# kept 0.93 to 0.99 of the time after a 4-token match, 0.65 to 1.0 after 3, 0.35 to 0.80 after 2.
NGRAM_PRIORS, NGRAM_PRIOR_WEIGHT = {4: 0.9, 3: 0.75, 2: 0.5}, 4.0
# A request's own rates follow its recent lookups (iterations): a text turns repetitive, or stops being so
NGRAM_HORIZON = 16


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


class PromptLookup(Proposer):
    """Per request: its n-gram index, and how often its own lookups were kept per matched suffix
    length (a longer match being a surer one), from `priors` (n -> kept rate; a γ profile's, or
    NGRAM_PRIORS) until it has its own."""

    name = "ngram"

    def __init__(self, priors: dict[int, float] | None = None):
        self.index = NgramIndex()
        priors = {**NGRAM_PRIORS, **(priors or {})}
        self.acceptance = {n: Acceptance([prior], NGRAM_PRIOR_WEIGHT, NGRAM_HORIZON) for n, prior in priors.items()}
        self.matched = 0  # the suffix length of the last offer

    def offer(self, request, wanted: int, cap: int, policy: GammaPolicy | None) -> Offer:
        tokens = self.index.propose(request.tokens, cap)
        self.matched = self.index.matched
        expected = self.acceptance[self.matched].by_position(len(tokens)) if tokens else []
        return Offer(len(tokens), self, tokens, expected)

    def observe(self, stats, offer: Offer, drafts: int, accepted: int) -> None:
        stats.record_iteration(accepted, drafts, self.name)
        if drafts:
            self.acceptance[self.matched].observe(drafts, accepted)
            stats.record_lookup(self.matched, drafts, accepted)
