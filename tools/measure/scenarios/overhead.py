"""The engine's host overhead per iteration: wall time of the scheduler's iterations minus the time
spent inside the model engines' calls, on the demo pair (or a bundle), greedy, γ 4, at a batch size.

    python -m tools.measure overhead [--bundle DIR] [--batch 1] [--max-new-tokens 256] [--stop]
        [--proposer auto] [--repeats 5]

--stop gives every request stop strings that never match (what a chat client sends): their
matching cost then shows in the overhead. The engines' methods are wrapped with timers; everything
else an iteration does (planning, proposers, emitting, rollback) is the overhead. Iterations that
prefill do not count. Each repeat is one `generate` call over the batch, from what a fresh load knows.
"""

import time

import speccompile
from tools.measure.harness import interleaved
from tools.measure.options import Common, bundle
from tools.measure.record import Column, Measured, Spread, Table

COMMON = Common(bundle=True, max_new_tokens=256, repeats=5)
ENGINE_CALLS = ("forward", "forward_confident", "forward_sample", "verify", "verify_sample", "verify_tree", "move")
PROMPT = "def parse_args(argv):"
NEVER = ["\x00never\x00", "<|never|>"]  # stop strings that never match
COLUMNS = (Column("batch"), Column("stop_strings"), Column("iterations"), Column("tokens"),
           Column("wall_ms", "ms", 1, "wall"), Column("prefill_ms", "ms", 2, "prefill"),
           Column("overhead_ms_per_iteration", "ms", 4, "overhead per iteration"))


def add_options(parser) -> None:
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--proposer", default="auto")
    parser.add_argument("--stop", action="store_true", help="stop strings that never match")


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


def overhead_ms(steps: dict) -> float:
    """The loop's own work per counted iteration since `steps` was last reset."""
    return (steps["ms"] - steps["engine_ms"]) / max(1, steps["n"])


def reset(steps: dict) -> None:
    steps.update(n=0, ms=0.0, engine_ms=0.0)


def one_round(runtime, prompts: list[str], options: dict, steps: dict) -> dict:
    reset(steps)
    outs = runtime.generate(prompts, **options)
    return {"iterations": steps["n"], "tokens": sum(len(o.token_ids) for o in outs),
            "prefill_ms": max(o.stats.prefill_ms for o in outs), "overhead_ms": overhead_ms(steps)}


def run(args) -> Measured:
    runtime = speccompile.load(bundle(args))
    steps = counted_steps(runtime, timed_engines(runtime))
    prompts = [PROMPT + " " * i for i in range(args.batch)]
    options = dict(max_new_tokens=args.max_new_tokens, gamma=4, proposer=args.proposer)
    if args.stop:
        options["stop"] = NEVER
    runtime.generate(prompts, **{**options, "max_new_tokens": 16})  # warm-up
    [rounds] = interleaved({"overhead": lambda _: one_round(runtime, prompts, options, steps)}, args.repeats,
                           cold=[runtime]).values()
    runtime.close()
    row = {"batch": args.batch, "stop_strings": args.stop, "iterations": rounds[-1].value["iterations"],
           "tokens": rounds[-1].value["tokens"], "wall_ms": Spread.of(r.seconds * 1e3 for r in rounds),
           "prefill_ms": Spread.of(r.value["prefill_ms"] for r in rounds),
           "overhead_ms_per_iteration": Spread.of(r.value["overhead_ms"] for r in rounds)}
    return Measured((Table.of("overhead", COLUMNS, [row]),), {"rounds": [r.value for r in rounds]})
