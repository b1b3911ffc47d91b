"""Draft-free bundles (`speccompile build` without --draft): the target's graphs alone, speculating
with prompt lookup; its output is the target's (HF's), greedy and sampled alike."""

import json

import pytest
from click.testing import CliRunner

import speccompile
from speccompile.cli import main
from speccompile.errors import SpecCompileError
from tests.conftest import FAMILIES
from tests.runtime.test_generate import MAX_NEW, PROMPTS, hf_greedy


def test_a_draft_free_bundle_holds_the_target_alone(bundles):
    bundle = bundles("llama", "none")
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert set(manifest["models"]) == {"target"} and not (bundle / "draft.weights").exists()
    assert {entry["model"] for entry in manifest["graphs"].values()} == {"target"}
    assert not speccompile.load(bundle).bundle.has_draft


@pytest.mark.parametrize("family", FAMILIES)
def test_draft_free_greedy_is_hf_alone_and_in_a_batch(family, bundles, checkpoints):
    runtime = speccompile.load(bundles(family, "none"))
    expected = [hf_greedy(checkpoints(family), p, MAX_NEW) for p in PROMPTS]
    for proposer in ("ngram", "suffix", "auto"):
        batched = runtime.generate(PROMPTS, max_new_tokens=MAX_NEW, gamma=4, proposer=proposer)
        alone = [runtime.generate([p], max_new_tokens=MAX_NEW, gamma=4, proposer=proposer)[0] for p in PROMPTS]
        assert [r.token_ids for r in batched] == expected and [r.token_ids for r in alone] == expected
        used = {name for r in batched + alone for name in r.stats.by_proposer}  # tiny models repeat
        assert used == {proposer} if proposer != "auto" else used and used <= {"ngram", "suffix"}


def test_draft_free_sampling_is_the_targets_with_any_company(bundles):
    """A request's samples depend on its seed, not on whether others decode beside it."""
    runtime = speccompile.load(bundles("llama", "none"))
    alone = runtime.submit(PROMPTS[0], max_new_tokens=MAX_NEW, temperature=0.9, seed=3, gamma=4).result().token_ids
    handles = [runtime.submit(PROMPTS[0], max_new_tokens=MAX_NEW, temperature=0.9, seed=3, gamma=4)]
    handles += [runtime.submit(p, max_new_tokens=MAX_NEW, temperature=0.9, seed=i) for i, p in enumerate(PROMPTS)]
    assert handles[0].result(timeout=60).token_ids == alone
    runtime.close()


def test_the_draft_model_is_refused_where_there_is_none(bundles):
    runtime = speccompile.load(bundles("llama", "none"))
    with pytest.raises(SpecCompileError, match="no draft model"):
        runtime.generate([PROMPTS[0]], max_new_tokens=4, proposer="draft")
    [result] = runtime.generate([PROMPTS[0]], max_new_tokens=4, proposer="auto")  # auto means lookup here
    assert set(result.stats.by_proposer) <= {"ngram"}


def test_cli_builds_and_runs_a_draft_free_bundle(checkpoints, tmp_path):
    out = tmp_path / "bundle"
    build = CliRunner().invoke(main, ["build", "--target", str(checkpoints("llama")), "--out", str(out),
                                      "--gamma", "4", "--max-seq", "64", "--max-batch", "2"])
    assert build.exit_code == 0, build.output
    run = CliRunner().invoke(main, ["generate", str(out), "--prompt", "x y x y", "--max-new-tokens", "8",
                                    "--gamma", "4", "--json"])  # γ 4: speculating, whether it pays or not
    assert run.exit_code == 0, run.output
    [result] = json.loads(run.stdout)
    assert result["stats"]["mode"] == "speculative" and len(result["token_ids"]) == 8
    refused = CliRunner().invoke(main, ["build", "--target", str(checkpoints("llama")), "--out", str(tmp_path / "b2"),
                                        "--max-seq", "64", "--draft-vocab", "16"])
    assert refused.exit_code != 0 and "needs --draft" in refused.output
