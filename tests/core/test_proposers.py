"""Prompt lookup against a brute-force reference, per-request acceptance, and the scheduler with
every proposer: exact against autoregressive decoding, the draft's cache true to the tokens."""

import random

import pytest

from speccompile.core.cost_model import LoopCosts
from speccompile.core.gamma_policy import Acceptance, GammaPolicy
from speccompile.core.proposers import NgramIndex
from speccompile.core.request import Request
from speccompile.core.scheduler import Scheduler
from tests.core.fake_engines import AgreeingDraft, FakeEngine, RepeatingEngine


def brute_force_lookup(history, count, max_n=4, min_n=2):
    """The definition: the longest suffix (max_n..min_n) with an earlier occurrence, its latest one,
    and what followed it, continued by itself past the end of the history."""
    for n in range(max_n, min_n - 1, -1):
        if len(history) <= n:
            continue
        ends = [e for e in range(n - 1, len(history) - 1) if history[e + 1 - n : e + 1] == history[-n:]]
        if ends:
            seq = list(history)
            for k in range(count):
                seq.append(seq[ends[-1] + 1 + k])
            return seq[len(history) :]
    return []


def test_lookup_takes_the_longest_suffix_and_its_latest_occurrence():
    assert NgramIndex().propose([1, 2, 3, 9, 2, 3, 8, 1, 2, 3], 2) == [9, 2]  # 1 2 3 beats the later 2 3
    assert NgramIndex().propose([2, 3, 9, 2, 3, 8, 2, 3], 2) == [8, 2]  # latest occurrence of 2 3
    assert NgramIndex().propose([1, 2, 3, 4], 3) == []  # no suffix occurred before (nor itself)
    assert NgramIndex().propose([4, 4], 3) == []  # min_n 2: a single repeated token is not looked up


def test_a_repetition_is_continued_past_the_end_of_the_history():
    line = [10, 11, 12]
    assert NgramIndex().propose(line * 2, 7) == [10, 11, 12, 10, 11, 12, 10]


@pytest.mark.parametrize("seed", range(20))
def test_incremental_lookup_equals_the_definition(seed):
    rng = random.Random(seed)
    history, index = [], NgramIndex()
    for _ in range(120):
        history.extend(rng.choice([[rng.randrange(6)], history[-rng.randrange(1, 9) :] or [1]]))
        count = rng.randrange(0, 8)
        assert index.propose(history, count) == (brute_force_lookup(history, count) if count else [])


def test_acceptance_learns_per_position_from_its_prior():
    acceptance = Acceptance(prior=[0.5], weight=2.0)
    assert acceptance.by_position(3) == [0.5, 0.25, 0.125]
    for _ in range(8):
        acceptance.observe(drafts=3, accepted=3)  # every draft kept: positions 1..3 reached and kept
    assert acceptance.by_position(2) == pytest.approx([9 / 10, 0.81])
    acceptance.observe(drafts=3, accepted=0)  # position 1 reached and rejected, 2 and 3 not reached
    assert acceptance.by_position(1) == pytest.approx([9 / 11])


# ---------------------------------------------------------------------------------------------
# the scheduler with each proposer


def reference(engine: FakeEngine, prompt, max_new) -> list[int]:
    history = list(prompt)
    for _ in range(max_new):
        history.append(engine.choose(history))
    return history[len(prompt) :]


class CheckedScheduler(Scheduler):
    """After every iteration, each decoding request's draft cache holds its own tokens: feeding a
    lookup row its lookup as the draft's input keeps the draft's cache true."""

    def step(self):
        super().step()
        for slot, request in enumerate(self.decoding):
            draft = self.proposers.draft.engine
            length = int(draft.cache_lengths[slot])
            assert list(draft.cache[slot, :length]) == request.tokens[:length], f"draft cache of slot {slot}"


PROMPTS = [[3, 1, 4, 1, 5], [9, 2], [2, 6, 5, 3, 5, 8, 9, 7], [7, 7, 1, 2, 7, 7, 1]]


COSTS = {"target_step_ms": 10.0, "draft_step_ms": 1.0, "verify_ms": {g: 10.0 + g for g in (1, 2, 4, 6)},
         "overhead_ms": 0.5}


@pytest.mark.parametrize("proposer", ["draft", "ngram", "auto"])
@pytest.mark.parametrize("gamma", [2, 6, "auto"])
@pytest.mark.parametrize("draft", [lambda: RepeatingEngine(), lambda: AgreeingDraft(3), lambda: FakeEngine(salt=9)],
                         ids=["copy", "sometimes", "unrelated"])
def test_every_proposer_equals_autoregressive(proposer, gamma, draft):
    """With a fixed γ and no costs known, and under γ auto with a policy's costs (rates compared)."""
    target = RepeatingEngine()
    policy = GammaPolicy(LoopCosts.from_timings(COSTS), [0.8, 0.6, 0.4, 0.3, 0.2, 0.1])
    s = CheckedScheduler(target, draft(), 3, 256, [1, 2, 4, 6], set(), policy_for=lambda n, context: policy)
    requests = [Request(p, 40, gamma=gamma, proposer=proposer) for p in PROMPTS]
    for request in requests:
        s.add(request)
    while not s.idle:
        s.step()
    for request, prompt in zip(requests, PROMPTS):
        assert request.generated == reference(target, prompt, 40), (proposer, prompt)
        by = request.stats.by_proposer
        assert set(by) <= {"draft", "ngram", "suffix"} and request.stats.draft_tokens == sum(c[1] for c in by.values())
        if proposer != "auto":
            assert set(by) <= {proposer}
    lookups = sum(r.stats.by_proposer.get("ngram", [0, 0, 0])[1] for r in requests)
    assert (lookups > 0) == (proposer != "draft")


def test_lookup_on_repeating_text_saves_most_target_passes():
    target = RepeatingEngine(every=1000)  # almost never breaks the repetition
    s = Scheduler(target, FakeEngine(salt=9), 1, 256, [2, 4, 6], set())
    request = Request([1, 2, 3, 4, 5, 1, 2, 3, 4, 5], 60, gamma=6, proposer="ngram")
    s.add(request)
    while not s.idle:
        s.step()
    assert request.generated == reference(target, request.prompt, 60)
    assert request.stats.iterations <= 12 and request.stats.acceptance_rate > 0.9  # plain decoding: 59
    assert s.proposers.draft.engine.calls == 1  # the draft model read the prompt and never drafted


def test_auto_drafts_with_the_model_where_lookup_finds_nothing():
    """A text that never repeats: no lookup ever matches (min_n 2), the draft model drafts every
    iteration, and it agrees (the same model)."""
    target = FakeEngine()
    s = Scheduler(target, FakeEngine(), 1, 256, [2, 4], set())
    request = Request([5, 6, 7], 30, gamma=4, proposer="auto")
    s.add(request)
    while not s.idle:
        s.step()
    assert request.generated == reference(target, [5, 6, 7], 30)
    assert request.stats.by_proposer["draft"][1] > 0 and request.stats.acceptance_rate == 1.0


class StubModel:
    """A model proposer whose offers are kept at `acceptance` per position, seen drafting `seen` times."""

    runs_model, step_cost = True, "draft"

    def __init__(self, name: str, acceptance: float, seen: int):
        self.name, self.acceptance, self.seen = name, acceptance, seen

    def offer(self, request, wanted, cap, policy):
        from speccompile.core.proposers.base import Offer
        return Offer(wanted, self, None, [self.acceptance**k for k in range(1, wanted + 1)])

    def observed(self, request, policy):
        return self.seen


def test_auto_gives_the_model_ranked_second_turns_that_grow_as_the_root_of_the_first_s():
    """After both models have drafted EXPLORE_ITERATIONS times, auto drafts with the faster, except
    where the slower is owed a turn: a few iterations are a small sample, and a model ranked below
    after an unlucky start would otherwise never draft again; but each turn it gets costs, so its
    turns grow as the square root of the first's (the gaps between them widen). A model whose offer
    does not beat a plain step gets no such turn."""
    from speccompile.core.proposers.auto import EXPLORE_ITERATIONS, RETRY_SHARE, Auto

    costs = LoopCosts(10.0, {4: 2.0}, {4: 12.0})
    policy = GammaPolicy(costs, [0.5] * 4, prior_weight=2.0)
    request = Request([1, 2, 3], 50)
    better, worse = StubModel("better", 0.9, EXPLORE_ITERATIONS), StubModel("worse", 0.7, EXPLORE_ITERATIONS)
    auto = Auto([better, worse])
    retries = []  # the faster's count at each of the slower's turns
    for _ in range(400):
        chosen = auto.offer(request, 4, 4, policy).source
        if chosen is worse:
            retries.append(better.seen)
        chosen.seen += 1
    assert retries[0] == RETRY_SHARE * EXPLORE_ITERATIONS + 1, retries  # as soon as the first drafted 8x as often
    gaps = [b - a for a, b in zip(retries, retries[1:])]
    assert len(retries) > 5 and gaps == sorted(gaps) and gaps[-1] > 2 * gaps[0], retries
    assert all(seen * EXPLORE_ITERATIONS > RETRY_SHARE * (n + EXPLORE_ITERATIONS) ** 2
               for n, seen in enumerate(retries)), retries
    hopeless = StubModel("hopeless", 0.05, EXPLORE_ITERATIONS)  # 1.05 tokens in 14 ms: a plain step pays more
    auto = Auto([StubModel("better", 0.9, 100), hopeless])
    assert all(auto.offer(request, 4, 4, policy).source.name == "better" for _ in range(20))


def test_auto_tries_an_unseen_model_where_no_model_s_offer_beats_a_plain_step():
    """In a batch, rows drafting for free can carry a row's drafts that do not pay alone: where even the
    best model's offer is below a plain step, a model not yet seen drafting is still tried first (not
    only the one trusted on its prior); where the best model's offer pays, an unseen one whose offer
    does not is not tried."""
    from speccompile.core.proposers.auto import EXPLORE_ITERATIONS, Auto

    costs = LoopCosts(10.0, {4: 4.0}, {4: 40.0})  # a batch's verification: 4 drafts never beat 10 ms a token
    policy = GammaPolicy(costs, [0.5] * 4, prior_weight=2.0)
    request = Request([1, 2, 3], 50)
    trusted, unseen = StubModel("trusted", 0.9, 0), StubModel("unseen", 0.5, 0)
    auto = Auto([trusted, unseen])
    turns = []
    for _ in range(2 * EXPLORE_ITERATIONS):
        chosen = auto.offer(request, 4, 4, policy).source
        chosen.seen += 1
        turns.append(chosen.name)
    assert sorted(turns) == ["trusted"] * EXPLORE_ITERATIONS + ["unseen"] * EXPLORE_ITERATIONS, turns
    cheap = GammaPolicy(LoopCosts(10.0, {4: 1.0}, {4: 12.0}), [0.5] * 4, prior_weight=2.0)
    paying, hopeless = StubModel("paying", 0.9, EXPLORE_ITERATIONS), StubModel("hopeless", 0.05, 0)
    auto = Auto([paying, hopeless])
    assert all(auto.offer(request, 4, 4, cheap).source is paying for _ in range(10))
