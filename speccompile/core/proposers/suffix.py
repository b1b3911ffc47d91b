"""Suffix decoding (SuffixDecoding, Oliaro et al. 2024; vLLM's `method: "suffix"`): the request's
recent tokens are matched against suffix tries with counts, one over its own prompt and output and
one over earlier requests' outputs (core/suffix_index.py), and the most frequent continuation is
proposed for as long as its estimated probability, the running product of the branch frequencies,
stays at least `MIN_PROBABILITY`. No model runs. Where requests repeat structure (the same task over
many inputs, agents re-reading their own outputs), earlier outputs propose what prompt lookup, which
sees one request alone, cannot.

What a proposal is expected to be worth (P_k, for `auto`) starts from the frequencies, a continuation
seen in 9 of 10 occurrences believed kept 0.9 of the time, scaled by how the request's own proposals
fared against their frequencies so far: few occurrences make frequencies a poor guide (one earlier
occurrence says 1/2 whatever the text), and the scale keeps `auto` from preferring them where the
draft model is kept more often.
"""

from speccompile.core.gamma_policy import GammaPolicy
from speccompile.core.proposers.base import Offer, Proposer
from speccompile.core.suffix_index import SuffixCache

MIN_PROBABILITY = 0.1  # vLLM's and SuffixDecoding's default cut-off
MIN_MATCH = 2  # a one-token match proposes too often (as prompt lookup's)
MAX_DEPTH = 24  # match and proposal together (vLLM's default tree depth)
SCALE_PRIOR_WEIGHT = 4.0  # expected tokens' worth of belief that the frequencies are right

__all__ = ["MIN_PROBABILITY", "SuffixCache", "SuffixDecoding"]


class SuffixDecoding(Proposer):
    name = "suffix"

    def __init__(self, cache: SuffixCache, own_text: bool = True):
        """own_text False: earlier requests' outputs only (under `auto`, prompt lookup covers the
        request's own text, so its trie would index every token twice)."""
        self.cache, self.own_text = cache, own_text
        self.indexed = 0  # tokens of the request's history in its trie so far
        self.expected, self.kept = SCALE_PRIOR_WEIGHT, SCALE_PRIOR_WEIGHT  # tokens its frequencies promised, and got
        self._frequencies: list[float] = []  # of the last offer

    def offer(self, request, wanted: int, cap: int, policy: GammaPolicy | None) -> Offer:
        if not self.own_text:
            return self._offer(self.cache.global_tree.propose, request.tokens, cap)
        if self.indexed == 0:
            self.cache.start(self, request.prompt)
            self.indexed = len(request.prompt)
        if len(request.tokens) > self.indexed:
            self.cache.extend(self, request.tokens[self.indexed :])
            self.indexed = len(request.tokens)
        return self._offer(lambda *args, **options: self.cache.propose(self, *args, **options), request.tokens, cap)

    def _offer(self, propose, history: list[int], cap: int) -> Offer:
        if cap <= 0:
            return Offer(0, self)
        tokens, self._frequencies, _ = propose(history, cap, min_match=MIN_MATCH, min_probability=MIN_PROBABILITY)
        scale = self.kept / self.expected
        return Offer(len(tokens), self, tokens, [min(1.0, p * scale) for p in self._frequencies])

    def observe(self, stats, offer: Offer, drafts: int, accepted: int) -> None:
        stats.record_iteration(accepted, drafts, self.name)
        if drafts:
            self.expected += sum(self._frequencies[:drafts])
            self.kept += accepted

    def finish(self, request) -> None:
        if not self.own_text and request.finish_reason != "error":
            self.cache.remember(request.generated)
        if self.indexed:
            if len(request.tokens) > self.indexed:
                self.cache.extend(self, request.tokens[self.indexed :])
            self.cache.finish(self, remember=request.finish_reason != "error")
            self.indexed = 0
