"""γ profiles: measurement, round trip through the bundle, hardware matching, and γ = auto."""

import json
import shutil

import pytest
from click.testing import CliRunner

import speccompile
from speccompile.cli import main
from speccompile.runtime import profile as prof
from speccompile.runtime.hardware import fingerprint, fingerprint_key

PROMPTS = ["import os", "def f(x):", "class A:"]


@pytest.fixture
def random_bundle(tmp_path, bundles):
    return shutil.copytree(bundles("llama", "random"), tmp_path / "bundle")


def pin_costs(entry: dict, target_step_ms: float, draft_step_ms: float, verify_ms: float) -> None:
    """Fix a profile entry's costs at every measured context (tiny models' timings are noise)."""
    for costs in [entry, *entry["per_context"].values()]:
        costs.update(target_step_ms=target_step_ms, draft_step_ms=draft_step_ms,
                     verify_ms={g: verify_ms for g in costs["verify_ms"]})


def test_costs_are_interpolated_at_the_request_context(random_bundle):
    runtime = speccompile.load(random_bundle)
    profile = prof.build_profile(runtime, PROMPTS, [1], [16, 48], repeats=1, log=lambda _: None)
    at = profile["by_batch"][1]["per_context"]
    at[16].update(target_step_ms=2.0, draft_step_ms=0.2, verify_ms={1: 3.0, 4: 5.0})
    at[48].update(target_step_ms=4.0, draft_step_ms=0.6, verify_ms={1: 5.0, 4: 9.0})
    prof.write_profile(random_bundle, profile)
    loaded = prof.find_profile(random_bundle)  # through JSON: context and γ keys are ints again
    middle = prof.timings_for_batch(loaded, 1, context=24)
    assert middle["target_step_ms"] == pytest.approx(2.5) and middle["draft_step_ms"] == pytest.approx(0.3)
    assert middle["verify_ms"] == {1: pytest.approx(3.5), 4: pytest.approx(6.0)}
    assert prof.timings_for_batch(loaded, 1, context=4)["target_step_ms"] == 2.0  # held outside the range
    assert prof.timings_for_batch(loaded, 1, context=500)["verify_ms"][4] == 9.0


def test_one_slow_round_does_not_move_the_profile(random_bundle, monkeypatch):
    """Costs are medians over sweeps: a sweep measured while the machine was slow is outvoted."""
    speeds = iter([1.0, 10.0, 1.1])  # round 2 ran on a machine ten times slower

    def fake_costs(runtime, batch, context, repeats, seed=0):
        k = next(speeds)
        return {"target_step_ms": 2.0 * k, "draft_step_ms": 0.2 * k, "verify_ms": {g: 3.0 * k for g in runtime.gammas}}

    monkeypatch.setattr(prof, "measure_costs", fake_costs)
    runtime = speccompile.load(random_bundle)
    entry = prof.build_profile(runtime, PROMPTS, [1], [16], repeats=1, rounds=3, log=lambda _: None)["by_batch"][1]
    assert entry["target_step_ms"] == pytest.approx(2.2) and entry["draft_step_ms"] == pytest.approx(0.22)
    assert entry["verify_ms"] == {g: pytest.approx(3.3) for g in runtime.gammas}


def test_profile_round_trip_and_hardware_matching(random_bundle):
    runtime = speccompile.load(random_bundle)
    profile = prof.build_profile(runtime, PROMPTS, [1, 2], [16], repeats=2, log=lambda _: None)
    path = prof.write_profile(random_bundle, profile)
    assert path.name == f"{fingerprint_key(fingerprint())}.json"
    loaded = prof.find_profile(random_bundle)
    assert loaded["by_batch"].keys() == {1, 2}
    assert loaded["by_batch"][1]["verify_ms"].keys() == {1, 4}
    assert loaded["acceptance_by_position"] == profile["acceptance_by_position"]
    other = {**fingerprint(), "cpu": "another CPU"}
    assert prof.find_profile(random_bundle, other) is None
    assert prof.timings_for_batch(loaded, 3) is loaded["by_batch"][2]


def write_never_agreeing_profile(bundle) -> None:
    """A matching profile whose γ* is 0: the draft never agrees."""
    runtime = speccompile.load(bundle)
    profile = prof.build_profile(runtime, PROMPTS, [1], [16], repeats=2, log=lambda _: None)
    profile["acceptance_by_position"] = [0.0] * len(profile["acceptance_by_position"])
    # Timings fixed (tiny models' step times are mostly noise): even with free verification, a draft
    # that never agrees costs γ draft steps per target token.
    pin_costs(profile["by_batch"][1], target_step_ms=10.0, draft_step_ms=1.0, verify_ms=10.0)
    prof.write_profile(bundle, profile)


def test_auto_gamma_picks_plain_decoding_when_the_draft_never_agrees_and_says_so(random_bundle):
    write_never_agreeing_profile(random_bundle)
    runtime = speccompile.load(random_bundle)  # now with a matching profile: γ defaults to auto
    [result] = runtime.generate(["import os"], max_new_tokens=6)
    assert result.stats.mode == "autoregressive" and result.stats.gamma == "auto"
    assert result.stats.auto_chose_plain and result.stats.to_dict()["auto_chose_plain"] is True
    result = CliRunner().invoke(main, ["generate", str(random_bundle), "--prompt", "import os",
                                       "--max-new-tokens", "6"])
    assert result.exit_code == 0, result.output
    assert "[autoregressive: γ=auto chose plain decoding]" in result.stderr


@pytest.mark.parametrize("request_", [{"mode": "speculative"}, {"gamma": 4}, {"mode": "speculative", "gamma": "auto"}])
def test_an_explicit_mode_or_gamma_speculates_even_when_the_profile_says_not_to(random_bundle, request_):
    write_never_agreeing_profile(random_bundle)
    [result] = speccompile.load(random_bundle).generate(["import os"], max_new_tokens=6, **request_)
    assert result.stats.mode == "speculative" and result.stats.iterations > 0 and not result.stats.auto_chose_plain
    assert result.stats.gamma == request_.get("gamma", "auto")


def test_cli_mode_speculative_speculates_even_when_the_profile_says_not_to(random_bundle):
    write_never_agreeing_profile(random_bundle)
    result = CliRunner().invoke(main, ["generate", str(random_bundle), "--prompt", "import os", "--max-new-tokens", "6",
                                       "--mode", "speculative", "--json"])
    assert result.exit_code == 0, result.output
    stats = json.loads(result.stdout)[0]["stats"]
    assert stats["mode"] == "speculative" and stats["iterations"] > 0 and stats["auto_chose_plain"] is False


def test_auto_gamma_speculates_with_a_copy_draft(tmp_path, bundles):
    bundle = shutil.copytree(bundles("llama", "copy"), tmp_path / "bundle")
    runtime = speccompile.load(bundle)
    profile = prof.build_profile(runtime, PROMPTS, [1], [16], repeats=2, log=lambda _: None)
    assert profile["acceptance_by_position"] == [1.0] * 4
    # Pretend drafting is nearly free so that speculating must pay off: γ* is the longest.
    entry = profile["by_batch"][1]
    pin_costs(entry, target_step_ms=entry["target_step_ms"], draft_step_ms=entry["target_step_ms"] / 100,
              verify_ms=entry["verify_ms"][4])
    prof.write_profile(bundle, profile)
    [result] = speccompile.load(bundle).generate(["import os"], max_new_tokens=20, gamma="auto")
    assert result.stats.mode == "speculative" and set(result.stats.gammas_used) == {4}


def test_auto_without_profile_says_so_once_and_calibrates(bundles, capsys):
    runtime = speccompile.load(bundles("llama", "copy"))
    runtime.generate(["import os"], max_new_tokens=4, gamma="auto")
    runtime.generate(["import os"], max_new_tokens=4, gamma="auto")
    assert capsys.readouterr().err.count("no γ profile for this hardware") == 1


def test_auto_without_profile_learns_acceptance_across_requests(bundles):
    """No profile: the first request speculates (there is no acceptance to judge by yet); a draft
    that never agrees then sends the next request to plain decoding."""
    runtime = speccompile.load(bundles("llama", "random"))
    [first] = runtime.generate([[5, 6, 7]], max_new_tokens=24, gamma="auto")
    assert first.stats.mode == "speculative" and first.stats.iterations > 0
    policy = runtime._policies[1]
    assert policy.iterations == first.stats.iterations and first.stats.acceptance_rate < 0.2
    # tiny models' step times are mostly noise: pin them (a verification costs a step, a draft step 0.3)
    policy.t_target, policy.t_draft, policy.t_verify = 10.0, 3.0, {g: 10.0 for g in policy.t_verify}
    [second] = runtime.generate([[5, 6, 7]], max_new_tokens=8, gamma="auto")
    assert second.stats.mode == "autoregressive"
    assert runtime._policies[1] is policy  # kept, not recalibrated


def test_cli_profile_writes_profile_and_plots(random_bundle, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("import os\n")
    result = CliRunner().invoke(main, ["profile", str(random_bundle), "--prompts", str(prompts), "--batch-sizes", "1",
                                       "--context-lengths", "16", "--repeats", "1", "--ops"])
    assert result.exit_code == 0, result.output
    assert "γ*" in result.stdout and "top ops by share" in result.stdout and "MatMul" in result.stdout
    files = {p.suffix for p in (random_bundle / "profiles").iterdir()}
    assert files == {".json", ".png"}


def test_auto_reads_costs_at_prompt_plus_half_the_output(random_bundle, monkeypatch):
    runtime = speccompile.load(random_bundle)
    prof.write_profile(random_bundle, prof.build_profile(runtime, PROMPTS, [1], [16], repeats=1, log=lambda _: None))
    runtime = speccompile.load(random_bundle)
    asked = []
    real = prof.timings_for_batch
    monkeypatch.setattr(prof, "timings_for_batch", lambda p, b, context=None: asked.append((b, context)) or real(p, b, context))
    runtime.generate([[5, 6, 7], [8, 9, 10, 11, 12]], max_new_tokens=20, gamma="auto")
    assert asked == [(2, 5 + 10)]
