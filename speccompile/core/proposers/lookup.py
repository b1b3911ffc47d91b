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
LOAD_HORIZON = 256  # the runtime's rates, every request's lookups: what a new request starts from


class LookupRates:
    """What a runtime has learned of its lookups, per matched suffix length: how often each draft
    position was kept, over every request's lookups (the recent ones weigh most), from `priors`
    (n -> kept rate: a γ profile's, or NGRAM_PRIORS). A new request's lookups start from these rates
    rather than from the priors alone: on text whose lookups are rarely kept, its first ones are not
    believed kept 0.9 of the time."""

    def __init__(self, priors: dict[int, float] | None = None):
        self.priors = {**NGRAM_PRIORS, **(priors or {})}
        self.forget()

    def forget(self) -> None:
        self.by_match = {n: Acceptance([prior], NGRAM_PRIOR_WEIGHT, LOAD_HORIZON) for n, prior in self.priors.items()}

    def prior(self, matched: int) -> list[float]:
        """The conditional rates, per draft position, a request's lookups after a `matched`-token match start from."""
        rates = self.by_match[matched]
        return [rates.conditional(k) for k in range(len(rates.reached))]


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
    length (a longer match being a surer one), from the runtime's rates (LookupRates) until it has
    its own; its lookups teach the runtime's rates too."""

    name = "ngram"

    def __init__(self, rates: LookupRates | None = None):
        self.index = NgramIndex()
        self.rates = rates or LookupRates()
        self.acceptance = {n: Acceptance(self.rates.prior(n), NGRAM_PRIOR_WEIGHT, NGRAM_HORIZON)
                           for n in self.rates.by_match}
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
            self.rates.by_match[self.matched].observe(drafts, accepted)
            stats.record_lookup(self.matched, drafts, accepted)
