"""The speculative loop against the autoregressive loop, on fake engines with exact cache semantics."""

import itertools

import pytest

from speccompile.core.gamma_policy import GammaPolicy
from speccompile.core.speculative import autoregressive_generate, pad_prompts, speculative_generate
from tests.core.fake_engines import AgreeingDraft, FakeEngine

PROMPTS = [[3, 1, 4, 1, 5], [9], [2, 6, 5, 3, 5, 8, 9, 7]]


def reference(prompts, max_new, eos=frozenset()):
    tokens, _ = autoregressive_generate(FakeEngine(), prompts, max_new, set(eos))
    return tokens


@pytest.mark.parametrize("gamma", [1, 3, 5])
@pytest.mark.parametrize("draft", [FakeEngine(salt=0), FakeEngine(salt=99), AgreeingDraft(3, salt=0)],
                         ids=["copy", "unrelated", "sometimes"])
def test_speculative_equals_autoregressive(gamma, draft):
    tokens, stats = speculative_generate(FakeEngine(), draft, PROMPTS, gamma, 17, set())
    assert tokens == reference(PROMPTS, 17)
    assert all(len(t) == 17 for t in tokens)
    for s in stats:
        assert 0.0 <= s.acceptance_rate <= 1.0
        assert s.draft_tokens == gamma * s.iterations


def test_copy_draft_accepts_everything_and_saves_target_passes():
    target = FakeEngine()
    _, stats = speculative_generate(target, FakeEngine(), [[1, 2, 3]], 4, 20, set())
    assert stats[0].acceptance_rate == 1.0
    assert stats[0].mean_accepted_drafts == 4.0
    assert stats[0].mean_acceptance_length == 5.0  # four drafts and the target's own token per verification
    assert stats[0].acceptance_by_position == [1.0] * 4
    assert target.calls == 1 + 4  # prefill + ceil((20 - 1) / 5) verifications


def test_unrelated_draft_still_makes_progress():
    _, stats = speculative_generate(FakeEngine(), FakeEngine(salt=7), [[1, 2, 3]], 4, 12, set())
    assert stats[0].acceptance_rate < 0.5
    assert stats[0].iterations <= 11


def test_stops_at_eos_per_sequence_and_keeps_it():
    full = reference(PROMPTS, 30)
    eos = full[0][6]
    tokens, _ = speculative_generate(FakeEngine(), AgreeingDraft(4, salt=0), PROMPTS, 3, 30, {eos})
    assert tokens == reference(PROMPTS, 30, {eos})
    assert tokens[0][-1] == eos and len(tokens[0]) <= 7


def test_finished_rows_do_not_grow_their_cache():
    target, draft = FakeEngine(capacity=64), FakeEngine(capacity=64)
    prompts = [[1], [2, 3]]
    # a short max for everyone; rows finish at different iterations only through EOS
    eos = reference(prompts, 40)[0][2]
    speculative_generate(target, draft, prompts, 5, 40, {eos})
    assert target.cache_lengths[0] <= 1 + 3 + 5


def test_pad_prompts_right_pads():
    ids, lengths = pad_prompts([[1, 2, 3], [4]])
    assert ids.tolist() == [[1, 2, 3], [4, 0, 0]]
    assert lengths.tolist() == [3, 1]


def test_a_gamma_policy_learns_acceptance_and_costs_from_every_iteration():
    from speccompile.core.gamma_policy import GammaPolicy

    policy = GammaPolicy({"target_step_ms": 1.0, "draft_step_ms": 0.1, "verify_ms": {2: 1.2, 4: 1.5}}, [0.5, 0.25, 0.12, 0.06])
    tokens, stats = speculative_generate(FakeEngine(), FakeEngine(salt=0), [[1, 2, 3]], policy, 20, set())
    assert tokens == reference([[1, 2, 3]], 20)
    assert policy.iterations == stats[0].iterations
    assert policy._ratios["verify"][1] == 4.0 + stats[0].iterations  # the prior plus one cost sample per iteration
    assert policy.cost_scale("verify") != 1.0  # fake engines take microseconds, not the profiled 1.2-1.5 ms


class CyclingPolicy(GammaPolicy):
    """A γ policy that moves γ on a fixed schedule, as "auto" does when its estimates change."""

    def __init__(self, schedule):
        super().__init__({"target_step_ms": 1.0, "draft_step_ms": 0.1, "verify_ms": {g: 1.0 for g in set(schedule)}},
                         [0.5] * max(schedule))
        self.schedule = itertools.cycle(schedule)

    def choose(self, allow_zero: bool = True) -> int:
        return next(self.schedule)


def test_copy_draft_under_a_moving_gamma_accepts_every_position_it_drafted():
    _, [stats] = speculative_generate(FakeEngine(), FakeEngine(), [[1, 2, 3]], CyclingPolicy([2, 6, 6]), 40, set())
    assert stats.gamma == "auto" and set(stats.gammas_used) == {2, 6}
    assert stats.acceptance_by_position == [1.0] * 6  # positions 3-6 count only the γ=6 iterations
    assert stats.mean_gamma == pytest.approx(stats.draft_tokens / stats.iterations)
    assert stats.mean_acceptance_length == pytest.approx(1 + stats.mean_gamma)


def test_each_row_reports_its_own_time_until_its_last_token():
    """Lockstep rows share clocks; a row that stops early at EOS stops its clocks there."""
    prompts = [[1], [7, 8, 9]]
    eos = reference(prompts, 40)[0][2]
    assert eos not in reference(prompts, 40)[1]
    tokens, stats = speculative_generate(FakeEngine(), AgreeingDraft(3, salt=0), prompts, 2, 40, {eos})
    assert len(tokens[0]) == 3 and len(tokens[1]) == 40
    assert stats[0].total_ms < stats[1].total_ms
    assert stats[0].verify_ms < stats[1].verify_ms and stats[0].draft_ms < stats[1].draft_ms
    assert stats[0].prefill_ms == stats[1].prefill_ms > 0  # one prefill for the batch


def test_autoregressive_rows_report_their_decode_time():
    prompts = [[1], [7, 8, 9]]
    eos = reference(prompts, 30)[0][2]
    _, stats = autoregressive_generate(FakeEngine(), prompts, 30, {eos})
    assert 0 < stats[0].decode_ms < stats[1].decode_ms
    assert stats[0].total_ms < stats[1].total_ms
