"""load()'s warm-up (runtime/calibration.py: first_runs_matter, warm_up): run where a model's first
runs cost more than later ones, skipped for a real-size target, whose sessions are opened all the same."""

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
