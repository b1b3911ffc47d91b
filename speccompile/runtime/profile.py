"""`profile`: measure what γ costs and buys on this hardware, and store a γ profile in the bundle.

For each batch size and context length: one target decode step, one draft step, one verification of
γ+1 tokens for every compiled γ (each call's cache growth is rolled back, so every repeat sees the
same context); the whole sweep runs a few times and each cost is the median over sweeps. Acceptance
per draft position comes from speculative runs at the largest compiled γ on calibration prompts (P_k
for k <= γ does not depend on γ). The cost model then predicts the speedup of every γ (0 = plain
decoding) per batch size, and picks γ*.
"""

import json
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from speccompile.core.cost_model import predicted_speedup
from speccompile.core.stats import pooled
from speccompile.errors import SpecCompileError
from speccompile.runtime.hardware import fingerprint, fingerprint_key

PROFILES_DIR = "profiles"


def _time_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _at_context(engine, batch: int, context: int, rng) -> None:
    engine.start(batch)
    engine.forward(rng.integers(0, engine.vocab_size, (batch, context)), np.full(batch, context, dtype=np.int64))


def _rolled_back(engine, call):
    """Run call() and restore the cache lengths: every repeat sees the same context."""
    def run():
        lengths = engine.cache_lengths.copy()
        call()
        engine.cache_lengths = lengths
    return run


def measure_costs(runtime, batch: int, context: int, repeats: int = 5, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    one = np.ones(batch, dtype=np.int64)
    token = rng.integers(0, runtime.target.vocab_size, (batch, 1))
    costs = {}
    for role in ("target", "draft"):
        engine = getattr(runtime, role)
        _at_context(engine, batch, context, rng)
        step = _rolled_back(engine, lambda e=engine: e.forward(token, one))
        step()  # warm-up (binding, first-run allocations)
        costs[f"{role}_step_ms"] = _time_ms(step, repeats)
    costs["verify_ms"] = {}
    _at_context(runtime.target, batch, context, rng)
    for gamma in runtime.gammas:
        tokens = rng.integers(0, runtime.target.vocab_size, (batch, gamma + 1))
        verify = _rolled_back(runtime.target, lambda t=tokens: runtime.target.verify(t))
        verify()
        costs["verify_ms"][gamma] = _time_ms(verify, repeats)
    return costs


def calibrate_acceptance(runtime, prompts: list[str], max_new_tokens: int = 48) -> tuple[list[float], float]:
    """(P_k for k = 1..γ_max, loop overhead ms per iteration) from speculative runs at γ_max."""
    gamma = max(runtime.gammas)
    s = pooled([runtime.generate([p], max_new_tokens=max_new_tokens, gamma=gamma)[0].stats for p in prompts])
    overhead = s.total_ms - s.prefill_ms - s.draft_ms - s.verify_ms
    by_position = s.acceptance_by_position
    return by_position + [0.0] * (gamma - len(by_position)), overhead / max(1, s.iterations)


def _mean_costs(per_context: list[dict]) -> dict:
    gammas = per_context[0]["verify_ms"]
    return {
        "target_step_ms": statistics.mean(c["target_step_ms"] for c in per_context),
        "draft_step_ms": statistics.mean(c["draft_step_ms"] for c in per_context),
        "verify_ms": {g: statistics.mean(c["verify_ms"][g] for c in per_context) for g in gammas},
    }


def median_costs(rounds: list[dict]) -> dict:
    """Per-quantity median of several `measure_costs` results at one point."""
    median = lambda key: statistics.median(r[key] for r in rounds)
    return {"target_step_ms": median("target_step_ms"), "draft_step_ms": median("draft_step_ms"),
            "verify_ms": {g: statistics.median(r["verify_ms"][g] for r in rounds) for g in rounds[0]["verify_ms"]}}


def build_profile(runtime, prompts, batch_sizes, context_lengths, repeats: int = 5, rounds: int = 3, log=print) -> dict:
    """`rounds` sweeps over every (batch size, context) point, each point's costs the median over the
    sweeps: a machine that slows down for a while (shared hosts, thermals) then spoils one sweep's
    numbers, not the profile, and costs measured at different points stay comparable."""
    for b in batch_sizes:
        if not 1 <= b <= runtime.max_batch:
            raise SpecCompileError(f"batch size {b} is outside 1..{runtime.max_batch} (the bundle's max batch)")
    contexts = [c for c in context_lengths if c + max(runtime.gammas) + 2 <= runtime.max_seq]
    if not contexts:
        raise SpecCompileError(f"no context length fits the bundle's max sequence length {runtime.max_seq}")
    log(f"calibrating acceptance on {len(prompts)} prompts at γ={max(runtime.gammas)}")
    by_position, overhead = calibrate_acceptance(runtime, prompts)
    if rounds < 1 or repeats < 1:
        raise SpecCompileError(f"--rounds and --repeats must be positive (got {rounds}, {repeats})")
    measured = {(batch, context): [] for batch in batch_sizes for context in contexts}
    for sweep in range(rounds):
        log(f"measuring step costs, round {sweep + 1}/{rounds}: batch sizes {batch_sizes}, contexts {contexts}")
        for (batch, context), sweeps in measured.items():
            sweeps.append(measure_costs(runtime, batch, context, repeats, seed=sweep))
    by_batch = {}
    for batch in batch_sizes:
        per_context = [median_costs(measured[batch, context]) for context in contexts]
        costs = _mean_costs(per_context)
        speedups = {0: 1.0}
        for gamma in runtime.gammas:
            speedups[gamma] = predicted_speedup(by_position[:gamma], costs["target_step_ms"], costs["draft_step_ms"],
                                                costs["verify_ms"][gamma], overhead)
        best = max(speedups, key=lambda g: (speedups[g], -g))
        by_batch[batch] = {**costs, "per_context": dict(zip(contexts, per_context)), "overhead_ms": overhead,
                           "predicted_speedup": speedups, "best_gamma": best}
    fp = fingerprint(runtime.backend)
    return {
        "fingerprint": fp,
        "key": fingerprint_key(fp),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "gammas": runtime.gammas,
        "context_lengths": contexts,
        "acceptance_by_position": by_position,
        "by_batch": by_batch,
    }


# ---------------------------------------------------------------------------------------------
# storage: bundle/profiles/<fingerprint key>.json (outside the manifest's integrity list: a bundle
# gains profiles as it meets new hardware)


def write_profile(bundle_path: Path, profile: dict) -> Path:
    directory = Path(bundle_path) / PROFILES_DIR
    directory.mkdir(exist_ok=True)
    path = directory / f"{profile['key']}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(profile, indent=1))
    tmp.replace(path)
    return path


def _int_keys(profile: dict) -> dict:
    """JSON turns int keys into strings; turn batch sizes, contexts and γ back into ints."""
    by_batch = {}
    for batch, entry in profile["by_batch"].items():
        entry = dict(entry)
        entry["verify_ms"] = {int(g): v for g, v in entry["verify_ms"].items()}
        entry["predicted_speedup"] = {int(g): v for g, v in entry["predicted_speedup"].items()}
        entry["per_context"] = {int(c): {**costs, "verify_ms": {int(g): v for g, v in costs["verify_ms"].items()}}
                                for c, costs in entry.get("per_context", {}).items()}
        by_batch[int(batch)] = entry
    return {**profile, "by_batch": by_batch}


def find_profile(bundle_path: Path, fp: dict | None = None) -> dict | None:
    """The bundle's profile measured on hardware with this fingerprint, if any."""
    fp = fp or fingerprint()
    path = Path(bundle_path) / PROFILES_DIR / f"{fingerprint_key(fp)}.json"
    if not path.is_file():
        return None
    profile = json.loads(path.read_text())
    return _int_keys(profile) if profile.get("fingerprint") == fp else None


def timings_for_batch(profile: dict, batch: int, context: int | None = None) -> dict:
    """Step costs at the measured batch size closest to `batch` (the smaller one on a tie).

    With `context`, costs are interpolated linearly between the measured context lengths (and held
    at the nearest one outside them): attention and cache reads make every step grow with context,
    and a request's costs are those at its own lengths, not the average of the calibration points.
    """
    nearest = min(profile["by_batch"], key=lambda b: (abs(b - batch), b))
    entry = profile["by_batch"][nearest]
    if context is None or not entry.get("per_context"):
        return entry
    return interpolate_costs(entry["per_context"], context)


def interpolate_costs(per_context: dict[int, dict], context: int) -> dict:
    points = sorted(per_context)
    context = min(max(context, points[0]), points[-1])
    upper = next(c for c in points if c >= context)
    lower = max(c for c in points if c <= context)
    w = 0.0 if upper == lower else (context - lower) / (upper - lower)
    lo, hi = per_context[lower], per_context[upper]
    mix = lambda a, b: (1 - w) * a + w * b
    return {"target_step_ms": mix(lo["target_step_ms"], hi["target_step_ms"]),
            "draft_step_ms": mix(lo["draft_step_ms"], hi["draft_step_ms"]),
            "verify_ms": {g: mix(lo["verify_ms"][g], hi["verify_ms"][g]) for g in lo["verify_ms"]}}


# ---------------------------------------------------------------------------------------------
# measured speedup per γ, plots, per-op engine profile


def measured_speedups(runtime, prompts: list[str], max_new_tokens: int = 32, repeats: int = 3) -> dict[int, float]:
    """Batch-1 speculative vs autoregressive tokens/s for every compiled γ (medians of interleaved repeats)."""
    from speccompile.runtime.bench import bench

    return {g: bench(runtime, prompts, max_new_tokens, repeats=repeats, gamma=g)[0]["speedup"] for g in runtime.gammas}


def save_plots(profile: dict, directory: Path) -> list[Path]:
    """speedup vs γ (predicted per batch size, measured at batch 1) and cost breakdown vs γ."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SpecCompileError("plots need matplotlib: pip install 'speccompile[profile]'") from None
    directory.mkdir(parents=True, exist_ok=True)
    gammas = [0] + profile["gammas"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for batch, entry in profile["by_batch"].items():
        ax.plot(gammas, [entry["predicted_speedup"][g] for g in gammas], marker="o", label=f"predicted, batch {batch}")
    if profile.get("measured_speedup"):
        ax.plot(profile["gammas"], [profile["measured_speedup"][g] for g in profile["gammas"]], marker="s", linestyle="--", label="measured, batch 1")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set(xlabel="γ (draft tokens per iteration)", ylabel="speedup over autoregressive", title="speedup vs γ")
    ax.legend()
    speedup_png = directory / f"{profile['key']}-speedup.png"
    fig.savefig(speedup_png, dpi=120, bbox_inches="tight")
    plt.close(fig)

    entry = profile["by_batch"][min(profile["by_batch"])]
    draft = [g * entry["draft_step_ms"] for g in profile["gammas"]]
    verify = [entry["verify_ms"][g] for g in profile["gammas"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(profile["gammas"], draft, label="γ draft steps")
    ax.bar(profile["gammas"], verify, bottom=draft, label="verification (γ+1 tokens)")
    ax.bar(profile["gammas"], [entry["overhead_ms"]] * len(draft), bottom=[a + b for a, b in zip(draft, verify)], label="runtime overhead")
    ax.axhline(entry["target_step_ms"], color="black", linestyle=":", label="one target step")
    ax.set(xlabel="γ", ylabel="ms per iteration", title=f"cost per iteration, batch {min(profile['by_batch'])}")
    ax.legend()
    costs_png = directory / f"{profile['key']}-costs.png"
    fig.savefig(costs_png, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return [speedup_png, costs_png]


def op_profile(bundle, graph: str, feeds_for, runs: int = 5, top: int = 8) -> list[tuple[str, float, float]]:
    """ONNX Runtime's per-op profile of one graph: [(op type, total ms, share)] sorted by share."""
    import onnxruntime as ort

    from speccompile.runtime.onnxruntime_engine import session_options, shared_thread_pool

    options = session_options(shared_pool=shared_thread_pool(create=False))  # a process with the shared pool must use it
    options.enable_profiling = True
    options.log_severity_level = 3  # plain session.run copies the cache (no in-place binding): expected here
    session = ort.InferenceSession(str(bundle.graph_path(graph)), options, providers=["CPUExecutionProvider"])
    feeds = feeds_for(session)
    for _ in range(runs):
        session.run(None, feeds)
    trace = Path(session.end_profiling())
    totals: dict[str, float] = {}
    for event in json.loads(trace.read_text()):
        if event.get("cat") == "Node" and event.get("name", "").endswith("_kernel_time"):
            op = event.get("args", {}).get("op_name", "?")
            totals[op] = totals.get(op, 0.0) + event["dur"] / 1e3 / runs
    trace.unlink(missing_ok=True)
    total = sum(totals.values()) or 1.0
    return sorted(((op, ms, ms / total) for op, ms in totals.items()), key=lambda r: -r[1])[:top]


def graph_feeds(bundle, graph: str, batch: int = 1, context: int = 32):
    """Zero-filled feeds for a graph at a batch size and context (for per-op profiling)."""
    entry = bundle.graph(graph)

    def feeds_for(session):
        feeds = {}
        for spec in entry["inputs"]:
            shape = [batch if d == "batch" else (1 if d == "tokens" else d) for d in spec["shape"]]
            dtype = {"float32": np.float32, "int64": np.int64}[spec["dtype"]]
            feeds[spec["name"]] = np.zeros(shape, dtype=dtype)
        feeds["past_len"] = np.full(batch, context, dtype=np.int64)
        if "token_count" in feeds:
            feeds["token_count"] = np.ones(batch, dtype=np.int64)
        return feeds

    return feeds_for
