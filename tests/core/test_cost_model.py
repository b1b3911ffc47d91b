"""The cost model's arithmetic against hand-computed cases."""

import pytest

from speccompile.core.cost_model import expected_tokens, iid_acceptance_by_position, predicted_speedup


def test_expected_tokens_iid_matches_closed_form():
    alpha, gamma = 0.8, 4
    assert expected_tokens(iid_acceptance_by_position(alpha, gamma)) == pytest.approx((1 - alpha ** (gamma + 1)) / (1 - alpha))
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
