"""A burst of requests arriving at once: their times to first token and the burst's throughput, with
the waiting requests prefilled together (the scheduler's groups) and one request per call.

    python -m tools.measure burst [--bundle DIR] [--prompts 8|FILE] [--max-new-tokens 16] [--repeats 7]

Each repeat submits all the prompts at once (one `generate` call with the defaults: proposer auto, γ
auto), once with the scheduler's groups and once with grouping off (`GROUP_PADDING` below 0: every
request joins alone, as before groups), the two taking turns going first, each after the runtime
forgot what earlier runs taught it. One runtime serves both, so the only difference is how the
burst's prompts are prefilled. Rows: the time to first token over every request of every repeat
(median and p99), the burst's tokens/s (median over repeats, with the lowest and highest) and the
target's prefill calls per burst.
"""

import statistics

import numpy as np

import speccompile
import speccompile.core.scheduler as scheduler_module
from tools.measure.harness import interleaved
from tools.measure.options import Common, bundle
from tools.measure.prompts import demo_prompts
from tools.measure.record import Column, Measured, Spread, Table

COMMON = Common(bundle=True, prompts=8, max_new_tokens=16, repeats=7)
COLUMNS = (Column("prefill"), Column("ttft_p50_ms", "ms", 1, "TTFT p50"), Column("ttft_p99_ms", "ms", 1, "TTFT p99"),
           Column("tokens_per_s", "tok/s", 0, "throughput"), Column("prefill_calls", digits=1, label="prefill calls"))
VARIANTS = {"together (groups)": scheduler_module.GROUP_PADDING, "one request per call": -1.0}


def burst(runtime, prompts: list[str], max_new_tokens: int, padding: float, calls: list) -> tuple:
    """(each request's TTFT in ms, the burst's tokens/s, the target's multi-token calls): one burst."""
    scheduler_module.GROUP_PADDING = padding
    calls.clear()
    try:
        results = runtime.generate(prompts, max_new_tokens=max_new_tokens)
    finally:
        scheduler_module.GROUP_PADDING = VARIANTS["together (groups)"]
    return [r.stats.ttft_ms for r in results], sum(r.stats.new_tokens for r in results), len(calls)


def counting_prefill(runtime) -> list:
    """The target's calls of more than one token per row (prefill chunks), recorded as they run."""
    calls = []
    for name in ("forward", "forward_sample"):
        call = getattr(runtime.target, name)
        setattr(runtime.target, name, lambda tokens, *a, call=call, **kw:
                (tokens.shape[1] > 1 and calls.append(tokens.shape)) or call(tokens, *a, **kw))
    return calls


def run(args) -> Measured:
    prompts = args.prompts.pick(demo_prompts)
    runtime = speccompile.load(bundle(args))
    if len(prompts) > runtime.max_batch:
        prompts = prompts[: runtime.max_batch]  # one burst fills the slots at most: none waits for another's end
    runtime.generate(prompts, max_new_tokens=4)  # every batched graph loaded
    calls = counting_prefill(runtime)
    samples = interleaved({name: lambda _, padding=padding: burst(runtime, prompts, args.max_new_tokens, padding, calls)
                           for name, padding in VARIANTS.items()}, args.repeats, cold=[runtime], alternate=True)
    rows = []
    for name in VARIANTS:
        ttft = [ms for s in samples[name] for ms in s.value[0]]
        rows.append({"prefill": name, "ttft_p50_ms": statistics.median(ttft),
                     "ttft_p99_ms": float(np.percentile(ttft, 99)),
                     "tokens_per_s": Spread.of(s.value[1] / s.seconds for s in samples[name]),
                     "prefill_calls": statistics.median(s.value[2] for s in samples[name])})
    runtime.close()
    title = f"{len(prompts)} requests at once, {args.max_new_tokens} new tokens each"
    return Measured((Table.of("burst", COLUMNS, rows, title),), {"prompts": len(prompts)})
