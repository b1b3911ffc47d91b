"""GenerationStats: the definitions every report shares (generate, bench, profile)."""

import pytest

from speccompile.core.stats import GenerationStats, pooled


def mixed_run() -> GenerationStats:
    """γ moved under "auto": a γ=2 iteration kept both drafts, two γ=6 ones kept 6 and 3."""
    stats = GenerationStats("speculative", "auto")
    for accepted, gamma in ((2, 2), (6, 6), (3, 6)):
        stats.record_iteration(accepted, gamma)
    return stats


def test_acceptance_by_position_counts_only_iterations_that_drafted_the_position():
    stats = mixed_run()
    assert stats.drafted_at == [3, 3, 2, 2, 2, 2]
    assert stats.accepted_at == [3, 3, 2, 1, 1, 1]
    # positions 3-6 were drafted twice (the γ=6 iterations), not three times
    assert stats.acceptance_by_position == [1.0, 1.0, 1.0, 0.5, 0.5, 0.5]


def test_gamma_used_is_a_distribution_and_a_mean():
    stats = mixed_run()
    assert stats.gammas_used == {2: 1, 6: 2}
    assert stats.mean_gamma == pytest.approx(14 / 3)
    assert stats.gamma == "auto"


def test_mean_acceptance_length_is_tokens_per_verification():
    """vLLM's "mean acceptance length": the kept drafts plus the target's own token, per verification."""
    stats = mixed_run()
    assert stats.mean_accepted_drafts == pytest.approx(11 / 3)
    assert stats.mean_acceptance_length == pytest.approx(1 + 11 / 3)
    assert stats.acceptance_rate == pytest.approx(11 / 14)


def test_no_verification_reports_zeros_not_a_division_error():
    stats = GenerationStats("speculative", 4)
    assert (stats.mean_gamma, stats.mean_accepted_drafts, stats.mean_acceptance_length) == (0.0, 0.0, 0.0)
    assert stats.acceptance_by_position == []


def test_json_reports_the_phases_of_the_loop_that_ran():
    speculative = mixed_run().to_dict()
    assert {"draft_ms", "verify_ms"} <= set(speculative) and "decode_ms" not in speculative
    assert speculative["mean_acceptance_length"] == pytest.approx(1 + 11 / 3)
    assert "mean_accepted_length" not in speculative  # renamed: it was the accepted-drafts count
    plain = GenerationStats("autoregressive", 0).to_dict()
    assert "decode_ms" in plain and not {"draft_ms", "verify_ms"} & set(plain)
    assert plain["auto_chose_plain"] is False


def test_auto_chose_plain_when_auto_ran_the_target_alone():
    assert GenerationStats("autoregressive", "auto").auto_chose_plain
    assert not GenerationStats("autoregressive", 0).auto_chose_plain
    assert not GenerationStats("speculative", "auto").auto_chose_plain


def test_pooled_sums_counts_so_rates_are_over_all_runs():
    short = GenerationStats("speculative", 2)
    short.record_iteration(0, 2)
    short.verify_ms = 3.0
    total = pooled([mixed_run(), short])
    assert total.iterations == 4 and total.draft_tokens == 16 and total.accepted_tokens == 11
    assert total.drafted_at == [4, 4, 2, 2, 2, 2] and total.accepted_at == [3, 3, 2, 1, 1, 1]
    assert total.gammas_used == {2: 2, 6: 2}
    assert total.verify_ms == 3.0


def test_a_request_ignoring_eos_goes_on_and_records_each_delivery_gap():
    from speccompile.core.request import Request

    stops, goes_on = Request([3], 6), Request([3], 6, ignore_eos=True, stop_token_ids=frozenset({9}))
    for request in (stops, goes_on):
        request.emit([5], {1})
        request.emit([1, 7], {1})
    assert stops.generated == [5, 1] and stops.finish_reason == "stop"
    assert goes_on.generated == [5, 1, 7] and goes_on.finish_reason is None
    goes_on.emit([8, 9, 4], {1})
    assert goes_on.generated == [5, 1, 7, 8, 9] and goes_on.finish_reason == "stop"  # a stop token still stops
    assert len(goes_on.stats.gaps_ms) == 2 and all(gap >= 0 for gap in goes_on.stats.gaps_ms)
