"""`bench`: the summary keys, and numbers that follow from the runs they summarise."""

import json

import pytest
from click.testing import CliRunner

import speccompile
from speccompile.cli import main
from speccompile.errors import SpecCompileError
from speccompile.runtime.bench import BENCH_KEYS, bench, read_prompts


def test_copy_draft_bench_is_consistent(bundles):
    runtime = speccompile.load(bundles("llama", "copy"))
    summary, details = bench(runtime, ["import os", "def f(x):"], max_new_tokens=16, repeats=2, gamma=4)
    assert list(summary) == BENCH_KEYS
    assert summary["acceptance_rate"] == 1.0 and summary["mean_accepted_drafts"] == 4.0 and summary["gamma"] == 4
    assert summary["mean_acceptance_length"] == 5.0 and list(summary["gammas_used"]) == [4]
    assert summary["speedup"] == pytest.approx(summary["spec_tokens_per_s"] / summary["ar_tokens_per_s"])
    assert summary["efficiency"] == pytest.approx(summary["speedup"] / summary["predicted_speedup"])
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
    assert len(read_prompts()) >= 4  # the built-in set
