"""load()'s warm-up (runtime/calibration.py: first_runs_matter, warm_up): run where a model's first
runs cost more than later ones, skipped for a real-size target, whose sessions are opened all the same;
and the calibration's acceptance iterations (Continuation), against the loop's own."""

import pytest

import speccompile
from speccompile.runtime import calibration
from speccompile.runtime import runtime as runtime_module

PROMPT = [5, 6, 7, 8]


@pytest.fixture
def counted(monkeypatch):
    """What load() ran: {"engine warm-ups": n, "requests": n}."""
    counts = {"engine warm-ups": 0, "requests": 0}
    warm_up, generate = runtime_module.warm_up, runtime_module.Runtime.generate

    def counted_warm_up(*args, **kwargs):
        counts["engine warm-ups"] += 1
        return warm_up(*args, **kwargs)

    def counted_generate(self, *args, **kwargs):
        counts["requests"] += 1
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(runtime_module, "warm_up", counted_warm_up)
    monkeypatch.setattr(runtime_module.Runtime, "generate", counted_generate)
    return counts


def test_a_small_model_is_warmed_up_by_load(bundles, counted):
    runtime = speccompile.load(bundles("llama", "copy"))
    assert runtime.target.weight_bytes < calibration.WARM_UP_MAX_BYTES
    assert counted["requests"] == 1  # the warm-up's short request (its engine runs: unless calibration ran them)
    runtime.close()


def test_a_real_size_target_opens_its_sessions_but_runs_nothing_at_load(bundles, counted, monkeypatch):
    """As a target of WARM_UP_MAX_BYTES or more: load() runs neither the engines nor a request, yet
    every graph a default request runs has its session, and that request's tokens are a warmed
    runtime's."""
    bundle = bundles("llama", "copy")
    warmed = speccompile.load(bundle)
    expected = warmed.generate([PROMPT], max_new_tokens=8)[0].token_ids
    warmed_files = warmed.target.loaded_files
    warmed.close()
    monkeypatch.setattr(calibration, "WARM_UP_MAX_BYTES", 1)
    counted.update({"engine warm-ups": 0, "requests": 0})
    runtime = speccompile.load(bundle)
    assert counted == {"engine warm-ups": 0, "requests": 0}
    assert runtime.target.loaded_files == warmed_files
    assert runtime.generate([PROMPT], max_new_tokens=8)[0].token_ids == expected
    runtime.close()


@pytest.mark.parametrize("draft_weights", ["float32", "int8"])
def test_the_acceptance_iterations_keep_what_the_loop_keeps(bundles, monkeypatch, draft_weights):
    """The calibration's iterations continuing a prompt (Continuation; alone, or as measure_costs'
    rounds at the largest γ) are the loop's: continuing the same prompt greedily at γ=4, the loop's
    first iterations keep the same drafts (the target itself as its draft: all of them; its int8
    copy: most)."""
    from speccompile.core.stats import GenerationStats

    runtime = speccompile.load(bundles("llama", "copy", draft_weights))
    prompt = runtime.tokenizer.encode(calibration.ACCEPTANCE_PROMPT)[-30:]
    measured = calibration.measure_acceptance(runtime.target, runtime.draft, prompt, 4, 8)
    # the cost rounds' iterations at the largest γ are the same iterations, among rolled-back calls
    text = calibration.Continuation(prompt)
    costs = calibration.measure_costs(runtime.target, runtime.draft, [1, 4], 1, len(prompt), repeats=3, text=text)
    assert text.kept == measured[:4] and costs.verify[4] > 0
    kept = []
    record = GenerationStats.record_iteration
    monkeypatch.setattr(GenerationStats, "record_iteration",
                        lambda self, accepted, gamma, proposer=None: kept.append((gamma, accepted))
                        or record(self, accepted, gamma, proposer))
    runtime.generate([prompt], max_new_tokens=60, gamma=4, mode="speculative", proposer="draft", ignore_eos=True)
    runtime.close()
    assert [(4, accepted) for accepted in measured] == kept[:8]
    if draft_weights == "float32":
        assert measured == [4] * 8
    else:
        assert 0 < sum(measured) < 32, measured  # a draft that agrees in part: the comparison checks both
