"""How long a joining request's prefill stalls the requests already decoding, by prefill chunk.

    python tools/measure_prefill_stall.py [--bundle DIR] [--prompt-tokens 700] [--chunks 64,128,100000]

One request decodes (demo pair, γ=4); after its 20th iteration a second request with a long prompt
joins. Printed per chunk size: the first request's median gap between iterations before the join,
its largest gap while the second is prefilled, and the second's time to first token.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import speccompile  # noqa: E402
from speccompile.runtime.edge import emitted_at  # noqa: E402


def stall(bundle, chunk: int, prompt_tokens: int) -> tuple[float, float, float]:
    """(median gap before the join, largest gap during it, joiner's TTFT), in ms."""
    runtime = speccompile.load(bundle, shared_threads=True, prefill_chunk=chunk)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", help="default: the demo bundle")
    parser.add_argument("--prompt-tokens", type=int, default=700)
    parser.add_argument("--chunks", default="64,128,100000")
    args = parser.parse_args()
    if args.bundle:
        bundle = args.bundle
    else:
        from speccompile.demo import demo_bundle

        bundle = demo_bundle()
    for chunk in map(int, args.chunks.split(",")):
        median, largest, ttft = stall(bundle, chunk, args.prompt_tokens)
        print(f"prefill_chunk {chunk}: iterations {median:.1f} ms apart before the join, the longest "
              f"{largest:.1f} ms while a {args.prompt_tokens}-token prompt joins; "
              f"its time to first token {ttft:.0f} ms")


if __name__ == "__main__":
    main()
