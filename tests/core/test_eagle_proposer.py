"""The EAGLE-3 proposer's bookkeeping on fake engines: the head reads the target's features of every
position the target keeps, each with the token after it, and rolls back what it read of its own
drafts. A head that sees its inputs right drafts exactly what the target then chooses; one that is
off by a position drafts nothing that is kept; and the output is the target's either way."""

import numpy as np
import pytest

from speccompile.core.proposers import Proposers
from speccompile.core.proposers.eagle import EagleRunner
from speccompile.core.request import Request
from speccompile.core.scheduler import Scheduler
from tests.core.fake_engines import FakeEngine, next_token_of
from tests.core.test_scheduler import PROMPTS, VOCAB, reference, run


class FeatureTarget(FakeEngine):
    """A fake target whose 'features' at a position are the token it cached there."""

    last_aux_hidden = None

    def _append(self, tokens, first):
        self.last_aux_hidden = tokens[:, :, None].astype(np.float32)
        return super()._append(tokens, first)


class FakeHead:
    """A head whose position t reads (the token behind the target's features at t, the token at t + 1)
    and predicts, as the target would, the token after them: it is right exactly when it is fed right.
    A fed-back step reads (its own output: the token it predicted before, the draft given)."""

    def __init__(self, capacity: int = 256, skew: int = 0):
        self.capacity, self.skew = capacity, skew
        self.catch_ups = self.steps = 0

    def start(self, slots):
        self.cache = np.full((slots, self.capacity + 1), -1, dtype=np.int64)  # cache[s, t]: the token at t
        self.cache_lengths = np.zeros(slots, dtype=np.int64)

    def _read(self, slot: int, feature_token: int, next_token: int) -> int:
        t = self.cache_lengths[slot]
        assert t == 0 or (self.cache[slot, :t] >= 0).all(), "read of an unwritten cache entry"
        self.cache[slot, t], self.cache[slot, t + 1] = feature_token, next_token
        self.cache_lengths[slot] += 1
        return next_token_of(self.cache[slot, : t + 2 + self.skew], VOCAB, 0)

    def catch_up(self, tokens, features, counts, first=0):
        self.catch_ups += 1
        out = np.zeros(len(tokens), dtype=np.int64)
        for b in range(len(tokens)):
            for t in range(int(counts[b])):
                out[b] = self._read(first + b, int(features[b, t, 0]), int(tokens[b, t]))
        return out, np.ones(len(tokens), np.float32), out[:, None].astype(np.float32)

    def step(self, tokens, hidden, first=0):
        """Every row steps; a row the head never read (out of step: it drafts nothing here) answers 0."""
        self.steps += 1
        out = np.array([self._read(first + b, int(self.cache[first + b, self.cache_lengths[first + b]]),
                                   int(tokens[b, 0])) if self.cache[first + b, 0] >= 0 else 0
                        for b in range(len(tokens))], dtype=np.int64)
        return out, np.ones(len(tokens), np.float32), out[:, None].astype(np.float32)

    def move(self, source, destination):
        self.cache[destination] = self.cache[source]
        self.cache_lengths[destination] = self.cache_lengths[source]


def eagle_scheduler(head: FakeHead, gammas=(1, 2, 4), max_batch=4, policy_for=None, **kw) -> Scheduler:
    proposers = Proposers(eagle=EagleRunner(head, 256))
    return Scheduler(FeatureTarget(capacity=256), None, max_batch, 256, list(gammas), set(), policy_for=policy_for,
                     proposers=proposers, **kw)


@pytest.mark.parametrize("gamma", [1, 2, 4])
def test_a_head_fed_right_drafts_what_the_target_chooses(gamma):
    requests = [Request(p, 17, gamma=gamma, proposer="eagle") for p in PROMPTS]
    scheduler = eagle_scheduler(FakeHead())
    for request in requests:
        request.proposer = scheduler.proposers.make("eagle")
    run(scheduler, requests)
    for request, prompt in zip(requests, PROMPTS):
        assert request.generated == reference(prompt, 17)
        assert request.stats.draft_tokens > 0 and request.stats.accepted_tokens == request.stats.draft_tokens


def test_a_head_off_by_a_position_is_never_kept_and_the_output_is_still_the_target_s():
    requests = [Request(p, 17, gamma=4) for p in PROMPTS]
    scheduler = eagle_scheduler(FakeHead(skew=-1))
    for request in requests:
        request.proposer = scheduler.proposers.make("eagle")
    run(scheduler, requests)
    for request, prompt in zip(requests, PROMPTS):
        assert request.generated == reference(prompt, 17)
        assert request.stats.draft_tokens > 0 and request.stats.accepted_tokens < request.stats.draft_tokens / 4


def test_chunked_prefill_plain_steps_and_joining_requests_keep_the_head_in_step():
    """Prompts prefilled in chunks while others decode, requests at γ 0 (plain steps) beside
    drafting ones: the head reads every call's features, so its drafts stay right."""
    long = list(range(1, 40))
    requests = [Request(long, 12, gamma=4), Request(PROMPTS[0], 12, gamma=0), Request(PROMPTS[2], 12, gamma=2)]
    scheduler = eagle_scheduler(FakeHead(), prefill_chunk=8)
    for request in requests:
        request.proposer = scheduler.proposers.make("eagle")
    run(scheduler, requests)
    for request in requests:
        assert request.generated == reference(request.prompt, 12)
    drafting = [r for r in requests if r.gamma]
    assert all(r.stats.draft_tokens > 0 and r.stats.accepted_tokens == r.stats.draft_tokens for r in drafting)


def test_a_prompt_scored_for_echo_leaves_the_head_out_of_step_and_drafting_nothing():
    scheduler = eagle_scheduler(FakeHead())
    runner = scheduler.proposers.eagle
    request = Request(PROMPTS[2], 6, gamma=2)
    request.proposer = scheduler.proposers.make("eagle")
    scheduler.add(request)
    scheduler.step()  # prefilled: in step
    assert runner.in_step[0]
    runner.after_target([request], 0, np.array([0]), np.array([3]), None)  # a call that returned no features
    assert not runner.in_step[0]


def test_requests_that_never_draft_with_the_head_cost_it_nothing():
    """Plain decoding, or a proposer without the head: the head reads none of their features."""
    head = FakeHead()
    scheduler = eagle_scheduler(head)
    requests = [Request(PROMPTS[0], 8, gamma=0), Request(PROMPTS[2], 8, gamma=4)]
    requests[0].proposer = scheduler.proposers.make("eagle")
    requests[1].proposer = scheduler.proposers.make("ngram")
    run(scheduler, requests)
    assert [r.generated for r in requests] == [reference(r.prompt, 8) for r in requests]
    assert head.catch_ups == head.steps == 0


def test_rows_that_would_draft_with_two_models_draft_with_one_per_iteration():
    """Under γ auto, a row offering the draft model's drafts beside a row offering the head's would make
    the iteration run both models over every row: one model drafts (the one whose offers promise the
    most tokens per ms), the other's rows decode plainly that iteration; the output is the target's."""
    from speccompile.core.cost_model import LoopCosts
    from speccompile.core.gamma_policy import GammaPolicy
    from speccompile.core.proposers.draft_model import DraftRunner
    from speccompile.core.request import AUTO

    runners = {"draft": DraftRunner(FakeEngine(capacity=256), 256), "eagle": EagleRunner(FakeHead(), 256)}
    costs = LoopCosts(10.0, {1: 0.5, 2: 1.0, 4: 2.0}, {1: 11.0, 2: 11.5, 4: 12.5}, head_step=0.5, head_catch_up=0.5)
    policy = GammaPolicy(costs, [0.9] * 4, prior_weight=2.0)
    scheduler = Scheduler(FeatureTarget(capacity=256), None, 4, 256, [1, 2, 4], set(), policy_for=lambda n, c: policy,
                          proposers=Proposers(draft=runners["draft"], eagle=runners["eagle"]))
    drafted = []  # per iteration: the runners whose rows drafted
    for name, runner in runners.items():
        drafting = runner.draft

        def draft_and_record(rows, offers, drafts, proposed, sampling, name=name, drafting=drafting):
            out = drafting(rows, offers, drafts, proposed, sampling)
            if any(offer.source.runner is runners[name] and d for offer, d in zip(offers, drafts)):
                drafted.append((scheduler.iterations, name))
            return out

        runner.draft = draft_and_record
    scheduler.iterations = 0
    step = scheduler.step

    def counted_step():
        step()
        scheduler.iterations += 1

    scheduler.step = counted_step
    requests = [Request(PROMPTS[0], 24, gamma=AUTO, proposer="draft"), Request(PROMPTS[2], 24, gamma=AUTO,
                                                                                proposer="eagle")]
    for request in requests:
        request.proposer = scheduler.proposers.make(request.proposer)
    run(scheduler, requests)
    assert [r.generated for r in requests] == [reference(p, 24) for p in (PROMPTS[0], PROMPTS[2])]
    iterations = [i for i, _ in drafted]
    assert drafted and len(iterations) == len(set(iterations)), drafted  # never both models in one iteration


def test_auto_tries_each_model_then_drafts_with_the_faster_and_the_head_lets_go_of_the_row():
    """Under auto beside a draft model, each model first drafts EXPLORE_ITERATIONS times, in turns (the
    least seen first; on a tie, the earlier member); then the draft model, whose drafts are kept as
    often at less cost, drafts. LET_GO_AFTER tokens after the head last read the row, the head lets go of it: it keeps
    none of its features any more and offers it nothing. The output is the target's throughout."""
    from speccompile.core.cost_model import LoopCosts
    from speccompile.core.gamma_policy import GammaPolicy
    from speccompile.core.proposers.auto import EXPLORE_ITERATIONS
    from speccompile.core.proposers.draft_model import DraftRunner
    from speccompile.core.proposers.eagle import LET_GO_AFTER
    from speccompile.core.request import AUTO

    head = FakeHead()
    costs = LoopCosts(10.0, {1: 0.5, 2: 1.0, 4: 2.0}, {1: 11.0, 2: 11.5, 4: 12.5}, head_step=1.0, head_catch_up=1.0)
    policy = GammaPolicy(costs, [0.9] * 4, prior_weight=2.0)
    scheduler = Scheduler(FeatureTarget(capacity=256), None, 4, 256, [1, 2, 4], set(), policy_for=lambda n, c: policy,
                          proposers=Proposers(draft=DraftRunner(FakeEngine(capacity=256), 256),
                                              eagle=EagleRunner(head, 256)))
    request = Request(PROMPTS[2], 120, gamma=AUTO, proposer="auto")
    request.proposer = scheduler.proposers.make("auto")
    member = next(m for m in request.proposer.members if m.name == "eagle")
    scheduler.add(request)
    order, reads_at_let_go = [], None
    while not scheduler.idle:
        before = {name: list(counts) for name, counts in request.stats.by_proposer.items()}
        scheduler.step()
        order += [name for name, counts in request.stats.by_proposer.items() if counts != before.get(name)]
        if member.let_go and reads_at_let_go is None:
            reads_at_let_go = head.catch_ups, len(request.generated)
    assert request.generated == reference(PROMPTS[2], 120)
    models = [name for name in order if name in ("draft", "eagle")]
    assert models[:4] == ["draft", "eagle", "draft", "eagle"]  # in turns, the least seen first
    assert sorted(models[: 2 * EXPLORE_ITERATIONS]) == ["draft"] * EXPLORE_ITERATIONS + ["eagle"] * EXPLORE_ITERATIONS
    assert set(models[2 * EXPLORE_ITERATIONS :]) == {"draft"}
    assert reads_at_let_go is not None and head.catch_ups == reads_at_let_go[0]  # nothing read after it
    # let go a window after its last draft (5 tokens an iteration: 4 drafts kept, and the target's own)
    assert reads_at_let_go[1] <= 2 * EXPLORE_ITERATIONS * 5 + LET_GO_AFTER + 5


def test_under_gamma_auto_the_head_drafts_as_many_as_its_own_acceptance_pays_for():
    """The load's γ is the draft model's choice; the head's offer under γ auto carries what its own
    acceptance and costs make best, up to the row's cap: all of it where its drafts are always kept,
    less where they rarely are, and exactly what was asked at a fixed γ."""
    from speccompile.core.cost_model import LoopCosts
    from speccompile.core.gamma_policy import GammaPolicy
    from speccompile.core.request import AUTO

    costs = LoopCosts(10.0, {1: 0.5, 2: 1.0, 4: 2.0}, {1: 11.0, 2: 11.5, 4: 12.5}, head_step=1.0, head_catch_up=1.0)
    policy = GammaPolicy(costs, [0.5] * 4, prior_weight=2.0)
    runner = EagleRunner(FakeHead(), 256)
    proposers = Proposers(eagle=runner)
    for _ in range(40):
        runner.acceptance.observe(4, 4)
    asking = Request(PROMPTS[0], 50, gamma=AUTO)
    assert proposers.make("eagle").offer(asking, 2, 4, policy).count == 4  # the load's γ is 2; the head's 4
    assert proposers.make("eagle").offer(Request(PROMPTS[0], 50, gamma=2), 2, 4, policy).count == 2
    for _ in range(200):
        runner.acceptance.observe(4, 1)  # the first kept, the second never
    assert proposers.make("eagle").offer(asking, 2, 4, policy).count == 1


def test_a_head_kept_always_drafts_past_the_load_s_gamma_under_gamma_auto():
    """The scheduler verifies what the head's offer carries, not only the load's γ (the draft model's
    choice, small here under a pessimistic prior): a head fed right drafts 4 an iteration."""
    from speccompile.core.cost_model import LoopCosts
    from speccompile.core.gamma_policy import GammaPolicy
    from speccompile.core.request import AUTO

    costs = LoopCosts(10.0, {1: 0.5, 2: 1.0, 4: 2.0}, {1: 11.0, 2: 11.5, 4: 12.5}, head_step=1.0, head_catch_up=1.0)
    policy = GammaPolicy(costs, [0.4, 0.1, 0.1, 0.1], prior_weight=50.0)
    assert policy.choose(allow_zero=False) == 1
    scheduler = eagle_scheduler(FakeHead(), policy_for=lambda n, c: policy)
    request = Request(PROMPTS[1], 60, gamma=AUTO, allow_plain=False)
    request.proposer = scheduler.proposers.make("eagle")
    run(scheduler, [request])
    assert request.generated == reference(PROMPTS[1], 60)
    assert request.stats.gammas_used.get(4, 0) >= request.stats.iterations // 2, request.stats.gammas_used
