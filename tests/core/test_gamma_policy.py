"""γ selection from profile timings and online acceptance."""

import pytest

from speccompile.core.cost_model import LoopCosts
from speccompile.core.gamma_policy import SWITCH_MARGIN, GammaPolicy

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
    for _ in range(40):
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
    while policy.speedup(other) <= policy.speedup(first):  # make it slightly better, within the margin
        policy.costs.verify[other] *= 0.995
    assert policy.speedup(other) < policy.speedup(first) * (1 + SWITCH_MARGIN)
    assert policy.choose() == first
    policy.costs.verify[other] *= 0.7  # clearly better
    assert policy.choose() == other


def test_measured_costs_correct_every_gamma_alike():
    """Profiled verifications look cheap; the loop measures them at 5x: speculation stops paying."""
    policy = GammaPolicy(LoopCosts.from_timings(TIMINGS), [0.9, 0.81, 0.73, 0.66, 0.59, 0.53, 0.48, 0.43])
    assert policy.choose() == 8 and policy.cost_scale("verify") == 1.0
    for _ in range(40):
        policy.observe_costs(8, draft_ms=8 * 1.0, verify_ms=5 * 18.0)  # drafts as profiled, verification 5x
    assert policy.cost_scale("draft") == pytest.approx(1.0)
    assert policy.cost_scale("verify") == pytest.approx((4 + 40 * 5) / 44)
    assert policy.speedup(1) == pytest.approx(
        (1 + 0.9) * 10.0 / (1.0 + 11.0 * policy.cost_scale("verify")))  # γ=1 never ran, and is corrected too
    assert policy.choose() == 0  # verifications at 4.6x their profiled cost: plain decoding wins


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
    for _ in range(4):
        policy.observe_costs(1, draft_ms=2.0, verify_ms=11.0)  # as profiled: nothing to correct
    assert policy.cost_scale("draft") == pytest.approx(1.0) and policy.cost_scale("verify") == pytest.approx(1.0)
