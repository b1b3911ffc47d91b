"""The proposer registry and `auto`: which kinds a bundle offers, the one-line refusals, and how
`auto` chooses among its members' offers."""

import pytest

from speccompile.core.cost_model import LoopCosts, tokens_per_ms
from speccompile.core.gamma_policy import GammaPolicy
from speccompile.core.proposers import Offer, Proposer, Proposers, TreeShape
from speccompile.core.proposers.auto import Auto
from speccompile.core.proposers.draft_model import DraftModel, DraftRunner
from speccompile.core.proposers.lookup import PromptLookup
from speccompile.core.proposers.suffix import SuffixDecoding
from speccompile.core.request import Request
from speccompile.errors import SpecCompileError
from tests.core.fake_engines import FakeEngine


def with_draft():
    return Proposers(DraftRunner(FakeEngine(), 256))


def test_each_bundle_offers_its_kinds_and_auto_is_made_of_them():
    assert with_draft().available() == ["draft", "ngram", "suffix", "auto"]
    assert Proposers().available() == ["ngram", "suffix", "auto"]
    assert Proposers(tree=TreeShape()).available() == ["medusa", "auto"]
    auto = with_draft().make("auto")
    assert [type(m) for m in auto.members] == [PromptLookup, DraftModel]  # suffix decoding only without a draft
    draft_free = Proposers().make("auto")
    assert [type(m) for m in draft_free.members] == [PromptLookup, SuffixDecoding]
    assert not draft_free.members[1].own_text  # lookup covers the request's own text
    assert Proposers(tree=TreeShape()).make("auto").tree  # the heads themselves


@pytest.mark.parametrize("proposers, name, message", [
    (Proposers(), "draft", "no draft model"),
    (with_draft(), "medusa", "needs a bundle built with --medusa"),
    (Proposers(tree=TreeShape()), "ngram", "speculates with Medusa heads"),
    (with_draft(), "oracle", "proposer must be one of draft, ngram, suffix, medusa, eagle, eagle_tree, auto"),
    (with_draft(), "eagle", "needs a bundle built with an EAGLE-3 head"),
])
def test_a_kind_the_bundle_cannot_serve_is_refused_in_one_line(proposers, name, message):
    with pytest.raises(SpecCompileError, match=message):
        proposers.make(name)


class Fixed(Proposer):
    """Offers `count` drafts it expects kept with `expected` each (a free proposer unless runs_model)."""

    def __init__(self, name, count, expected, runs_model=False):
        self.name, self.count, self.expected, self.runs_model = name, count, expected, runs_model

    def offer(self, request, wanted, cap, policy):
        return Offer(self.count if not self.runs_model else wanted, self, None if self.runs_model else [1] * self.count,
                     [self.expected ** (k + 1) for k in range(self.count)])


COSTS = LoopCosts(10.0, {4: 4.0}, {4: 12.0})


@pytest.mark.parametrize("members, wanted, costs, chosen", [
    ([Fixed("a", 2, 0.9), Fixed("m", 4, 0.5, runs_model=True)], 4, None, "a"),  # 2.71 tokens against 1.94
    ([Fixed("a", 2, 0.3), Fixed("m", 4, 0.5, runs_model=True)], 4, None, "m"),
    ([Fixed("a", 4, 0.8), Fixed("m", 4, 0.8, runs_model=True)], 4, COSTS, "a"),  # the same tokens, no draft steps
    ([Fixed("a", 0, 0.9), Fixed("m", 4, 0.1, runs_model=True)], 4, COSTS, "m"),  # no match: the model
    # the only offer, though worse than a plain step: that is the scheduler's to decline (next test)
    ([Fixed("a", 1, 0.05), Fixed("m", 0, 0.9, runs_model=True)], 0, COSTS, "a"),
    ([Fixed("a", 1, 0.5), Fixed("m", 0, 0.9, runs_model=True)], 0, COSTS, "a"),  # 1.5 / 12 > 1 / 10
    ([Fixed("a", 2, 0.5), Fixed("b", 2, 0.6)], 4, None, "b"),  # free proposers alone: the better one
])
def test_auto_takes_the_offer_of_the_best_predicted_rate(members, wanted, costs, chosen):
    policy = GammaPolicy(costs, [0.5] * 4) if costs else None
    offer = Auto(members).offer(Request([1, 2, 3], 10), wanted, 4, policy)
    assert offer.source.name == chosen


def test_an_offer_worse_than_a_plain_step_is_declined_and_a_better_one_runs():
    policy = GammaPolicy(COSTS, [0.5] * 4)
    worse = Auto([Fixed("a", 1, 0.05)]).offer(Request([1, 2, 3], 10), 0, 4, policy)  # 1.05 / 12 ms
    better = Auto([Fixed("b", 1, 0.5)]).offer(Request([1, 2, 3], 10), 0, 4, policy)  # 1.5 / 12 ms
    costs = policy.costs_now()
    assert worse.rate(costs) < tokens_per_ms(costs, [], 0) < better.rate(costs)  # a plain step: 1 / 10 ms
    offers = [(o.source.name, o.rate(costs), o.iteration_ms(costs)) for o in (worse, better)]
    assert policy.worth_running(offers) == [False, True]


def test_suffix_decoding_scales_its_frequencies_by_how_its_proposals_fared():
    from speccompile.core.suffix_index import SuffixCache

    cache = SuffixCache()
    cache.remember([7, 8, 9, 10, 11])
    proposer = SuffixDecoding(cache, own_text=False)
    request = Request([1, 7, 8], 10)
    first = proposer.offer(request, 4, 3, None)
    assert first.tokens == [9, 10, 11] and first.acceptance_by_position == [1.0, 1.0, 1.0]
    proposer.observe(request.stats, first, 3, 0)  # promised 3 tokens, got none
    second = proposer.offer(request, 4, 3, None)
    assert second.acceptance_by_position == pytest.approx([4 / 7] * 3)  # (4 + 0) / (4 + 3)
    proposer.finish(request)  # its output joins the cache: none yet
    assert cache.speculate(None, [7, 8], 3)[0] == [9, 10, 11]
