"""`bench`: speculative vs autoregressive decoding on the same prompts, same backend, one process.

Runs are interleaved (AR, speculative, AR, ...) so drift in machine load hits both equally; each
repeat covers every prompt at batch 1, and the reported rates are medians over repeats.
"""

import json
import statistics
from pathlib import Path

from speccompile.core.cost_model import predicted_speedup
from speccompile.errors import SpecCompileError

BENCH_KEYS = ["ar_tokens_per_s", "spec_tokens_per_s", "speedup", "acceptance_rate", "mean_accepted_length",
              "gamma", "predicted_speedup", "efficiency"]
DEFAULT_PROMPTS = Path(__file__).resolve().parents[1] / "demo" / "prompts.json"


def read_prompts(path=None) -> list[str]:
    """A JSON list of strings, or a text file with one prompt per non-empty line."""
    path = Path(path) if path else DEFAULT_PROMPTS
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


def bench(runtime, prompts: list[str], max_new_tokens: int = 64, repeats: int = 3, gamma: int | None = None,
          sampling: dict | None = None) -> tuple[dict, dict]:
    """Returns (summary with exactly BENCH_KEYS, details: timings behind the cost model)."""
    if repeats < 1:
        raise SpecCompileError(f"--repeats must be positive, got {repeats}")
    gamma = runtime.default_gamma if gamma is None else gamma
    sampling = sampling or {}
    requested = gamma
    _run_all(runtime, prompts[:1], "autoregressive", gamma, 8, sampling)  # warm-up: sessions, caches
    _run_all(runtime, prompts[:1], "speculative", gamma, 8, sampling)
    ar_rates, spec_rates, ar_stats, spec_stats = [], [], [], []
    for _ in range(repeats):
        rate, stats = _run_all(runtime, prompts, "autoregressive", gamma, max_new_tokens, sampling)
        ar_rates.append(rate)
        ar_stats += stats
        rate, stats = _run_all(runtime, prompts, "speculative", gamma, max_new_tokens, sampling)
        spec_rates.append(rate)
        spec_stats += stats
    if gamma == "auto":  # report the γ the policy used most; the cost model is evaluated at it
        used: dict[int, int] = {}
        for s in spec_stats:
            for g, n in s.gammas_used.items():
                used[g] = used.get(g, 0) + n
        gamma = max(used, key=used.get) if used else 0
    details = _cost_details(ar_stats, spec_stats, gamma)
    ar, spec = statistics.median(ar_rates), statistics.median(spec_rates)
    summary = {
        "ar_tokens_per_s": ar,
        "spec_tokens_per_s": spec,
        "speedup": spec / ar,
        "acceptance_rate": details["accepted_tokens"] / max(1, details["draft_tokens"]),
        "mean_accepted_length": details["accepted_tokens"] / max(1, details["iterations"]),
        "gamma": requested if requested == "auto" else gamma,
        "predicted_speedup": details["predicted_speedup"],
        "efficiency": (spec / ar) / details["predicted_speedup"],
    }
    assert list(summary) == BENCH_KEYS
    return summary, details


def _cost_details(ar_stats, spec_stats, gamma) -> dict:
    iterations = sum(s.iterations for s in spec_stats)
    accepted_at = [sum(s.accepted_at[k] for s in spec_stats if k < len(s.accepted_at)) for k in range(gamma)]
    t_target = sum(s.decode_ms for s in ar_stats) / max(1, sum(s.iterations for s in ar_stats))
    # draft/verify clocks are per generate call (batch 1 here), so sum them over calls
    t_draft = sum(s.draft_ms for s in spec_stats) / max(1, sum(s.draft_tokens for s in spec_stats))
    t_verify = sum(s.verify_ms for s in spec_stats) / max(1, iterations)
    t_loop = sum(s.total_ms - s.prefill_ms for s in spec_stats) / max(1, iterations)
    by_position = [count / max(1, iterations) for count in accepted_at]
    return {
        "iterations": iterations,
        "draft_tokens": sum(s.draft_tokens for s in spec_stats),
        "accepted_tokens": sum(s.accepted_tokens for s in spec_stats),
        "acceptance_by_position": by_position,
        "target_step_ms": t_target,
        "draft_step_ms": t_draft,
        "verify_ms": t_verify,
        "overhead_ms_per_iteration": t_loop - sum(s.draft_tokens for s in spec_stats) / max(1, iterations) * t_draft - t_verify,
        "draft_to_target_step_ratio": t_draft / t_target if t_target else 0.0,
        "predicted_speedup": predicted_speedup(by_position, t_target, t_draft, t_verify),
    }
