"""γ selection from profile timings and online acceptance."""

import dataclasses
import math

import pytest

from speccompile.core.cost_model import DRAFT, EAGLE, LoopCosts
from speccompile.core.gamma_policy import COSTS_EVERY, PROBE_BUDGET, SWITCH_MARGIN, GammaPolicy, Timing, probe_interval

TIMINGS = {"target_step_ms": 10.0, "draft_step_ms": 1.0, "verify_ms": {1: 11.0, 2: 12.0, 4: 14.0, 8: 18.0}}


def test_high_acceptance_picks_a_long_gamma():
    policy = GammaPolicy(LoopCosts.from_timings(TIMINGS), [0.95 ** k for k in range(1, 9)])
    # γ=8: E = 1 + sum .95^k (k=1..8) = 7.3; time 8 + 18 = 26; speedup = 73/26 = 2.81 (best)
    assert policy.choose() == 8
    assert policy.speedup(8) == pytest.approx((1 + sum(0.95 ** k for k in range(1, 9))) * 10 / 26)


def test_a_draft_that_never_agrees_picks_zero():
    policy = GammaPolicy(LoopCosts.from_timings(TIMINGS), [0.0] * 8)
    assert policy.choose() == 0
    assert policy.choose(allow_zero=False) == 1


def test_moderate_acceptance_picks_a_short_gamma():
    policy = GammaPolicy(LoopCosts.from_timings(TIMINGS), [0.5 ** k for k in range(1, 9)])
    # γ=1: 1.5*10/12 = 1.25; γ=2: 1.75*10/14 = 1.25; γ=4: 1.9375*10/18 = 1.08 -> tie at 1 and 2, shorter wins
    assert policy.choose() == 1


def test_observations_move_the_choice():
    policy = GammaPolicy(LoopCosts.from_timings(TIMINGS), [0.95 ** k for k in range(1, 9)], prior_weight=4)
    assert policy.choose() == 8
    for _ in range(60):
        policy.observe(8, 0)  # the text turned hard: nothing is accepted
    assert policy.choose() == 0
    assert policy.acceptance_by_position(2)[0] < 0.1


def test_observe_counts_only_reached_positions():
    policy = GammaPolicy(LoopCosts.from_timings(TIMINGS), [0.5, 0.25, 0.125, 0.0625], prior_weight=2)
    policy.observe(4, 2)  # d1, d2 accepted, d3 rejected, d4 never reached
    assert policy.reached[:4] == [3, 3, 3, 2]
    assert policy.accepted[:4] == [2, 2, 1, 1]


def test_the_gamma_in_use_stays_unless_another_is_clearly_better():
    """Switching γ costs a cache refill of the other verification's weights: near-ties keep γ."""
    timings = {"target_step_ms": 10.0, "draft_step_ms": 1.0, "verify_ms": {2: 12.0, 4: 14.0}}
    policy = GammaPolicy(LoopCosts.from_timings(timings), [0.8, 0.64, 0.51, 0.41])
    first = policy.choose()
    other = 2 if first == 4 else 4
    assert policy.speedup(other) < policy.speedup(first)
    def cheaper(factor):
        policy.costs = dataclasses.replace(policy.costs, verify={**policy.costs.verify,
                                                                 other: policy.costs.verify[other] * factor})

    while policy.speedup(other) <= policy.speedup(first):  # make it slightly better, within the margin
        cheaper(0.995)
    assert policy.speedup(other) < policy.speedup(first) * (1 + SWITCH_MARGIN)
    assert policy.choose() == first
    cheaper(0.7)  # clearly better
    assert policy.choose() == other


def test_measured_costs_correct_every_gamma_alike():
    """The loop measures verifications at 5x their profiled time, drafts as profiled: every target
    call, plain steps included, is that much slower, and drafting is relatively cheaper."""
    policy = GammaPolicy(LoopCosts.from_timings(TIMINGS), [0.9, 0.81, 0.73, 0.66, 0.59, 0.53, 0.48, 0.43])
    assert policy.choose() == 8 and policy.cost_scale("target") == 1.0
    for _ in range(40):  # drafts as profiled, verification 5x
        policy.observe_timing(Timing(8, target_ms=5 * 18.0, total_ms=8 * 1.0 + 5 * 18.0, draft_ms=8 * 1.0,
                                     draft_steps=8))
    assert policy.cost_scale("draft") == pytest.approx(1.0)
    assert policy.cost_scale("target") == pytest.approx((4 + 40 * 5) / 44)
    # γ=1 never ran, and is corrected too; so is a plain step, a target call like any other
    scale = policy.cost_scale("target")
    assert policy.speedup(1) == pytest.approx((1 + 0.9) * 10.0 * scale / (1.0 + 11.0 * scale))
    assert policy.costs_now().plain_ms == pytest.approx(10.0 * policy.cost_scale("target"))


def test_plain_steps_teach_the_cost_of_every_target_call_and_the_loop_s_work_is_measured_per_kind():
    policy = GammaPolicy(LoopCosts.from_timings({**TIMINGS, "overhead_ms": 1.0}), [0.5] * 8)
    for _ in range(4):  # plain steps at twice their calibrated time, 0.5 ms of loop work each
        policy.observe_timing(Timing(0, target_ms=20.0, total_ms=20.5))
    assert policy.cost_scale("target") == pytest.approx(1.5)  # (4 + 4 x 2) / 8
    now = policy.costs_now()
    assert now.target_step == pytest.approx(15.0) and now.verify[4] == pytest.approx(21.0)
    assert now.plain_overhead == pytest.approx(0.25) and now.overhead == pytest.approx(1.0)  # means with the prior's
    policy.observe_timing(Timing(4, target_ms=21.0, total_ms=30.0, draft_ms=4.0, draft_steps=4))
    assert policy.costs_now() is now  # running means move slowly: recomputed every COSTS_EVERY observations
    for _ in range(COSTS_EVERY - 1):
        policy.observe_timing(Timing(4, target_ms=21.0, total_ms=30.0, draft_ms=4.0, draft_steps=4))
    assert policy.costs_now().overhead == pytest.approx((4 * 1.0 + COSTS_EVERY * 5.0) / (4 + COSTS_EVERY))
def test_positions_beyond_the_gamma_in_use_follow_the_observed_level():
    """Running at γ=2 with a pessimistic prior, the drafts are nearly always accepted: positions 3
    and 4 were never reached, but take the level seen at 1 and 2, so γ=4 gets its chance."""
    timings = {"target_step_ms": 10.0, "draft_step_ms": 0.5, "verify_ms": {2: 11.0, 4: 12.0}}
    policy = GammaPolicy(LoopCosts.from_timings(timings), [0.5, 0.25, 0.125, 0.0625], prior_weight=2.0)
    assert policy.choose() == 2
    for _ in range(30):
        policy.observe(2, 2)
    assert policy.acceptance_by_position(4)[2] > 0.8  # P_3 was 0.125 in the prior
    assert policy.choose() == 4


def test_the_loop_s_own_work_counts_in_every_choice():
    """Per-iteration work that does not grow with γ favours longer γ: it is paid once per iteration,
    and a longer γ needs fewer iterations. The profile's table prints these speedups, and its γ* is
    this choice (runtime/profile.py)."""
    timings = {"target_step_ms": 10.0, "draft_step_ms": 1.0, "verify_ms": {1: 11.0, 4: 14.0}}
    acceptance = [0.6, 0.36, 0.216, 0.13]
    # no loop work: γ=1 1.6*10/12 = 1.333; γ=4 2.306*10/18 = 1.281
    assert GammaPolicy(LoopCosts.from_timings(timings), acceptance).choose() == 1
    # 6 ms per iteration: γ=1 16/18 = 0.889; γ=4 23.06/24 = 0.961; and plain decoding beats both
    loaded = GammaPolicy(LoopCosts.from_timings({**timings, "overhead_ms": 6.0}), acceptance)
    assert loaded.speedup(4) == pytest.approx((1 + sum(acceptance)) * 10 / 24)
    assert loaded.choose() == 0 and loaded.choose(allow_zero=False) == 4


def test_per_gamma_draft_costs_are_what_each_gamma_pays_and_what_observations_compare_with():
    """The draft's first step of an iteration reads two tokens: γ=1 pays more per draft than γ=4."""
    timings = {"target_step_ms": 10.0, "draft_step_ms": 1.0, "draft_ms": {1: 2.0, 4: 5.0},
               "verify_ms": {1: 11.0, 4: 14.0}}
    policy = GammaPolicy(LoopCosts.from_timings(timings), [0.5, 0.25, 0.125, 0.0625])
    assert policy.speedup(1) == pytest.approx(1.5 * 10 / 13)
    assert policy.speedup(4) == pytest.approx(1.9375 * 10 / 19)
    for _ in range(4):  # as profiled: nothing to correct
        policy.observe_timing(Timing(1, target_ms=11.0, total_ms=13.0, draft_ms=2.0, draft_steps=1))
    assert policy.cost_scale("draft") == pytest.approx(1.0) and policy.cost_scale("target") == pytest.approx(1.0)


# ---------------------------------------------------------------------------------------------
# against plain decoding: declining what does not pay, and probing what was declined


def test_an_offer_runs_only_where_it_beats_a_plain_step_and_changing_takes_a_margin():
    policy = GammaPolicy(LoopCosts.from_timings(TIMINGS), [0.5] * 8)  # a plain step: 0.1 tokens per ms
    assert policy.worth_running([("draft", 0.2, 14.0), ("ngram", 0.09, 11.0)]) == [True, False]
    assert policy.declined == {"draft": 0, "ngram": 1}
    # ngram was declined: it must now beat plain by the margin; draft, running, keeps on just below it
    slightly = 0.1 * (1 + SWITCH_MARGIN / 2)
    assert policy.worth_running([("ngram", slightly, 11.0)]) == [False]
    assert policy.worth_running([("draft", 0.1 * (1 - SWITCH_MARGIN / 2), 14.0)]) == [True]


def test_a_batch_speculates_only_where_the_whole_iteration_beats_a_plain_step():
    """An offer's rate prices the whole iteration against one row's tokens: in a batch of 8 where one
    row would draft, the batch pays the verification for that row's gain alone."""
    policy = GammaPolicy(LoopCosts.from_timings(TIMINGS), [0.5] * 8)  # a plain step: 10 ms, 0.1 tokens per ms
    one_row = [("draft", 0.2, 14.0)]  # 2.8 tokens of a 14 ms iteration: twice a plain step's rate, alone
    assert policy.worth_running(one_row) == [True]
    assert policy.worth_running(one_row, batch=8) == [False]  # (8 + 1.8) / 14 ms < 8 / 10 ms
    assert policy.worth_running(one_row * 8, batch=8) == [True] * 8  # every row gains: 22.4 / 14 > 8 / 10
    assert policy.worth_running(one_row, batch=8, committed=True) == [True]  # a fixed-γ row verifies anyway


def test_a_declined_proposer_is_probed_at_an_interval_whose_cost_is_the_probe_budget():
    policy = GammaPolicy(LoopCosts.from_timings(TIMINGS), [0.0] * 8)
    iteration_ms = 16.0  # 6 ms more than a plain step of 10 ms: one probe per 6 / (budget x 10) plain steps
    interval = probe_interval(iteration_ms, 10.0)
    assert interval == math.ceil(6.0 / (PROBE_BUDGET * 10.0)) >= 20
    ran = [policy.worth_running([("draft", 0.01, iteration_ms), ("draft", 0.01, iteration_ms)])
           for _ in range(3 * interval + 3)]
    probes = [i for i, verdicts in enumerate(ran) if any(verdicts)]
    assert probes == [interval, 2 * interval + 1, 3 * interval + 2]  # one probe iteration per `interval` declined
    assert all(verdicts == [True, True] for verdicts in (ran[i] for i in probes))  # its rows probe together
    assert probe_interval(9.0, 10.0) == 1  # an iteration cheaper than a plain step costs nothing to probe


def test_proposers_declined_together_share_the_probe_budget():
    """auto's members each declined (a lookup and the draft model): their probes together cost what
    one proposer's alone would, each probing half as often."""
    policy = GammaPolicy(LoopCosts.from_timings(TIMINGS), [0.0] * 8)
    offers = [("draft", 0.01, 16.0), ("ngram", 0.01, 16.0)]
    interval = probe_interval(16.0, 10.0)
    ran = [policy.worth_running(offers) for _ in range(4 * interval + 4)]
    for row in range(2):
        probes = [i for i, verdicts in enumerate(ran) if verdicts[row]]
        assert len(probes) == 2 and abs(probes[0] - 2 * interval) <= 1, (offers[row][0], probes)


def test_what_catching_up_cost_counts_in_the_next_probe():
    policy = GammaPolicy(LoopCosts.from_timings(TIMINGS), [0.0] * 8)
    interval = probe_interval(16.0, 10.0)
    for _ in range(interval + 1):  # declined, then probed
        policy.worth_running([("draft", 0.01, 16.0)])
    policy.observe_timing(Timing(8, target_ms=18.0, total_ms=30.0, draft_ms=8.0, draft_steps=8, catch_up_ms=3.0))
    assert policy.switch_ms == {"draft": 3.0}
    later = [any(policy.worth_running([("draft", 0.01, 16.0)])) for _ in range(3 * interval)]
    # a probe that lost more than priced (a slow moment) is charged what was priced: the next is not put off
    assert later.index(True) == probe_interval(16.0 + 3.0, 10.0) > interval


def probed(policy: GammaPolicy, offer: tuple) -> int:
    """Declined iterations until the offer's next probe."""
    for declined in range(1000):
        if policy.worth_running([offer]) == [True]:
            return declined
    raise AssertionError("never probed")


def test_a_probe_is_charged_what_it_lost_so_one_whose_drafts_were_kept_is_due_again_at_once():
    policy = GammaPolicy(LoopCosts.from_timings(TIMINGS), [0.5] * 8)  # a plain step: 10 ms
    offer = ("draft", 0.05, 16.0)  # declined (half a plain step's rate): a probe that keeps nothing loses 6 ms
    interval = probe_interval(16.0, 10.0)
    assert probed(policy, offer) == interval  # no credit yet: a measured prior is not a guess
    policy.observe_timing(Timing(4, target_ms=14.0, total_ms=16.0, tokens=5.0))  # 5 tokens in 16 ms: 34 ms gained
    assert probed(policy, offer) == 0  # paid its way: due again at once
    policy.observe_timing(Timing(4, target_ms=14.0, total_ms=16.0, tokens=5.0))
    assert probed(policy, offer) == 0
    policy.observe_timing(Timing(4, target_ms=14.0, total_ms=16.0, tokens=1.0))  # kept nothing: 6 ms lost
    assert probed(policy, offer) == 0  # what the paying probes earned (up to two probes' worth) pays for it
    policy.observe_timing(Timing(4, target_ms=14.0, total_ms=16.0, tokens=1.0))
    assert 0 < probed(policy, offer) <= interval  # spent: the budget's pace again
    policy.observe_timing(Timing(4, target_ms=14.0, total_ms=16.0, tokens=1.0))
    assert probed(policy, offer) == interval


def test_under_a_guessed_prior_the_first_probe_is_due_at_the_first_decline():
    offer = ("draft", 0.05, 16.0)
    guessed = GammaPolicy(LoopCosts.from_timings(TIMINGS), [0.5] * 8, prior_weight=2.0, guessed_prior=True)
    assert guessed.worth_running([offer]) == [True]
    guessed.observe_timing(Timing(4, target_ms=14.0, total_ms=16.0, tokens=1.0))  # kept nothing
    assert probed(guessed, offer) == probe_interval(16.0, 10.0)  # then the budget's pace
    measured = GammaPolicy(LoopCosts.from_timings(TIMINGS), [0.5] * 8, prior_weight=2.0)
    assert measured.worth_running([offer]) == [False]


def test_a_model_drafter_declined_at_the_same_estimates_is_not_asked_again_until_its_probe():
    policy = GammaPolicy(LoopCosts.from_timings(TIMINGS), [0.0] * 8)
    assert not policy.still_declined("draft")  # never declined: ask it
    policy.worth_running([("draft", 0.01, 16.0)])
    interval = probe_interval(16.0, 10.0)
    skipped = 0
    while policy.still_declined("draft"):
        skipped += 1
    assert skipped == interval - 1 and policy.declined["draft"] == interval  # its offer is made for the probe
    assert policy.worth_running([("draft", 0.01, 16.0)]) == [True]
    policy.worth_running([("draft", 0.01, 16.0)])  # declined again after the probe
    policy.observe(4, 0)  # acceptance moved: the next offer is weighed again
    assert not policy.still_declined("draft")


def test_observations_fade_so_that_a_load_whose_text_changes_is_followed():
    policy = GammaPolicy(LoopCosts.from_timings(TIMINGS), [0.5] * 8, prior_weight=2)
    for _ in range(1000):
        policy.observe(4, 0)
    assert policy.acceptance_by_position(1)[0] < 0.05
    for _ in range(60):  # the text turns predictable: a few dozen iterations, not a thousand, turn the estimate
        policy.observe(4, 4)
    assert policy.acceptance_by_position(1)[0] > 0.5


def test_head_calls_teach_the_heads_cost_and_a_plain_step_pays_no_catch_up():
    """The head's calls (its catch-up, then its steps) correct the head's cost, not the draft
    model's; before any observation the measured costs are the prior's, the catch-up in an iteration
    that drafts with the head and not in a plain step."""
    costs = LoopCosts.from_timings({**TIMINGS, "head_step_ms": 0.5, "head_catch_up_ms": 0.25})
    policy = GammaPolicy(costs, [0.5] * 8)
    assert policy.costs_now().plain_ms == pytest.approx(costs.plain_ms) == pytest.approx(10.0)
    assert costs.iteration_ms(4, 4, EAGLE) == pytest.approx(0.25 + 3 * 0.5 + costs.verify[4])
    assert policy.costs_now().iteration_ms(4, 4, EAGLE) == pytest.approx(costs.iteration_ms(4, 4, EAGLE))
    for _ in range(COSTS_EVERY * 4):  # a catch-up and 2 steps (1.25 ms predicted) took 3 ms
        policy.observe_timing(Timing(4, target_ms=14.0, total_ms=16.75, draft_ms=3.0, draft_steps=3, step_cost=EAGLE))
    assert policy.cost_scale(EAGLE) > 1.8 and policy.cost_scale(DRAFT) == 1.0
    assert policy.costs_now().head_step == pytest.approx(0.5 * policy.cost_scale(EAGLE))
    assert policy.costs_now().head_catch_up == pytest.approx(0.25 * policy.cost_scale(EAGLE))
    policy.observe_timing(Timing(4, target_ms=14.0, total_ms=20.0, draft_ms=3.0, draft_steps=3, step_cost=None))
    assert policy.cost_scale(DRAFT) == 1.0  # two models' steps at once: neither's
