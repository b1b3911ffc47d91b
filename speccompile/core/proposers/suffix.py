"""Suffix decoding (SuffixDecoding, Oliaro et al. 2024; vLLM's `method: "suffix"`): the request's
recent tokens are matched against suffix tries with counts, one over its own prompt and output and
one over earlier requests' outputs (core/suffix_index.py), and the most frequent continuation is
proposed for as long as its estimated probability, the running product of the branch frequencies,
stays at least `MIN_PROBABILITY`. No model runs. Where requests repeat structure (the same task over
many inputs, agents re-reading their own outputs), earlier outputs propose what prompt lookup, which
sees one request alone, cannot.

The frequencies are what the proposal is expected to be worth (P_k, for `auto`): a continuation seen
in 9 of 10 occurrences is believed kept 0.9 of the time.
"""

from speccompile.core.gamma_policy import GammaPolicy
from speccompile.core.proposers.base import Offer, Proposer
from speccompile.core.suffix_index import SuffixCache

MIN_PROBABILITY = 0.1  # vLLM's and SuffixDecoding's default cut-off
MIN_MATCH = 2  # a one-token match proposes too often (as prompt lookup's)

__all__ = ["MIN_PROBABILITY", "SuffixCache", "SuffixDecoding"]


class SuffixDecoding(Proposer):
    name = "suffix"

    def __init__(self, cache: SuffixCache):
        self.cache = cache
        self.indexed = 0  # tokens of the request's history in its trie so far

    def offer(self, request, wanted: int, cap: int, policy: GammaPolicy | None) -> Offer:
        if self.indexed == 0:
            self.cache.start(self, request.prompt)
            self.indexed = len(request.prompt)
        if len(request.tokens) > self.indexed:
            self.cache.extend(self, request.tokens[self.indexed :])
            self.indexed = len(request.tokens)
        if cap <= 0:
            return Offer(0, self)
        tokens, probabilities, _ = self.cache.propose(self, request.tokens, cap, min_match=MIN_MATCH,
                                                      min_probability=MIN_PROBABILITY)
        return Offer(len(tokens), self, tokens, probabilities)

    def finish(self, request) -> None:
        if self.indexed:
            if len(request.tokens) > self.indexed:
                self.cache.extend(self, request.tokens[self.indexed :])
            self.cache.finish(self, remember=request.finish_reason != "error")
            self.indexed = 0
