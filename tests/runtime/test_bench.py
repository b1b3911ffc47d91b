"""`bench`: the summary keys, and numbers that follow from the runs they summarise."""

import json
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

import speccompile
from speccompile.cli import main
from speccompile.cli import read_prompts as cli_prompts
from speccompile.demo import DEMO_PROMPTS
from speccompile.errors import SpecCompileError
from speccompile.core.stats import GenerationStats
from speccompile.runtime.bench import BENCH_KEYS, bench, read_prompts


class ScriptedRuntime:
    """Every timed call makes 10 tokens. Autoregressive: 10 decode steps of 5 ms, 60 ms in all, except
    one hiccup of 600 ms. Speculative at γ=2: 4 verifications keeping 2, 2, 1 and 1 drafts, 1 ms per
    draft step, 3 ms per verification, 1 ms of prefill, 25 ms in all. Warm-up calls (8 tokens) take
    an hour, so that counting one would show."""

    default_gamma = 2

    def __init__(self):
        self.timed_ar_calls = 0

    def generate(self, prompts, max_new_tokens, mode, gamma, **sampling):
        stats = GenerationStats(mode, gamma, new_tokens=10)
        if mode == "autoregressive":
            self.timed_ar_calls += max_new_tokens != 8
            stats.iterations, stats.decode_ms = 10, 50.0
            stats.total_ms = 600.0 if self.timed_ar_calls == 2 else 60.0
        else:
            for accepted in (2, 2, 1, 1):
                stats.record_iteration(accepted, gamma)
            stats.prefill_ms, stats.draft_ms, stats.verify_ms, stats.total_ms = 1.0, 8.0, 12.0, 25.0
        if max_new_tokens == 8:
            stats.total_ms = stats.decode_ms = stats.verify_ms = 3.6e6
        return [SimpleNamespace(stats=stats)]


def test_bench_reports_medians_of_the_timed_runs_and_the_costs_behind_them():
    summary, details = bench(ScriptedRuntime(), ["a"], max_new_tokens=10, repeats=3)
    assert summary["ar_tokens_per_s"] == pytest.approx(10 / 0.060)  # the 600 ms repeat is not the median
    assert summary["spec_tokens_per_s"] == pytest.approx(10 / 0.025)
    assert summary["speedup"] == pytest.approx(2.4)
    assert (summary["acceptance_rate"], summary["mean_accepted_drafts"], summary["mean_acceptance_length"]) == (0.75, 1.5, 2.5)
    assert summary["gamma"] == 2 and summary["gammas_used"] == {2: 12}
    assert details["acceptance_by_position"] == [1.0, 0.5]
    assert details["target_step_ms"] == pytest.approx(5.0) and details["draft_step_ms"] == pytest.approx(1.0)
    assert details["verify_ms"] == pytest.approx(3.0)
    assert details["overhead_ms_per_iteration"] == pytest.approx(1.0)  # (25 - 1) / 4 - 2 x 1 - 3
    assert details["draft_to_target_step_ratio"] == pytest.approx(0.2)
    assert summary["predicted_speedup"] == pytest.approx(2.5)  # 2.5 tokens x 5 ms / (2 x 1 + 3) ms: no overhead
    assert summary["efficiency"] == pytest.approx(0.96)


def test_copy_draft_bench_accepts_every_draft(bundles):
    runtime = speccompile.load(bundles("llama", "copy"))
    summary, details = bench(runtime, ["import os", "def f(x):"], max_new_tokens=16, repeats=2, gamma=4)
    assert list(summary) == BENCH_KEYS
    assert summary["acceptance_rate"] == 1.0 and summary["mean_accepted_drafts"] == 4.0 and summary["gamma"] == 4
    assert summary["mean_acceptance_length"] == 5.0 and list(summary["gammas_used"]) == [4]
    assert details["acceptance_by_position"] == [1.0] * 4
    assert details["target_step_ms"] > 0 and details["draft_step_ms"] > 0 and details["verify_ms"] > 0


def test_auto_gamma_bench_reports_the_gammas_it_used_and_acceptance_per_drafted_position(bundles, monkeypatch):
    """The policy's choice is forced to move (tiny models' timings are noise); positions 2-4 are
    drafted only by the γ=4 iterations and must not be divided by all of them."""
    import itertools

    from speccompile.core.gamma_policy import GammaPolicy

    schedule = itertools.cycle([1, 4])
    monkeypatch.setattr(GammaPolicy, "choose", lambda self, allow_zero=True: next(schedule))
    runtime = speccompile.load(bundles("llama", "copy"))
    summary, details = bench(runtime, ["import os", "def f(x):"], max_new_tokens=16, repeats=1, gamma="auto")
    assert summary["gamma"] == "auto" and set(summary["gammas_used"]) == {1, 4}
    used = summary["gammas_used"]
    mean_gamma = (used[1] + 4 * used[4]) / (used[1] + used[4])
    assert details["acceptance_by_position"] == [1.0] * 4
    assert summary["mean_acceptance_length"] == pytest.approx(1 + mean_gamma)
    t_target, t_draft, t_verify = (details[k] for k in ("target_step_ms", "draft_step_ms", "verify_ms"))
    # the cost model over the mix predicts the tokens per verification that were measured
    assert summary["predicted_speedup"] == pytest.approx(
        summary["mean_acceptance_length"] * t_target / (mean_gamma * t_draft + t_verify))


def test_cli_bench_json_has_exactly_the_keys(bundles, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("import os\n\ndef main():\n")
    result = CliRunner().invoke(main, ["bench", str(bundles("gpt2", "random")), "--prompts", str(prompts),
                                       "--max-new-tokens", "8", "--repeats", "1", "--json"])
    assert result.exit_code == 0, result.output
    assert list(json.loads(result.stdout)) == BENCH_KEYS


def test_prompt_files(tmp_path):
    (tmp_path / "p.json").write_text(json.dumps(["a\nb", "c"]))
    assert read_prompts(tmp_path / "p.json") == ["a\nb", "c"]
    (tmp_path / "bad.json").write_text(json.dumps({"a": 1}))
    with pytest.raises(SpecCompileError, match="JSON list"):
        read_prompts(tmp_path / "bad.json")
    assert len(read_prompts(DEMO_PROMPTS)) >= 4
    assert cli_prompts(None) == read_prompts(DEMO_PROMPTS)  # what bench and profile run when given no --prompts
