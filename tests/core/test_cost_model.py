"""The cost model's arithmetic against hand-computed cases."""

import pytest

from speccompile.core.cost_model import (
    DRAFT,
    EAGLE,
    LoopCosts,
    expected_tokens,
    iid_acceptance_by_position,
    predicted_end_to_end_speedup,
    predicted_speedup,
    predicted_speedup_mixed,
    tokens_per_ms,
)
from speccompile.core.proposers.base import Offer, Proposer
from speccompile.core.proposers.eagle import EagleDraft
from speccompile.core.stats import GenerationStats


def test_expected_tokens_iid_matches_closed_form():
    alpha, gamma = 0.8, 4
    closed_form = (1 - alpha ** (gamma + 1)) / (1 - alpha)
    assert expected_tokens(iid_acceptance_by_position(alpha, gamma)) == pytest.approx(closed_form)
    # 1 + .8 + .64 + .512 + .4096 = 3.3616
    assert expected_tokens(iid_acceptance_by_position(0.8, 4)) == pytest.approx(3.3616)


def test_speedup_hand_computed():
    # E = 1 + 0.9 + 0.7 = 2.6; iteration = 2*1 + 12 = 14 ms; AR = 10 ms/token -> 26/14
    assert predicted_speedup([0.9, 0.7], t_target=10, t_draft=1, t_verify=12) == pytest.approx(26 / 14)


def test_free_verification_and_free_draft_give_expected_tokens():
    assert predicted_speedup([1.0, 1.0, 1.0], t_target=5, t_draft=0, t_verify=5) == pytest.approx(4.0)


def test_a_draft_that_never_agrees_is_a_slowdown():
    assert predicted_speedup([0.0] * 4, t_target=10, t_draft=1, t_verify=11) == pytest.approx(10 / 15)


def test_overhead_counts():
    assert predicted_speedup([1.0], t_target=10, t_draft=1, t_verify=10, t_overhead=1) == pytest.approx(20 / 12)


def test_gamma_zero_is_plain_decoding():
    assert predicted_speedup([], t_target=10, t_draft=1, t_verify=10) == 1.0


def test_one_gamma_mix_is_the_plain_prediction():
    assert predicted_speedup_mixed([0.9, 0.7], {2: 5}, t_target=10, t_draft=1, t_verify=12) == pytest.approx(26 / 14)


def test_mixed_gammas_average_tokens_and_time_per_iteration():
    # γ=1 (3 iterations): E = 1.9; γ=2 (1 iteration): E = 2.6 -> mean E = (5.7 + 2.6) / 4 = 2.075
    # mean γ = 5 / 4; iteration = 1.25 * 1 + 11 = 12.25 ms
    speedup = predicted_speedup_mixed([0.9, 0.7], {1: 3, 2: 1}, t_target=10, t_draft=1, t_verify=11)
    assert speedup == pytest.approx(2.075 * 10 / 12.25)


def test_measured_per_position_acceptance_predicts_the_measured_tokens_per_verification():
    """P_k over the iterations that drafted position k is what the cost model needs: under a γ that
    moved, its expected tokens per iteration are exactly the measured mean acceptance length."""
    stats = GenerationStats("speculative", "auto")
    for accepted, gamma in ((1, 1), (4, 4), (2, 4), (0, 1), (4, 4), (3, 4), (1, 1)):
        stats.record_iteration(accepted, gamma)
    # free drafts, verification as dear as a target step: the speedup is the tokens per iteration
    predicted = predicted_speedup_mixed(stats.acceptance_by_position, stats.gammas_used, t_target=1.0, t_draft=0.0,
                                        t_verify=1.0)
    assert predicted == pytest.approx(stats.mean_acceptance_length)


# ---------------------------------------------------------------------------------------------
# LoopCosts: one batch size's costs per iteration, as profiles and calibrations give them


def test_loop_costs_speedup_hand_computed():
    costs = LoopCosts(target_step=10.0, draft={2: 3.0, 4: 5.0}, verify={2: 12.0, 4: 14.0}, overhead=1.0)
    # γ=2: E = 1 + .9 + .7 = 2.6; iteration 3 + 12 + 1 = 16 ms -> 26/16
    assert costs.speedup([0.9, 0.7, 0.5, 0.3], 2) == pytest.approx(26 / 16)
    # γ=4: E = 3.4; iteration 5 + 14 + 1 = 20 ms -> 34/20; drafts at twice their cost: 5*2 + 14 + 1 = 25
    assert costs.speedup([0.9, 0.7, 0.5, 0.3], 4) == pytest.approx(34 / 20)
    assert costs.scaled(1.0, 2.0, 1.0, 0.0).speedup([0.9, 0.7, 0.5, 0.3], 4) == pytest.approx(34 / 25)
    assert costs.speedup([0.9, 0.7], 0) == 1.0


def test_scaled_costs_scale_every_target_call_alike_and_a_plain_step_pays_its_own_loop_work():
    costs = LoopCosts(target_step=10.0, draft={2: 3.0, 4: 5.0}, verify={2: 12.0, 4: 14.0}, overhead=1.0)
    busy = costs.scaled(target=2.0, draft=0.5, overhead=3.0, plain_overhead=2.0)
    assert busy == LoopCosts(20.0, {2: 1.5, 4: 2.5}, {2: 24.0, 4: 28.0}, 3.0, 2.0)
    assert busy.plain_ms == 22.0 and tokens_per_ms(busy, [], 0) == pytest.approx(1 / 22)
    # γ=2: E = 2.6 over 1.5 + 24 + 3 = 28.5 ms, against a plain step of 22 ms
    assert busy.speedup([0.9, 0.7], 2) == pytest.approx(2.6 * 22 / 28.5)


def test_batch_one_costs_carried_to_a_batch_follow_a_line_in_the_tokens_a_call_scores():
    # target calls: 1 token 10 ms, 3 tokens 11 ms, 5 tokens 12 ms: 9.5 + 0.5 per token
    costs = LoopCosts(target_step=10.0, draft={2: 2.0, 4: 4.0}, verify={2: 11.0, 4: 12.0}, overhead=1.0)
    assert costs.at_batch(1) is costs
    four = costs.at_batch(4)
    assert four.target_step == pytest.approx(9.5 + 0.5 * 4)
    assert four.verify == pytest.approx({2: 9.5 + 0.5 * 12, 4: 9.5 + 0.5 * 20})
    assert four.draft == pytest.approx({2: 2.0 * 11.5 / 10, 4: 4.0 * 11.5 / 10})  # grown as the plain step
    assert four.overhead == 1.0
    # noisy points never make a call cheaper with more tokens, nor free
    flat = LoopCosts(target_step=10.0, draft={4: 4.0}, verify={4: 8.0}).at_batch(8)
    assert flat.target_step == flat.verify[4] == pytest.approx(9.0)


def test_loop_costs_from_timings_with_and_without_per_gamma_draft_costs():
    quick = LoopCosts.from_timings({"target_step_ms": 10.0, "draft_step_ms": 1.5, "verify_ms": {"2": 12.0, 4: 14.0}})
    assert quick == LoopCosts(10.0, {2: 3.0, 4: 6.0}, {2: 12.0, 4: 14.0}, 0.0)  # γ · one step, no loop work
    profiled = LoopCosts.from_timings({"target_step_ms": 10.0, "draft_step_ms": 1.5, "draft_ms": {"2": 4.0, "4": 7.0},
                                       "verify_ms": {"2": 12.0, "4": 14.0}, "overhead_ms": 0.5})
    assert profiled == LoopCosts(10.0, {2: 4.0, 4: 7.0}, {2: 12.0, 4: 14.0}, 0.5)  # JSON's string keys as ints
    assert profiled.gammas == [2, 4] and profiled.iteration_ms(4) == pytest.approx(21.5)


def test_loop_costs_agree_with_predicted_speedup_when_drafting_is_proportional():
    costs = LoopCosts(target_step=10.0, draft={3: 3.0}, verify={3: 13.0}, overhead=0.7)
    assert costs.speedup([0.8, 0.6, 0.4], 3) == pytest.approx(
        predicted_speedup([0.8, 0.6, 0.4], t_target=10.0, t_draft=1.0, t_verify=13.0, t_overhead=0.7))


def test_tokens_per_ms_is_expected_tokens_over_the_iteration_of_the_graph_that_holds_the_drafts():
    costs = LoopCosts(10.0, {2: 2.0, 4: 4.0}, {2: 12.0, 4: 14.0}, overhead=1.0)
    assert tokens_per_ms(costs, [0.8, 0.6, 0.4], 3) == pytest.approx(2.8 / (4.0 * 3 / 4 + 14.0 + 1.0))
    assert tokens_per_ms(costs, [0.8, 0.6, 0.4], 3, draft_steps=False) == pytest.approx(2.8 / 15.0)  # a lookup
    assert tokens_per_ms(costs, [], 0) == pytest.approx(0.1)  # a plain step
    assert tokens_per_ms(None, [0.8, 0.6], 2) == pytest.approx(2.4)  # no costs: tokens per iteration
    assert costs.speedup([0.8, 0.6], 2) == pytest.approx(tokens_per_ms(costs, [0.8, 0.6], 2) * 10.0)


def test_costs_between_batch_sizes_are_linear():
    low, high = LoopCosts(10.0, {2: 2.0}, {2: 12.0}, 1.0), LoopCosts(20.0, {2: 6.0}, {2: 20.0}, 3.0)
    assert low.mix(high, 0.25) == LoopCosts(12.5, {2: 3.0}, {2: 14.0}, 1.5)
    assert LoopCosts.from_timings(low.timings()) == low


class ModelDrafter(Proposer):
    runs_model = True  # a draft model's drafts: step_cost "draft"


def test_costs_at_the_gammas_between_the_timed_ones_are_linear_and_the_nearest_beyond_them():
    timed = LoopCosts(10.0, {1: 2.0, 4: 8.0}, {1: 11.0, 4: 26.0}, overhead=0.5)
    filled = timed.filled([1, 2, 3, 4, 5])
    assert filled.gammas == [1, 2, 3, 4, 5]
    assert filled.verify == pytest.approx({1: 11.0, 2: 16.0, 3: 21.0, 4: 26.0, 5: 26.0})
    assert filled.draft == pytest.approx({1: 2.0, 2: 4.0, 3: 6.0, 4: 8.0, 5: 8.0})
    assert (filled.target_step, filled.overhead) == (10.0, 0.5)
    assert timed.filled([1, 4]) == timed


def test_an_eagle_offer_costs_a_catch_up_and_the_heads_steps_not_the_draft_models():
    """k drafts of the EAGLE-3 head cost its catch-up (which gives the first) and k - 1 head steps; the
    same count from a draft model costs its own steps; a plain step pays no catch-up."""
    costs = LoopCosts(10.0, {2: 6.0, 4: 12.0}, {2: 12.0, 4: 14.0}, overhead=1.0, head_step=0.5, head_catch_up=0.25)
    assert costs.plain_ms == pytest.approx(10.0)
    assert costs.iteration_ms(4, 3, EAGLE) == pytest.approx(0.25 + 2 * 0.5 + 14.0 + 1.0)
    assert costs.iteration_ms(4, 3, DRAFT) == pytest.approx(12.0 * 3 / 4 + 14.0 + 1.0)
    assert costs.iteration_ms(2, 1, EAGLE) == pytest.approx(0.25 + 12.0 + 1.0)  # one draft: no head step
    assert costs.draft_ms(4, 0, EAGLE) == 0.0  # no drafts: no catch-up
    expected = [0.8, 0.6, 0.4]
    eagle, model = Offer(3, EagleDraft(None), None, expected), Offer(3, ModelDrafter(), None, expected)
    assert eagle.step_cost == EAGLE and model.step_cost == DRAFT
    assert eagle.iteration_ms(costs) == pytest.approx(16.25)
    assert model.iteration_ms(costs) == pytest.approx(24.0)
    assert eagle.rate(costs) == pytest.approx(2.8 / 16.25) == tokens_per_ms(costs, expected, 3, EAGLE)
    assert model.rate(costs) == pytest.approx(2.8 / 24.0)
    free = LoopCosts(10.0, {4: 0.0}, {4: 14.0}, head_step=2.0)  # no draft model: its steps would cost nothing
    assert Offer(4, EagleDraft(None), None, expected).iteration_ms(free) == pytest.approx(3 * 2.0 + 14.0)


def test_the_heads_costs_are_recorded_carried_and_learned_with_the_others():
    costs = LoopCosts(10.0, {2: 2.0}, {2: 12.0}, 1.0, head_step=0.5, head_catch_up=0.25)
    assert LoopCosts.from_timings(costs.timings()) == costs
    assert "head_step_ms" not in LoopCosts(10.0, {2: 2.0}, {2: 12.0}).timings()  # a record without a head: as before
    assert not LoopCosts.from_timings({"target_step_ms": 1.0, "draft_step_ms": 0.1, "verify_ms": {2: 1.2}}).has_head
    assert costs.mix(LoopCosts(20.0, {2: 6.0}, {2: 20.0}, 3.0, head_step=1.5, head_catch_up=0.75), 0.5).head_step == 1.0
    big = costs.at_batch(4)
    growth = big.target_step / costs.target_step
    assert big.head_step == pytest.approx(0.5 * growth) and big.head_catch_up == pytest.approx(0.25 * growth)
    # measured: the head's calls, its catch-up and steps, scaled by their own factor
    busy = costs.scaled(target=1.0, draft=1.0, overhead=1.25, plain_overhead=0.25, head=2.0)
    assert busy.head_step == 1.0 and busy.head_catch_up == 0.5 and busy.plain_ms == 10.25


def test_a_calibration_beside_a_head_times_its_step_and_catch_up():
    from speccompile.runtime.calibration import measure_costs
    from tests.core.test_eagle_proposer import FakeHead, FeatureTarget

    head = FakeHead()
    costs = measure_costs(FeatureTarget(capacity=256), None, [1, 4], 1, 16, repeats=2, eagle=head)
    assert costs.has_head and costs.head_step > 0 and costs.head_catch_up > 0
    assert head.steps == 3 * 3 and head.catch_ups == 1 + 3  # prefill, then per round: 3 steps (γ 4 - 1), 1 catch-up
    assert not measure_costs(FeatureTarget(capacity=256), None, [1, 4], 1, 16, repeats=2).has_head


def test_the_end_to_end_speedup_keeps_prefill_and_plain_overhead_at_their_cost():
    """10 ms a plain token, 8 of them target steps, decoding at 2x, 0.5 ms of prefill per token: 10 / (0.5 + 4)."""
    assert predicted_end_to_end_speedup(10.0, 8.0, 0.5, 2.0) == pytest.approx(10 / 4.5)
    assert predicted_end_to_end_speedup(10.0, 10.0, 0.0, 2.0) == pytest.approx(2.0)  # decoding only: the decode speedup
    assert predicted_end_to_end_speedup(10.0, 0.0, 0.5, 2.0) == 1.0  # nothing decoded: nothing predicted


def test_costs_that_fall_as_gamma_grows_are_pooled_to_their_mean():
    """A longer γ does more work: measured costs that say otherwise are noise, and the neighbours
    whose order is wrong share their mean (least squares); costs in order are left as they are."""
    from speccompile.core.cost_model import nondecreasing

    assert nondecreasing({2: 6.40, 4: 6.24, 6: 7.81}) == {2: pytest.approx(6.32), 4: pytest.approx(6.32), 6: 7.81}
    assert nondecreasing({1: 3.0, 2: 2.0, 4: 1.0}) == {1: 2.0, 2: 2.0, 4: 2.0}
    assert nondecreasing({1: 1.0, 2: 3.0, 4: 2.0, 6: 5.0}) == {1: 1.0, 2: 2.5, 4: 2.5, 6: 5.0}
    assert nondecreasing({1: 1.0, 2: 2.0, 4: 2.0}) == {1: 1.0, 2: 2.0, 4: 2.0}
    costs = LoopCosts(5.0, {2: 1.5, 4: 2.6, 6: 3.8}, {2: 6.4, 4: 6.24, 6: 7.8}, overhead=0.5).monotone()
    assert costs.verify[2] == costs.verify[4] == pytest.approx(6.32) and costs.draft == {2: 1.5, 4: 2.6, 6: 3.8}
    assert costs.target_step == 5.0 and costs.overhead == 0.5


def test_a_calibration_that_times_a_longer_verification_as_cheaper_pools_them(monkeypatch):
    """Step costs timed in a noisy order (γ 4's verification under γ 2's) reach the policy in order."""
    from speccompile.runtime import calibration
    from tests.core.test_eagle_proposer import FeatureTarget

    noisy = {2: (1.5, 6.40), 4: (2.6, 6.24), "target": (5.0,)}
    monkeypatch.setattr(calibration, "_round", lambda *args, **kwargs: noisy)
    costs = calibration.measure_costs(FeatureTarget(capacity=256), None, [2, 4], 1, 16, repeats=2)
    assert costs.verify == {2: pytest.approx(6.32), 4: pytest.approx(6.32)} and costs.draft == {2: 1.5, 4: 2.6}
