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
    assert summary["acceptance_rate"] == 1.0 and summary["mean_accepted_length"] == 4.0 and summary["gamma"] == 4
    assert summary["speedup"] == pytest.approx(summary["spec_tokens_per_s"] / summary["ar_tokens_per_s"])
    assert summary["efficiency"] == pytest.approx(summary["speedup"] / summary["predicted_speedup"])
    assert details["acceptance_by_position"] == [1.0] * 4
    assert details["target_step_ms"] > 0 and details["draft_step_ms"] > 0 and details["verify_ms"] > 0


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
