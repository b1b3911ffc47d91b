"""γ profiles: the steady state of a loop run, the costs and speedups they make, storage and hardware
matching, the quick calibration, and γ = auto with a profile."""

import dataclasses
import json
import shutil

import pytest
from click.testing import CliRunner

import speccompile
from speccompile.cli import main
from speccompile.core import gamma_policy
from speccompile.core.cost_model import LoopCosts
from speccompile.core.gamma_policy import GammaPolicy
from speccompile.core.params import GenerationParams
from speccompile.core.stats import GenerationStats
from speccompile.present import profile_table
from speccompile.runtime import gamma_profile
from speccompile.runtime import profile as prof
from speccompile.runtime.calibration import measure_costs
from speccompile.runtime.hardware import fingerprint, fingerprint_key

PROMPTS = ["import os", "def f(x):", "class A:"]
SHORT = GenerationParams(max_new_tokens=16)
QUICK = {"rounds": 1, "params": SHORT}  # tiny models: the structure, not the timings


@pytest.fixture
def random_bundle(tmp_path, bundles):
    return shutil.copytree(bundles("llama", "random"), tmp_path / "bundle")


# ---------------------------------------------------------------------------------------------
# a run's steady state, from when tokens came out


def test_steady_state_counts_the_iterations_in_which_every_request_decoded():
    """Request 1 joins late (its first token at 10 ms); request 0 finishes first, its last emission
    cut at max_new_tokens. Iterations every 5 ms, request 1's emissions 20 µs after request 0's."""
    events = [(0.000, 0, 1), (0.010, 1, 1)]
    for t, first, second in ((0.015, 3, 2), (0.020, 2, 2), (0.025, 4, 3), (0.030, 1, 3), (0.035, 1, 5)):
        events += [(t, 0, first), (t + 20e-6, 1, second)]
    events.append((0.040, 1, 2))  # request 1 alone
    ms, iterations, tokens = prof.steady_state(events, requests=2)
    # request 0 paces: its emissions at 15 (all decoding from 10 ms on), 20, 25, 30 ms, and 35 (cut)
    assert iterations == 3 and ms == pytest.approx(15.0)
    assert tokens == (2 + 2) + (4 + 3) + (1 + 3)  # the iterations ending at 20, 25 and 30 ms


def test_steady_state_counts_an_iteration_s_tokens_however_late_they_come():
    """Iterations every 5 ms; on a loaded machine request 1's emission of the iteration that request 0
    ends at 20 ms comes 4 ms late, past the midpoint to the next: it still counts in its iteration."""
    events = [(0.0, 0, 1), (0.0, 1, 1)]
    for t, delay in ((0.005, 20e-6), (0.010, 20e-6), (0.015, 20e-6), (0.020, 0.004), (0.025, 20e-6)):
        events += [(t, 0, 2), (t + delay, 1, 3)]
    assert prof.steady_state(events, requests=2) == (pytest.approx(20.0), 4, 4 * (2 + 3))


def test_a_run_without_a_whole_steady_iteration_counts_nothing():
    """Request 1 joins at 4 ms; request 0's emission at 5 ms ends the first iteration with both, and
    its next is its last (cut): no iteration is whole and shared."""
    events = [(0.0, 0, 1), (0.004, 1, 1), (0.005, 0, 3), (0.00502, 1, 3), (0.010, 0, 1), (0.01002, 1, 2)]
    assert prof.steady_state(events, requests=2) == (0.0, 0, 0)
    events[1] = (0.0, 1, 1)  # both prefilled at once: the iteration from 0 to 5 ms is whole
    assert prof.steady_state(events, requests=2) == (pytest.approx(5.0), 1, 6)


def test_loop_runs_add_up_and_give_per_iteration_costs():
    a = prof.LoopRun(30.0, 3, 12, draft_ms=8.0, verify_ms=20.0, clocked_iterations=4, new_tokens=20, wall_ms=50.0,
                     stats=["a"])
    b = prof.LoopRun(20.0, 2, 8, draft_ms=4.0, verify_ms=10.0, clocked_iterations=2, new_tokens=10, wall_ms=25.0,
                     stats=["b"])
    run = a + b
    assert run.iteration_ms == pytest.approx(10.0) and run.tokens_per_iteration == pytest.approx(4.0)
    assert run.per_iteration("draft") == pytest.approx(2.0) and run.per_iteration("verify") == pytest.approx(5.0)
    assert run.overhead_ms == pytest.approx(3.0) and run.tokens_per_s == pytest.approx(400.0)
    assert run.stats == ["a", "b"]


def test_prompts_end_where_a_calibration_prompt_ends_at_any_length():
    tokens = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    assert prof.prompts_at(tokens, batch=2, length=4, offset=1) == [[2, 3, 4, 5], [6, 7, 8, 9]]
    assert prof.prompts_at(tokens, batch=1, length=6, offset=3) == [[7, 8, 9, 1, 2, 3]]  # cyclic


# ---------------------------------------------------------------------------------------------
# costs and speedups from loop runs


def run(iteration_ms: float, tokens_per_iteration: float, draft_ms: float = 0.0, verify_ms: float = 0.0,
        tokens_per_s: float = 100.0, accepted: tuple = ()) -> prof.LoopRun:
    """A run of 10 steady iterations whose draft and verification clocks say so much per iteration,
    and one request's stats with these drafts accepted per iteration, at γ = 4."""
    stats = GenerationStats("speculative", 4)
    for n in accepted:
        stats.record_iteration(n, 4)
    return prof.LoopRun(10 * iteration_ms, 10, round(10 * tokens_per_iteration), 10 * draft_ms, 10 * verify_ms, 10,
                        new_tokens=round(tokens_per_s), wall_ms=1e3, stats=[stats])


def test_costs_are_relative_to_the_same_round_s_plain_step():
    """Round 2's plain runs met a busy machine, round 3's γ=2 runs did: each cost is taken against
    its own round's step, so neither moves the costs' ratio to the step."""
    rounds = [{0: run(10.0, 1), 2: run(16.0, 2.5, draft_ms=3.0, verify_ms=12.0)},
              {0: run(20.0, 1), 2: run(16.0, 2.5, draft_ms=3.0, verify_ms=12.0)},
              {0: run(11.0, 1), 2: run(35.2, 2.5, draft_ms=6.6, verify_ms=26.4)}]
    costs = prof.context_costs(rounds)
    assert costs.target_step == pytest.approx(11.0)  # median step
    # verification over the round's step: 1.2, 0.6, 2.4 -> median 1.2 -> 13.2 ms (a plain median: 12)
    assert costs.verify == {2: pytest.approx(13.2)} and costs.draft == {2: pytest.approx(3.3)}
    assert costs.draft_step == pytest.approx(3.3 / 2)
    # the loop's own work (1, 1, 2.2 ms) over the step: 0.1, 0.05, 0.2 -> 0.1 -> 1.1 ms
    assert costs.overhead == pytest.approx(1.1)


def test_a_point_predicts_with_the_gamma_policy_and_its_own_acceptance_and_measures_per_round():
    accepted = (4, 3, 2, 1, 0)  # P_k = 0.8, 0.6, 0.4, 0.2 over the rounds' runs (at γ = 2: its first two)
    rounds = [{0: run(10.0, 2, tokens_per_s=100), 2: run(15.0, 4.8, 3.0, 11.0, tokens_per_s=160, accepted=accepted),
               4: run(20.0, 6.0, 5.0, 14.0, tokens_per_s=170, accepted=accepted)},
              {0: run(10.0, 2, tokens_per_s=100), 2: run(15.0, 4.2, 3.0, 11.0, tokens_per_s=150, accepted=accepted),
               4: run(20.0, 6.4, 5.0, 14.0, tokens_per_s=180, accepted=accepted)},
              {0: run(12.0, 2, tokens_per_s=90), 2: run(18.0, 5.2, 3.6, 13.2, tokens_per_s=150, accepted=accepted),
               4: run(24.0, 6.8, 6.0, 16.8, tokens_per_s=150, accepted=accepted)}]
    point = prof.point_entry(rounds, batch=2, context=64)
    assert (point.batch, point.context) == (2, 64)
    assert point.acceptance_by_position == pytest.approx([0.8, 0.6, 0.4, 0.2])
    assert point.acceptance_by_gamma == {2: pytest.approx([0.8, 0.6]), 4: pytest.approx([0.8, 0.6, 0.4, 0.2])}
    # every cost relative to its round's step: draft 0.3 and 0.5, verification 1.1 and 1.4, work 0.1
    # and 0.1, times the median step (10 ms); the speedup as the cost model has it
    assert point.overhead_ms == pytest.approx(1.0)
    assert point.predicted_speedup[2] == pytest.approx((1 + 0.8 + 0.6) * 10 / (3 + 11 + 1))
    assert point.predicted_speedup[4] == pytest.approx((1 + 0.8 + 0.6 + 0.4 + 0.2) * 10 / (5 + 14 + 1))
    assert point.best_gamma == 2 and point.predicted_speedup[0] == 1.0
    # measured: each round's steady rate over its plain run's, median over rounds
    assert point.measured_speedup[2] == pytest.approx(4.8 / 15 / (2 / 10))  # rounds: 1.6, 1.4, 1.73
    assert point.measured_speedup[4] == pytest.approx(6.4 / 20 / (2 / 10))  # rounds: 1.5, 1.6, 1.7
    assert point.end_to_end_speedup == {2: pytest.approx(1.6), 4: pytest.approx(1.7)}
    assert point.tokens_per_iteration == {2: pytest.approx(4.8 / 2), 4: pytest.approx(6.4 / 2)}


def test_the_policy_prior_weighs_every_point_alike():
    assert prof.mean_acceptance([[0.9, 0.8], [0.1, 0.0]]) == pytest.approx([0.5, 0.4])


def point(batch=1, context=64, **fields) -> gamma_profile.ProfilePoint:
    """A profile point with these fields, the others of no consequence."""
    defaults = {"target_step_ms": 10.0, "draft_step_ms": 1.5, "draft_ms": {2: 3.0}, "verify_ms": {2: 11.0},
                "overhead_ms": 1.0, "acceptance_by_gamma": {2: [0.8, 0.6]}, "predicted_speedup": {0: 1.0, 2: 1.6},
                "best_gamma": 2, "measured_speedup": {2: 1.5}, "end_to_end_speedup": {2: 1.4},
                "tokens_per_iteration": {2: 2.3}}
    return gamma_profile.ProfilePoint(batch, context, **{**defaults, **fields})


def profile_of(points: list[gamma_profile.ProfilePoint]) -> gamma_profile.GammaProfile:
    contexts = sorted({p.context for p in points})
    return gamma_profile.GammaProfile({}, "key", "now", [2], contexts, 48, [0.8, 0.6], points)


def test_costs_between_contexts_are_interpolated():
    profile = profile_of([
        point(1, 16, target_step_ms=2.0, draft_step_ms=0.2, draft_ms={4: 1.0}, verify_ms={4: 5.0}, overhead_ms=0.2),
        point(1, 48, target_step_ms=4.0, draft_step_ms=0.6, draft_ms={4: 3.0}, verify_ms={4: 9.0}, overhead_ms=0.4),
        point(4, 16, target_step_ms=8.0), point(4, 48, target_step_ms=8.0)])
    middle = profile.costs(1, context=24)
    assert middle == LoopCosts(pytest.approx(2.5), {4: pytest.approx(1.5)}, {4: pytest.approx(6.0)},
                               pytest.approx(0.25))
    assert profile.costs(1, context=4).target_step == 2.0  # held outside the range
    assert profile.costs(1, context=500).verify[4] == 9.0
    assert profile.costs(2, context=16).target_step == 2.0  # the nearest batch size, the smaller on a tie
    assert profile.costs(3, context=16).target_step == 8.0


def test_the_table_prints_every_batch_size_context_and_gamma_and_the_largest_gap():
    profile = profile_of([point(1, 64), point(1, 256, measured_speedup={2: 1.55}),
                          point(2, 64, measured_speedup={2: 1.6}, best_gamma=0)])
    table = profile_table(profile).splitlines()
    rows = [line.split() for line in table[2:-2]]
    assert [row[:3] for row in rows] == [[b, c, g] for b, c in (("1", "64"), ("1", "256"), ("2", "64"))
                                         for g in ("0", "2")]
    assert rows[1][-3:] == ["2.40/2.30", "<-", "γ*"]  # tokens per iteration: expected 1 + .8 + .6, measured
    assert rows[4][-1] == "γ*" and rows[5][-1] != "γ*"
    assert table[-2] == "predicted vs measured: within 6.7% everywhere (the largest gap: batch 1, context 64, γ=2)"
    # 1.6 × 2.3 / 2.4 = 1.533 against 1.5, 1.55 and 1.6
    assert table[-1] == ("with the measured tokens per iteration (the costs alone): within 4.2% everywhere "
                         "(the largest gap: batch 2, context 64, γ=2)")


# ---------------------------------------------------------------------------------------------
# whole profiles on tiny bundles: structure, storage, hardware matching


def test_a_copy_draft_s_profile_counts_every_draft_accepted_and_its_policy_chooses_gamma_star(tmp_path, bundles):
    """The copy draft is the target: every draft is accepted, so a steady iteration at γ emits γ+1
    tokens per request exactly, which checks the steady-state window on real runs."""
    bundle = shutil.copytree(bundles("llama", "copy"), tmp_path / "bundle")
    runtime = speccompile.load(bundle)
    profile = prof.build_profile(runtime, PROMPTS, [1, 2], [16], **QUICK)
    runtime.close()
    assert profile.acceptance_by_position == [1.0] * 4
    gamma_profile.write_profile(bundle, profile)
    loaded = gamma_profile.find_profile(bundle)  # through JSON: γ keys are ints again
    assert loaded == profile
    assert loaded.batch_sizes == [1, 2] and loaded.context_lengths == [16]
    for batch in (1, 2):
        point = loaded.point(batch, 16)
        assert point.tokens_per_iteration == {1: 2.0, 4: 5.0}
        assert min(point.target_step_ms, *point.draft_ms.values(), *point.verify_ms.values()) > 0
        policy = GammaPolicy(loaded.costs(batch, 16), point.acceptance_by_position)
        assert point.best_gamma == policy.choose()
        assert point.predicted_speedup == {0: 1.0, **{g: pytest.approx(policy.speedup(g)) for g in (1, 4)}}
        assert point.measured_speedup.keys() == point.end_to_end_speedup.keys() == {1, 4}


def test_profiles_match_hardware_and_format(random_bundle):
    runtime = speccompile.load(random_bundle)
    profile = prof.build_profile(runtime, PROMPTS, [1], [16], **QUICK)
    runtime.close()
    path = gamma_profile.write_profile(random_bundle, profile)
    assert path.name == f"{fingerprint_key(fingerprint())}.json"
    assert gamma_profile.find_profile(random_bundle).version == gamma_profile.PROFILE_VERSION
    assert gamma_profile.find_profile(random_bundle, {**fingerprint(), "cpu": "another CPU"}) is None
    older = {**json.loads(path.read_text()), "version": 1}  # steps timed alone: not what the policy needs
    path.write_text(json.dumps(older))
    assert gamma_profile.find_profile(random_bundle) is None
    del older["version"]  # the first format had none
    path.write_text(json.dumps(older))
    assert gamma_profile.find_profile(random_bundle) is None


def test_settings_that_cannot_run_are_refused(random_bundle):
    from speccompile.errors import SpecCompileError

    runtime = speccompile.load(random_bundle)
    with pytest.raises(SpecCompileError, match="outside 1..4"):
        prof.build_profile(runtime, PROMPTS, [5], [16], **QUICK)
    with pytest.raises(SpecCompileError, match="no context length"):
        prof.build_profile(runtime, PROMPTS, [1], [200], **QUICK)  # max_seq 96
    with pytest.raises(SpecCompileError, match="at least 8"):
        prof.build_profile(runtime, PROMPTS, [1], [16], rounds=1, params=GenerationParams(max_new_tokens=4))
    runtime.close()
    # prompts of the context less half the new tokens; a shorter context runs from one token
    assert prof.run_points(runtime, [1], [4, 24, 90], 1, 1, max_new_tokens=16) == {9: 1, 24: 16}


def test_the_quick_calibration_times_every_gamma_in_the_loop_s_order_and_leaves_the_runtime_working(bundles):
    runtime = speccompile.load(bundles("llama", "copy"))
    costs = measure_costs(runtime.target, runtime.draft, runtime.gammas, batch=2, context=16, repeats=2)
    assert costs.draft.keys() == costs.verify.keys() == {1, 4} and costs.overhead == 0.0
    assert costs.draft_step == pytest.approx(sum(costs.draft.values()) / 5)
    assert min(costs.target_step, *costs.draft.values(), *costs.verify.values()) > 0
    [result] = runtime.generate([[5, 6, 7]], max_new_tokens=6, gamma=4)
    assert result.stats.acceptance_rate == 1.0  # the copy draft, exact after the calibration's rollbacks
    runtime.close()


def test_cli_profile_covers_every_batch_size_by_default_and_writes_plots(random_bundle, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("import os\ndef f(x):\n")
    result = CliRunner().invoke(main, ["profile", str(random_bundle), "--prompts", str(prompts), "--context-lengths",
                                       "16", "--max-new-tokens", "16", "--rounds", "1", "--ops"])
    assert result.exit_code == 0, result.output
    rows = [line.split() for line in result.stdout.splitlines() if line[:5].strip().isdigit()]
    assert sorted((int(row[0]), int(row[2])) for row in rows) == [(b, g) for b in (1, 2, 3, 4) for g in (0, 1, 4)]
    assert "γ*" in result.stdout and "predicted vs measured: within" in result.stdout
    assert "top ops by share" in result.stdout and "MatMul" in result.stdout
    assert {p.suffix for p in (random_bundle / "profiles").iterdir()} == {".json", ".png"}


# ---------------------------------------------------------------------------------------------
# γ = auto with a profile


def write_profile_with(bundle, acceptance: list[float], costs: LoopCosts) -> None:
    """A matching profile at batch 1 with these costs at every context (tiny models' timings are
    mostly noise) and this acceptance."""
    runtime = speccompile.load(bundle)
    profile = prof.build_profile(runtime, PROMPTS, [1], [16], **QUICK)
    runtime.close()
    timings = {"target_step_ms": costs.target_step, "draft_step_ms": costs.draft[max(costs.draft)] / max(costs.draft),
               "draft_ms": costs.draft, "verify_ms": costs.verify, "overhead_ms": costs.overhead}
    for point in profile.points:
        for key, value in timings.items():
            setattr(point, key, value)
        point.acceptance_by_gamma = {g: acceptance[:g] for g in point.acceptance_by_gamma}
    profile.acceptance_by_position = acceptance
    # the confidence threshold the profile measured is timing too: on a loaded machine it was once
    # above 0, so the copy draft stopped before its first draft and the iteration decoded plainly
    profile.p_min, profile.p_min_speedups = 0.0, {}
    gamma_profile.write_profile(bundle, profile)


def write_never_agreeing_profile(bundle) -> None:
    """γ* is 0: the draft never agrees, and even with free verification a draft that never agrees
    costs γ draft steps per target token."""
    write_profile_with(bundle, [0.0] * 4, LoopCosts(10.0, {1: 1.0, 4: 4.0}, {1: 10.0, 4: 10.0}))


def test_auto_gamma_picks_plain_decoding_when_the_draft_never_agrees_and_says_so(random_bundle):
    write_never_agreeing_profile(random_bundle)
    runtime = speccompile.load(random_bundle)  # now with a matching profile: γ defaults to auto
    [result] = runtime.generate(["import os"], max_new_tokens=6)
    runtime.close()
    assert result.stats.mode == "autoregressive" and result.stats.gamma == "auto"
    assert result.stats.auto_chose_plain and result.stats.to_dict()["auto_chose_plain"] is True
    result = CliRunner().invoke(main, ["generate", str(random_bundle), "--prompt", "import os",
                                       "--max-new-tokens", "6"])
    assert result.exit_code == 0, result.output
    assert "[autoregressive: γ=auto chose plain decoding]" in result.stderr


@pytest.mark.parametrize("request_", [{"mode": "speculative"}, {"gamma": 4}, {"mode": "speculative", "gamma": "auto"}])
def test_an_explicit_mode_or_gamma_speculates_even_when_the_profile_says_not_to(random_bundle, request_):
    write_never_agreeing_profile(random_bundle)
    runtime = speccompile.load(random_bundle)
    [result] = runtime.generate(["import os"], max_new_tokens=6, **request_)
    runtime.close()
    assert result.stats.mode == "speculative" and result.stats.iterations > 0 and not result.stats.auto_chose_plain
    assert result.stats.gamma == request_.get("gamma", "auto")


def test_cli_mode_speculative_speculates_even_when_the_profile_says_not_to(random_bundle):
    write_never_agreeing_profile(random_bundle)
    result = CliRunner().invoke(main, ["generate", str(random_bundle), "--prompt", "import os", "--max-new-tokens", "6",
                                       "--mode", "speculative", "--json"])
    assert result.exit_code == 0, result.output
    stats = json.loads(result.stdout)[0]["stats"]
    assert stats["mode"] == "speculative" and stats["iterations"] > 0 and stats["auto_chose_plain"] is False


def test_auto_gamma_speculates_at_the_policy_s_gamma_star_with_a_copy_draft(tmp_path, bundles, monkeypatch):
    """Drafting nearly free and every draft accepted: γ* is the longest, and auto runs it. (The
    loop's measured times would correct the profile's: tiny models' are noise, so they are not.)"""
    monkeypatch.setattr(GammaPolicy, "observe_timing", lambda self, timing: None)
    bundle = shutil.copytree(bundles("llama", "copy"), tmp_path / "bundle")
    write_profile_with(bundle, [1.0] * 4, LoopCosts(10.0, {1: 0.1, 4: 0.4}, {1: 11.0, 4: 12.0}, overhead=0.5))
    runtime = speccompile.load(bundle)
    assert runtime.profile.point(1, 16).draft_ms == {1: 0.1, 4: 0.4}
    [result] = runtime.generate(["import os"], max_new_tokens=20, gamma="auto")
    runtime.close()
    assert result.stats.mode == "speculative" and max(result.stats.gammas_used) == 4
    # its last iteration may need fewer drafts
    assert result.stats.gammas_used[4] >= result.stats.iterations - 1, (result.stats.gammas_used,
                                                                        result.stats.by_proposer)


def test_auto_reads_the_profile_s_costs_at_each_load(random_bundle, monkeypatch):
    write_never_agreeing_profile(random_bundle)
    runtime = speccompile.load(random_bundle)
    asked = []
    real = gamma_profile.GammaProfile.costs
    monkeypatch.setattr(gamma_profile.GammaProfile, "costs",
                        lambda p, b, context: asked.append(b) or real(p, b, context))
    runtime.generate([[5, 6, 7], [8, 9, 10, 11, 12]], max_new_tokens=8, gamma="auto")
    runtime.close()
    assert 2 in asked  # both requests decoding: the policy for a load of two


def test_without_a_profile_load_calibrates_once_and_no_request_waits_for_it(bundles, caplog, monkeypatch, tmp_path):
    from speccompile.runtime import calibration
    from speccompile.runtime import policies as policies_module
    from speccompile.runtime.policies import LoadPolicies

    calls = []
    real = LoadPolicies.calibrate
    monkeypatch.setattr(LoadPolicies, "calibrate", lambda self, *a: calls.append(1) or real(self, *a))
    caplog.set_level("DEBUG", logger="speccompile")
    bundle = shutil.copytree(bundles("llama", "copy"), tmp_path / "bundle")
    shutil.rmtree(bundle / "profiles", ignore_errors=True)  # as built: what earlier loads recorded, gone
    runtime = speccompile.load(bundle)
    assert calls == [1] and runtime.policies.calibration.draft.keys() == {1, 4}  # in the loop's order, at batch 1
    kept = runtime.policies.calibrated_acceptance  # the draft (the target itself) kept every draft
    assert kept == gamma_profile.KeptDrafts(4, (4,) * (policies_module.CALIBRATION_REPEATS + 1))  # one a round
    assert not runtime.policies.policy_for(1, 16).guessed_prior
    assert sum("no γ profile for this hardware" in r.getMessage() for r in caplog.records) == 1
    for _ in range(2):
        runtime.generate(["import os"], max_new_tokens=4)  # γ auto, the default
    runtime.generate(["import os", "def f(x):"], max_new_tokens=4)  # batch 2: the cost model's extrapolation
    runtime.close()
    assert calls == [1]
    assert set(runtime.policies._policies) == {(1, None), (2, None)}
    assert runtime.policies.policy_for(2, 16).costs == runtime.policies.calibration.at_batch(2)
    # recorded for this machine: the next load reads the costs instead of timing them again
    monkeypatch.setattr(calibration, "measure_costs", lambda *a, **k: pytest.fail("calibrated again"))
    again = speccompile.load(bundle)
    assert again.policies.calibration == runtime.policies.calibration
    assert again.policies.calibrated_acceptance == runtime.policies.calibrated_acceptance
    again.close()
    record = gamma_profile.calibration_path(bundle, fingerprint("onnxruntime"))
    entry = json.loads(record.read_text())
    version, fp = gamma_profile.CALIBRATION_VERSION, fingerprint("onnxruntime")
    for damaged in ("{", json.dumps({"version": version}),
                    json.dumps({**entry, "timings": {"target_step_ms": "x"}}),
                    json.dumps({k: v for k, v in entry.items() if k != "acceptance"}),  # a version 1 record's fields
                    json.dumps({**entry, "acceptance": {"gamma": 4, "kept": [5]}}),
                    json.dumps({**entry, "version": 1, "fingerprint": fp})):
        record.write_text(damaged)  # unreadable or not a calibration: measured again, never an error
        assert gamma_profile.find_calibration(bundle, fingerprint("onnxruntime"), [1, 4]) is None
    record.write_text(json.dumps(entry))
    assert gamma_profile.find_calibration(bundle, fingerprint("onnxruntime"), [1, 4]).acceptance == kept
    assert gamma_profile.find_calibration(bundle, fingerprint("onnxruntime"), [4]) is None  # other γ


def test_auto_follows_the_profile_at_the_requests_context(tmp_path, bundles, monkeypatch):
    """The same costs, but drafts all accepted at context 16 and none at 64 (as a draft distilled on
    short sequences behaves past them): a short request speculates, a long one decodes plainly.
    (The profile's costs decide: tiny models' measured times are noise.)"""
    monkeypatch.setattr(GammaPolicy, "observe_timing", lambda self, timing: None)
    bundle = shutil.copytree(bundles("llama", "copy"), tmp_path / "bundle")
    write_profile_with(bundle, [0.5] * 4, LoopCosts(10.0, {1: 0.1, 4: 0.4}, {1: 11.0, 4: 12.0}, overhead=0.5))
    profile = gamma_profile.find_profile(bundle)
    [short_point] = profile.points
    gammas = short_point.acceptance_by_gamma
    never = {g: [0.0] * g for g in gammas}
    profile.points.append(dataclasses.replace(short_point, context=64, acceptance_by_gamma=never))
    short_point.acceptance_by_gamma = {g: [1.0] * g for g in gammas}
    profile.context_lengths = [16, 64]
    gamma_profile.write_profile(bundle, profile)
    runtime = speccompile.load(bundle)
    [short] = runtime.generate([[5, 6, 7]], max_new_tokens=8, gamma="auto")
    [long] = runtime.generate([list(range(3, 73))], max_new_tokens=8, gamma="auto")
    runtime.close()
    assert short.stats.mode == "speculative" and max(short.stats.gammas_used) == 4
    assert long.stats.mode == "autoregressive" and long.stats.auto_chose_plain


def test_a_threshold_is_the_default_only_where_it_beats_none_by_more_than_noise():
    assert prof.best_threshold({0.0: 1.0, 0.05: 1.02, 0.1: 1.05}) == 0.1
    assert prof.best_threshold({0.0: 1.0, 0.05: 1.02}) == 0.0  # within THRESHOLD_MARGIN of none
    assert prof.best_threshold({0.0: 1.0, 0.2: 0.7}) == 0.0 and prof.best_threshold({}) == 0.0


def test_the_profile_measures_thresholds_and_the_runtime_defaults_to_its_choice(tmp_path, bundles):
    bundle = shutil.copytree(bundles("llama", "copy"), tmp_path / "bundle")
    runtime = speccompile.load(bundle)
    tokens = prof.prompt_tokens(runtime, PROMPTS)
    speedups = prof.threshold_speedups(runtime, tokens, point(1, 16, best_gamma=4), 8, SHORT, rounds=2)
    assert speedups.keys() == set(prof.P_MIN_CANDIDATES) and speedups[0.0] == 1.0
    assert prof.threshold_speedups(runtime, tokens, point(1, 16, best_gamma=0), 8, SHORT, rounds=1) == {}
    runtime.close()
    write_profile_with(bundle, [1.0] * 4, LoopCosts(10.0, {1: 0.1, 4: 0.4}, {1: 11.0, 4: 12.0}, overhead=0.5))
    profile = gamma_profile.find_profile(bundle)
    profile.p_min, profile.p_min_speedups = 1.0, {0.0: 1.0, 1.0: 2.0}  # as if no draft were ever sure enough
    gamma_profile.write_profile(bundle, profile)
    assert gamma_profile.find_profile(bundle).p_min_speedups == {0.0: 1.0, 1.0: 2.0}  # float keys again
    runtime = speccompile.load(bundle)
    [by_default] = runtime.generate(["import os"], max_new_tokens=12, gamma=4, proposer="draft")
    [asked] = runtime.generate(["import os"], max_new_tokens=12, gamma=4, proposer="draft", p_min=0.0)
    runtime.close()
    assert by_default.stats.draft_tokens == 0 < asked.stats.draft_tokens
    assert by_default.token_ids == asked.token_ids


def test_the_table_ends_with_the_thresholds_measured():
    profile = profile_of([point(1, 64, best_gamma=2)])
    profile.p_min, profile.p_min_speedups = 0.05, {0.0: 1.0, 0.05: 1.04, 0.1: 0.97}
    assert profile_table(profile).splitlines()[-1] == (
        "confidence threshold at batch 1, context 64, γ=2 (rate over p_min 0): 0: 1.00x, 0.05: 1.04x, 0.1: 0.97x; "
        "default p_min 0.05")


def test_the_profile_measures_prompt_lookup_and_auto_starts_from_it(tmp_path, bundles, monkeypatch):
    bundle = shutil.copytree(bundles("llama", "random"), tmp_path / "bundle")
    runtime = speccompile.load(bundle)
    tokens = [[5, 6, 7, 8] * 6, [9, 10, 11] * 8]  # prompts that repeat themselves: some lookups match
    monkeypatch.setattr(prof, "LOOKUP_MIN_REACHED", 1)  # the tiny model's own text rarely repeats
    speedup, priors = prof.lookup_runs(runtime, tokens, point(1, 16, best_gamma=4), 12,
                                       GenerationParams(max_new_tokens=40), rounds=3)
    runtime.close()
    assert speedup > 0 and priors and all(isinstance(n, int) and 0 <= rate <= 1 for n, rate in priors.items())
    # γ auto: lookups believed never kept do not pay (nor are they probed here), believed always kept they do
    monkeypatch.setattr(gamma_policy, "PROBE_BUDGET", 1e-9)
    write_profile_with(bundle, [0.5] * 4, LoopCosts(10.0, {1: 1.0, 4: 4.0}, {1: 11.0, 4: 12.0}, overhead=0.5))
    used = {}
    for trust in (0.0, 1.0):  # lookups never kept, or always
        profile = gamma_profile.find_profile(bundle)
        profile.lookup_priors = {n: trust for n in (2, 3, 4)}
        gamma_profile.write_profile(bundle, profile)
        assert gamma_profile.find_profile(bundle).lookup_priors == {2: trust, 3: trust, 4: trust}  # int keys again
        runtime = speccompile.load(bundle)
        [result] = runtime.generate([[5, 6, 7, 8] * 4], max_new_tokens=12, proposer="auto")
        runtime.close()
        used[trust] = result.stats.by_proposer.get("ngram", [0, 0, 0])[1]
    assert used[0.0] == 0 < used[1.0]
