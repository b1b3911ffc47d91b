"""How long a joining request's prefill stalls the requests already decoding, by prefill chunk.

    python -m tools.measure prefill_stall [--bundle DIR] [--prompt-tokens 700] [--chunks 64,128,100000]
        [--repeats 1]

One request decodes (demo pair, γ=4); after its 20th iteration a second request with a long prompt
joins. Per chunk size: the first request's median gap between iterations before the join, its
largest gap while the second is prefilled, and the second's time to first token. Each repeat loads
a fresh runtime per chunk size, the chunk sizes taking turns.
"""

import statistics
import time

from tools.measure.harness import interleaved
from tools.measure.options import Common, bundle
from tools.measure.record import Column, Measured, Spread, Table

COMMON = Common(bundle=True, repeats=1)
COLUMNS = (Column("prefill_chunk", "tokens"), Column("gap_before_ms", "ms", 1, "iterations apart before the join"),
           Column("longest_gap_ms", "ms", 1, "longest gap while it joins"),
           Column("joiner_ttft_ms", "ms", 0, "joiner's time to first token"))


def add_options(parser) -> None:
    parser.add_argument("--prompt-tokens", type=int, default=700)
    parser.add_argument("--chunks", default="64,128,100000")


def stall(path, chunk: int, prompt_tokens: int) -> tuple[float, float, float]:
    """(median gap before the join, largest gap during it, joiner's TTFT), in ms."""
    import speccompile
    from speccompile.runtime.edge import emitted_at

    runtime = speccompile.load(path, shared_threads=True, prefill_chunk=chunk)
    runtime.generate(["def f(x):", "import os"], max_new_tokens=8, gamma=4)  # loads the batched graphs too
    stamps = []
    first = runtime.submit("def parse_args(argv):", max_new_tokens=runtime.max_seq - 64, gamma=4,
                           on_tokens=lambda ids: stamps.append(emitted_at()))  # the engine's time
    while len(stamps) < 20:
        time.sleep(0.001)
    joined = time.perf_counter()
    second = runtime.submit(list(range(100, 100 + prompt_tokens)), max_new_tokens=4, gamma=4)
    ttft = second.result().stats.ttft_ms
    assert not first.done, "the first request ended before the second joined: ask for a longer one"
    first.cancel()
    runtime.close()
    gaps = [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])]
    before = [g for a, g in zip(stamps, gaps) if a < joined]
    during = [g for a, g in zip(stamps, gaps) if joined <= a <= joined + ttft / 1e3]
    return statistics.median(before), max(during), ttft


def run(args) -> Measured:
    path, chunks = bundle(args), [int(c) for c in args.chunks.split(",")]
    samples = interleaved({str(c): lambda _, c=c: stall(path, c, args.prompt_tokens) for c in chunks}, args.repeats)
    rows = [{"prefill_chunk": c, **{key: Spread.of(s.value[i] for s in samples[str(c)])
                                    for i, key in enumerate(("gap_before_ms", "longest_gap_ms", "joiner_ttft_ms"))}}
            for c in chunks]
    return Measured((Table.of("prefill_stall", COLUMNS, rows, f"a {args.prompt_tokens}-token prompt joins"),))
