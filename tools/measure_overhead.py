"""The engine's host overhead per iteration: wall time of the scheduler's iterations minus the time
spent inside the model engines' calls, on the demo pair (or a bundle), greedy, at a batch size.

    python tools/measure_overhead.py [--bundle DIR] [--batch 1] [--max-new-tokens 256] [--stop]
        [--proposer auto] [--rounds 5]

--stop gives every request stop strings that never match (what a chat client sends): their
matching cost then shows in the overhead. The engines' methods are wrapped with timers; everything
else an iteration does (planning, proposers, emitting, rollback, stop strings on the engine thread)
is the overhead. Runs against any version of speccompile with the same engine interface, so the
same command measures before and after a change. Prints one JSON line per round and the medians.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import speccompile  # noqa: E402

ENGINE_CALLS = ("forward", "forward_confident", "forward_sample", "verify", "verify_sample", "verify_tree", "move")
PROMPT = "def parse_args(argv):"


def timed_engines(runtime) -> dict:
    """Wrap the engines' calls; returns the accumulator {"ms": ...}."""
    spent = {"ms": 0.0, "depth": 0}  # depth: a call made inside another (forward -> forward_confident) counts once
    for engine in (e for e in (runtime.target, runtime.draft) if e is not None):
        for name in ENGINE_CALLS:
            call = getattr(engine, name, None)
            if call is None:
                continue

            def wrapped(*args, _call=call, **kwargs):
                start = time.perf_counter()
                spent["depth"] += 1
                try:
                    return _call(*args, **kwargs)
                finally:
                    spent["depth"] -= 1
                    if spent["depth"] == 0:
                        spent["ms"] += (time.perf_counter() - start) * 1e3

            setattr(engine, name, wrapped)
    return spent


def counted_steps(runtime, spent: dict) -> dict:
    """Wrap the scheduler's step: iterations that began with requests decoding (the first, which
    prefills, does not count), their wall time and the engines' time within them."""
    scheduler, steps = runtime.scheduler, {"n": 0, "ms": 0.0, "engine_ms": 0.0}
    step = scheduler.step

    def wrapped():
        decoding = bool(scheduler.decoding) and not scheduler.waiting and scheduler.joining is None
        start, engine = time.perf_counter(), spent["ms"]
        step()
        if decoding:
            steps["n"] += 1
            steps["ms"] += (time.perf_counter() - start) * 1e3
            steps["engine_ms"] += spent["ms"] - engine

    scheduler.step = wrapped
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", default=None, help="a bundle (default: the demo pair's)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--proposer", default="auto")
    parser.add_argument("--stop", action="store_true", help="stop strings that never match")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.bundle is None:
        from speccompile.demo import demo_bundle

        args.bundle = demo_bundle()
    runtime = speccompile.load(args.bundle)
    spent = timed_engines(runtime)
    steps = counted_steps(runtime, spent)
    prompts = [PROMPT + " " * i for i in range(args.batch)]
    options = dict(max_new_tokens=args.max_new_tokens, gamma=4, proposer=args.proposer)
    if args.stop:
        options["stop"] = ["\x00never\x00", "<|never|>"]
    runtime.generate(prompts, **{**options, "max_new_tokens": 16})  # warm-up
    results = []
    for _ in range(args.rounds):
        steps["n"], steps["ms"], steps["engine_ms"] = 0, 0.0, 0.0
        start = time.perf_counter()
        outs = runtime.generate(prompts, **options)
        wall = (time.perf_counter() - start) * 1e3
        prefill = max(o.stats.prefill_ms for o in outs)
        overhead = (steps["ms"] - steps["engine_ms"]) / max(1, steps["n"])
        row = {"batch": args.batch, "stop_strings": args.stop, "iterations": steps["n"],
               "tokens": sum(len(o.token_ids) for o in outs), "wall_ms": round(wall, 1),
               "prefill_ms": round(prefill, 2), "overhead_ms_per_iteration": round(overhead, 4)}
        print(json.dumps(row))
        results.append(row)
    print(json.dumps({"median_overhead_ms_per_iteration":
                      statistics.median(r["overhead_ms_per_iteration"] for r in results),
                      "median_wall_ms": statistics.median(r["wall_ms"] for r in results)}))
    runtime.close()


if __name__ == "__main__":
    main()
