"""The continuous-batching scheduler on fake engines with exact cache semantics: every request's
tokens against a golden autoregressive reference, under churn, queueing, cancellation, mixed γ and
chunked prefill."""

import itertools
import random

import pytest

from speccompile.core.cost_model import LoopCosts
from speccompile.core.gamma_policy import GammaPolicy
from speccompile.core.request import Request
from speccompile.core.scheduler import Scheduler
from tests.core.fake_engines import AgreeingDraft, FakeEngine, next_token_of

VOCAB = 50
PROMPTS = [[3, 1, 4, 1, 5], [9], [2, 6, 5, 3, 5, 8, 9, 7]]


def reference(prompt, max_new, eos=frozenset()) -> list[int]:
    """Autoregressive decoding of the fake target, straight from its definition."""
    history, out = list(prompt), []
    while len(out) < max_new:
        token = next_token_of(history, VOCAB, 0)
        history.append(token)
        out.append(token)
        if token in eos:
            break
    return out


def scheduler(draft=None, max_batch=4, max_seq=256, gammas=(1, 2, 4, 6), eos=(), policy=None, target=None, **kw):
    target = target or FakeEngine(capacity=max_seq)
    draft = draft or FakeEngine(capacity=max_seq)
    return Scheduler(target, draft, max_batch, max_seq, list(gammas), set(eos),
                     policy_for=(lambda n, context: policy) if policy else None, **kw)


def run(s: Scheduler, requests, limit=10_000) -> int:
    for r in requests:
        s.add(r)
    for iteration in range(limit):
        if s.idle:
            return iteration
        s.step()
    raise AssertionError("scheduler did not finish")


@pytest.mark.parametrize("gamma", [1, 2, 4, 6])
@pytest.mark.parametrize("draft", [lambda: FakeEngine(), lambda: FakeEngine(salt=99), lambda: AgreeingDraft(3)],
                         ids=["copy", "unrelated", "sometimes"])
def test_every_request_equals_autoregressive(gamma, draft):
    requests = [Request(p, 17, gamma=gamma) for p in PROMPTS]
    run(scheduler(draft()), requests)
    for request, prompt in zip(requests, PROMPTS):
        assert request.generated == reference(prompt, 17)
        assert request.finish_reason == "length" and request.stats.new_tokens == 17
        # drafts are capped by what a request still needs: never more than max_new - 1 - emitted
        assert request.stats.draft_tokens <= gamma * request.stats.iterations


def test_copy_draft_accepts_everything_and_saves_target_passes():
    target = FakeEngine()
    [request] = requests = [Request([1, 2, 3], 21, gamma=4)]
    run(scheduler(target=target), requests)
    stats = request.stats
    assert (stats.acceptance_rate, stats.mean_accepted_drafts, stats.mean_acceptance_length) == (1.0, 4.0, 5.0)
    assert stats.acceptance_by_position == [1.0] * 4
    assert target.calls == 1 + 4  # prefill + (21 - 1) / 5 verifications


def test_the_last_iteration_drafts_only_what_the_request_still_needs():
    [request] = requests = [Request([1, 2, 3], 8, gamma=6)]  # 1 from prefill, then 7: one γ=6 iteration
    run(scheduler(), requests)
    assert request.generated == reference([1, 2, 3], 8)
    assert request.stats.gammas_used == {6: 1}
    [r2] = requests = [Request([1, 2, 3], 6, gamma=6)]  # 1 + 5: four drafts suffice (in γ=6's graph)
    run(scheduler(), requests)
    assert r2.stats.gammas_used == {4: 1} and r2.generated == reference([1, 2, 3], 6)


def test_stops_at_eos_and_stop_tokens_and_keeps_them():
    full = reference(PROMPTS[0], 30)
    eos, stop_token = full[6], full[3]
    a, b = Request(PROMPTS[0], 30, gamma=4), Request(PROMPTS[0], 30, gamma=4, stop_token_ids=frozenset({stop_token}))
    run(scheduler(AgreeingDraft(4), eos={eos}), [a, b])
    assert a.generated == reference(PROMPTS[0], 30, {eos}) and a.generated[-1] == eos
    assert b.generated == full[: full.index(stop_token) + 1] and b.finish_reason == "stop"


def test_a_stop_found_at_the_edge_cuts_the_tokens_where_it_says():
    """The edge (a stop string) tells the request to stop once it has seen 5 tokens: the scheduler
    retires it at its next iteration with exactly those."""
    request = Request(PROMPTS[1], 30, gamma=4)
    request.on_tokens = lambda tokens: len(request.generated) >= 5 and request.stop_at(5)
    run(scheduler(), [request])
    assert request.generated == reference(PROMPTS[1], 30)[:5] and request.finish_reason == "stop"


def test_requests_beyond_max_batch_wait_and_all_finish():
    target = FakeEngine()
    prompts = [[i, i + 1] for i in range(10)]
    requests = [Request(p, 12, gamma=2) for p in prompts]
    run(scheduler(max_batch=3, target=target), requests)
    assert [r.generated for r in requests] == [reference(p, 12) for p in prompts]
    assert max(target.batches) == 3


def test_calls_run_on_the_active_requests_only():
    """No wasted rows: with one request left, calls run at batch 1, and never wider than the active set."""
    target, draft = FakeEngine(), FakeEngine()
    short, long = Request([1], 4, gamma=2), Request([2], 30, gamma=2)
    s = scheduler(target=target, draft=draft, max_batch=8)
    run(s, [short, long])
    assert max(target.batches) == 2 and target.batches[-1] == 1 and max(draft.batches) <= 2
    assert long.generated == reference([2], 30)


@pytest.mark.parametrize("seed", range(6))
def test_exact_under_churn(seed):
    """Requests join at random iterations, some are cancelled, slots are reused and rows moved: every
    surviving request's tokens are still its own autoregressive tokens."""
    rng = random.Random(seed)
    target, draft = FakeEngine(capacity=128), AgreeingDraft(3, capacity=128)
    s = scheduler(draft=draft, target=target, max_batch=4, max_seq=128, prefill_chunk=4)
    pending = [Request([rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))], rng.randint(1, 25),
                       gamma=rng.choice([0, 1, 2, 4, 6]), stop_token_ids=frozenset({rng.randrange(VOCAB)}))
               for _ in range(14)]
    everyone = list(pending)
    cancelled = set()
    for _ in range(2000):
        if pending and rng.random() < 0.4:
            s.add(pending.pop())
        if rng.random() < 0.05:
            in_flight = [r for r in everyone if r not in pending and not r.done]
            if in_flight:
                victim = rng.choice(in_flight)
                victim.cancelled = True
                cancelled.add(id(victim))
        if s.idle and not pending:
            break
        s.step()
    assert s.idle and not pending
    for r in everyone:
        assert r.done
        expected = reference(r.prompt, r.max_new_tokens, r.stop_token_ids)
        if id(r) in cancelled and r.finish_reason == "cancelled":
            assert r.generated == expected[: len(r.generated)]
        else:
            assert r.generated == expected


def test_a_long_prompt_joins_in_chunks_without_stopping_the_others():
    target = FakeEngine()
    s = scheduler(target=target, prefill_chunk=8)
    running = Request([1, 2], 40, gamma=2)
    run(s, [])
    s.add(running)
    s.step()
    s.step()
    joining = Request(list(range(1, 50)), 5, gamma=2)
    s.add(joining)
    emitted_before = len(running.generated)
    for _ in range(3):
        s.step()
        assert len(running.generated) > emitted_before  # every iteration still decodes the running request
        emitted_before = len(running.generated)
    assert joining.prefilled == 24 and not joining.generated  # 3 chunks of 8 so far
    run(s, [])
    assert joining.generated == reference(joining.prompt, 5) and running.generated == reference([1, 2], 40)


def test_cancelling_frees_the_slot_for_a_waiting_request():
    s = scheduler(max_batch=1)
    first, second = Request([1], 100, gamma=2), Request([2], 5, gamma=2)
    s.add(first)
    s.add(second)
    s.step()
    assert s.decoding == [first] and list(s.waiting) == [second]
    first.cancelled = True
    s.step()
    assert first.finish_reason == "cancelled" and s.decoding == [second]
    run(s, [])
    assert second.generated == reference([2], 5)


def test_waiting_requests_of_like_lengths_prefill_in_one_call_and_one_ended_by_its_first_token_leaves_it():
    """Four prompts of 6-7 tokens: one target call and one draft call over the four slots. The second
    request ends at its first token (max_new_tokens 1), so the rows behind it move down: the decoding
    rows stay packed, and every request still gets its own autoregressive tokens."""
    target, draft = FakeEngine(), FakeEngine()
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12, 13], [4, 4, 4, 4, 4, 4], [9, 8, 7, 6, 5, 4, 3]]
    requests = [Request(p, 1 if i == 1 else 12, gamma=2) for i, p in enumerate(prompts)]
    s = scheduler(target=target, draft=draft, max_batch=4)
    for r in requests:
        s.add(r)
    s.step()
    assert target.batches[0] == 4 and draft.batches[0] == 4  # the prefill: one call of each model
    assert requests[1].finish_reason == "length" and s.decoding == [requests[0], *requests[2:]]
    run(s, [])
    assert [r.generated for r in requests] == [reference(p, r.max_new_tokens) for p, r in zip(prompts, requests)]


def test_the_first_token_is_emitted_before_the_draft_reads_the_prompt():
    """The time to first token is the target's prefill alone: the draft reads the prompt after the
    first token has been passed on, and not at all for a request that its first token ends."""
    events = []

    class Recording(FakeEngine):
        def forward(self, tokens, token_count, first=0, processing=None, logprobs=False):
            events.append(("draft", int(token_count[0])))
            return super().forward(tokens, token_count, first, processing, logprobs)

    draft = Recording()
    s = scheduler(draft=draft, max_batch=1)
    prompt = [2, 6, 5, 3, 5, 8, 9, 7]
    on_tokens = lambda tokens: events.append(("token", len(tokens)))  # noqa: E731
    ended = Request(prompt, 1, gamma=2, on_tokens=on_tokens)
    run(s, [ended])
    assert events == [("token", 1)] and draft.calls == 0 and ended.generated == reference(prompt, 1)

    going_on = Request(prompt, 6, gamma=2, on_tokens=on_tokens)
    run(s, [going_on])
    assert events[1:3] == [("token", 1), ("draft", len(prompt))]
    assert going_on.generated == reference(prompt, 6)


def test_prompts_of_unlike_lengths_join_alone():
    """2 and 12 tokens: padded to 12, the group would be 42% padding (GROUP_PADDING 0.25)."""
    target = FakeEngine()
    requests = [Request([1, 2], 5, gamma=2), Request(list(range(1, 13)), 5, gamma=2)]
    run(scheduler(target=target), requests)
    assert target.batches[:2] == [1, 1]
    assert [r.generated for r in requests] == [reference(r.prompt, 5) for r in requests]


def test_while_others_decode_a_group_joins_only_within_the_prefill_chunk():
    """One request decodes; three 4-token prompts arrive: a chunk of 8 holds two of them, so two join
    in one call and the third in the next iteration."""
    target = FakeEngine()
    s = scheduler(target=target, prefill_chunk=8)
    running = Request([1, 2], 30, gamma=2)
    s.add(running)
    s.step()
    arrivals = [Request([5, 6, 7, i], 6, gamma=2) for i in range(3)]
    for r in arrivals:
        s.add(r)
    calls = len(target.batches)
    s.step()
    assert target.batches[calls] == 2 and s.decoding == [running, *arrivals[:2]]
    run(s, [])
    assert [r.generated for r in arrivals] == [reference(r.prompt, 6) for r in arrivals]
    assert running.generated == reference([1, 2], 30)


def test_fits_counts_the_longest_verification():
    s = scheduler(max_seq=32, gammas=(2, 4))
    assert s.fits(Request([1] * 10, 18, gamma=4)) and not s.fits(Request([1] * 10, 19, gamma=4))
    # under AUTO the cap is the largest compiled γ with room left, down to plain decoding
    assert s.gamma_cap(Request([1] * 10, 19)) == 2 and s.gamma_cap(Request([1] * 10, 22)) == 0
    assert not s.fits(Request([1] * 10, 23))


class CyclingPolicy(GammaPolicy):
    """A γ policy that moves γ on a fixed schedule (0: plain decoding), as "auto" does under load."""

    def __init__(self, schedule):
        gammas = {g for g in schedule if g}
        super().__init__(LoopCosts.from_timings({"target_step_ms": 1.0, "draft_step_ms": 0.1,
                                                 "verify_ms": {g: 1.0 for g in gammas}}),
                         [0.5] * max(schedule))
        self.schedule = itertools.cycle(schedule)

    def choose(self, allow_zero: bool = True) -> int:
        return next(self.schedule)


def test_plain_iterations_leave_the_draft_behind_and_it_catches_up():
    draft = FakeEngine()
    requests = [Request(p, 40) for p in PROMPTS]  # AUTO
    run(scheduler(draft=draft, policy=CyclingPolicy([0, 0, 0, 4, 0, 2, 2])), requests)
    for request, prompt in zip(requests, PROMPTS):
        assert request.generated == reference(prompt, 40)
        assert set(request.stats.gammas_used) == {0, 2, 4}
        assert request.stats.acceptance_rate == 1.0  # the draft is the target: catching up kept it exact


def test_auto_observes_acceptance_and_costs():
    costs = LoopCosts.from_timings({"target_step_ms": 1.0, "draft_step_ms": 0.1, "verify_ms": {2: 1.2, 4: 1.5}})
    policy = GammaPolicy(costs, [0.5, 0.25, 0.12, 0.06])
    [request] = requests = [Request([1, 2, 3], 20)]
    run(scheduler(gammas=(2, 4), policy=policy), requests)
    assert request.generated == reference([1, 2, 3], 20)
    # every iteration that drafted (the last one needs a single token: the target's own, plainly)
    assert request.stats.gammas_used[0] == 1
    assert policy.iterations == request.stats.iterations - 1
    assert policy.cost_scale("target") != 1.0  # fake engines take microseconds, not the profiled 1.2-1.5 ms


def test_each_request_reports_its_own_time_until_its_last_token():
    prompts = [[1], [7, 8, 9]]
    eos = reference(prompts[0], 40)[2]
    assert eos not in reference(prompts[1], 40)
    a, b = Request(prompts[0], 40, gamma=2), Request(prompts[1], 40, gamma=2)
    run(scheduler(AgreeingDraft(3), eos={eos}), [a, b])
    assert len(a.generated) == 3 and len(b.generated) == 40
    assert a.stats.total_ms < b.stats.total_ms and a.stats.verify_ms < b.stats.verify_ms
    assert 0 < a.stats.ttft_ms <= a.stats.total_ms and a.stats.prefill_ms > 0


def test_plain_requests_report_their_decode_time():
    prompts = [[1], [7, 8, 9]]
    eos = reference(prompts[0], 30)[2]
    a, b = Request(prompts[0], 30, gamma=0), Request(prompts[1], 30, gamma=0)
    run(scheduler(eos={eos}), [a, b])
    assert 0 < a.stats.decode_ms < b.stats.decode_ms
    assert a.stats.mode == b.stats.mode == "autoregressive" and b.stats.draft_tokens == 0


@pytest.mark.parametrize("p_min", [0.3, 0.7])
@pytest.mark.parametrize("draft", [lambda: FakeEngine(), lambda: AgreeingDraft(3), lambda: FakeEngine(salt=99)],
                         ids=["copy", "sometimes", "unrelated"])
def test_confidence_thresholding_is_exact_and_drafts_less(p_min, draft):
    """Rows stop drafting at a token the draft is less sure of than p_min: fewer drafts, the same
    tokens, and draft steps stop once no row drafts on."""
    plain, thresholded = [Request(p, 17, gamma=6) for p in PROMPTS], [Request(p, 17, gamma=6, p_min=p_min)
                                                                       for p in PROMPTS]
    drafts_alone, drafts_thresholded = draft(), draft()
    steps_alone = run(scheduler(drafts_alone), plain)
    steps_thresholded = run(scheduler(drafts_thresholded), thresholded)
    for a, b, prompt in zip(plain, thresholded, PROMPTS):
        assert a.generated == b.generated == reference(prompt, 17)
    drafted = [sum(r.stats.draft_tokens for r in rs) for rs in (plain, thresholded)]
    assert drafted[1] < drafted[0]
    assert drafts_thresholded.calls / steps_thresholded < drafts_alone.calls / steps_alone  # steps stop early


def test_a_draft_never_sure_enough_leaves_plain_steps():
    """p_min 1: no token is that sure; every iteration stops at its first draft and decodes plainly."""
    request = Request(PROMPTS[0], 12, gamma=4, p_min=1.0)
    draft = FakeEngine()
    run(scheduler(draft), [request])
    assert request.generated == reference(PROMPTS[0], 12)
    assert request.stats.draft_tokens == 0 and request.stats.gammas_used == {0: request.stats.iterations}
    # the prompt, then one step per iteration but the last (its one token needs no drafts)
    assert draft.calls == 1 + request.stats.iterations - 1
