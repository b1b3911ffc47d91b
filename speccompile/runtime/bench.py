"""`bench`: speculative vs autoregressive decoding on the same prompts, same backend, one process.

Runs are interleaved (AR, speculative, AR, ...) so drift in machine load hits both equally; each
repeat covers every prompt at batch 1, and the reported rates are medians over repeats. The
speculative runs always speculate (mode "speculative"): under γ = auto the policy moves between the
compiled γ but never to plain decoding, which is what bench compares against.
"""

import json
import statistics
from pathlib import Path

from speccompile.core.cost_model import predicted_speedup_mixed
from speccompile.core.stats import pooled
from speccompile.errors import SpecCompileError

BENCH_KEYS = ["ar_tokens_per_s", "spec_tokens_per_s", "speedup", "acceptance_rate", "mean_accepted_drafts",
              "mean_acceptance_length", "gamma", "gammas_used", "predicted_speedup", "efficiency"]


def read_prompts(path) -> list[str]:
    """A JSON list of strings, or a text file with one prompt per non-empty line."""
    path = Path(path)
    if not path.is_file():
        raise SpecCompileError(f"prompts file not found: {path}")
    text = path.read_text()
    if path.suffix == ".json":
        prompts = json.loads(text)
        if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
            raise SpecCompileError(f"{path}: expected a JSON list of strings")
    else:
        prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise SpecCompileError(f"{path}: no prompts")
    return prompts


def _run_all(runtime, prompts, mode, gamma, max_new_tokens, sampling):
    results = [runtime.generate([p], max_new_tokens=max_new_tokens, mode=mode, gamma=gamma, **sampling)[0] for p in prompts]
    tokens = sum(r.stats.new_tokens for r in results)
    seconds = sum(r.stats.total_ms for r in results) / 1e3
    return tokens / seconds, [r.stats for r in results]


def bench(runtime, prompts: list[str], max_new_tokens: int = 64, repeats: int = 3, gamma: int | str | None = None,
          sampling: dict | None = None) -> tuple[dict, dict]:
    """Returns (summary with exactly BENCH_KEYS, details: timings behind the cost model)."""
    if repeats < 1:
        raise SpecCompileError(f"--repeats must be positive, got {repeats}")
    gamma = runtime.default_gamma if gamma is None else gamma
    sampling = sampling or {}
    _run_all(runtime, prompts[:1], "autoregressive", None, 8, sampling)  # warm-up: sessions, caches
    _run_all(runtime, prompts[:1], "speculative", gamma, 8, sampling)
    ar_rates, spec_rates, ar_stats, spec_stats = [], [], [], []
    for _ in range(repeats):
        rate, stats = _run_all(runtime, prompts, "autoregressive", None, max_new_tokens, sampling)
        ar_rates.append(rate)
        ar_stats += stats
        rate, stats = _run_all(runtime, prompts, "speculative", gamma, max_new_tokens, sampling)
        spec_rates.append(rate)
        spec_stats += stats
    spec = pooled(spec_stats)
    details = _cost_details(pooled(ar_stats), spec)
    ar_rate, spec_rate = statistics.median(ar_rates), statistics.median(spec_rates)
    summary = {
        "ar_tokens_per_s": ar_rate,
        "spec_tokens_per_s": spec_rate,
        "speedup": spec_rate / ar_rate,
        "acceptance_rate": spec.acceptance_rate,
        "mean_accepted_drafts": spec.mean_accepted_drafts,
        "mean_acceptance_length": spec.mean_acceptance_length,
        "gamma": gamma,
        "gammas_used": dict(sorted(spec.gammas_used.items())),
        "predicted_speedup": details["predicted_speedup"],
        "efficiency": (spec_rate / ar_rate) / details["predicted_speedup"],
    }
    assert list(summary) == BENCH_KEYS
    return summary, details


def _cost_details(ar, spec) -> dict:
    """Step costs behind the cost model, from the pooled stats of the batch-1 runs (whose clocks
    are each call's own, so their sums are wall time)."""
    iterations = max(1, spec.iterations)
    t_target = ar.decode_ms / max(1, ar.iterations)
    t_draft = spec.draft_ms / max(1, spec.draft_tokens)
    t_verify = spec.verify_ms / iterations  # the mean over the γ used
    t_loop = (spec.total_ms - spec.prefill_ms) / iterations
    return {
        "iterations": spec.iterations,
        "draft_tokens": spec.draft_tokens,
        "accepted_tokens": spec.accepted_tokens,
        "acceptance_by_position": spec.acceptance_by_position,
        "target_step_ms": t_target,
        "draft_step_ms": t_draft,
        "verify_ms": t_verify,
        "overhead_ms_per_iteration": t_loop - spec.mean_gamma * t_draft - t_verify,
        "draft_to_target_step_ratio": t_draft / t_target if t_target else 0.0,
        "predicted_speedup": predicted_speedup_mixed(spec.acceptance_by_position, spec.gammas_used, t_target, t_draft,
                                                     t_verify),
    }
