"""What matching stop strings costs per iteration, against the output's length: the edge's
incremental matcher (runtime/edge.py: each iteration's new tokens decoded alone and the stop strings
looked for in that text) against re-decoding the whole continuation every iteration (what the engine
thread did before the edge existed).

    python tools/measure_stop_strings.py [--bundle DIR] [--tokens 1000] [--per-iteration 4]

The tokens are the demo target's own greedy output for a held-out prompt (real text, so the decoder
sees real merges), fed in iterations of `--per-iteration` tokens with stop strings that never match.
Prints the median microseconds per iteration at several output lengths, for both.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import speccompile  # noqa: E402
from speccompile.runtime.edge import StopWatcher  # noqa: E402

STOPS = ["\nclass Never", "<|never|>"]
PROMPT = "def parse_args(argv):"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", default=None)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--per-iteration", type=int, default=4)
    args = parser.parse_args()
    if args.bundle is None:
        from speccompile.demo import demo_bundle

        args.bundle = demo_bundle()
    runtime = speccompile.load(args.bundle)
    tokenizer = runtime.tokenizer
    prompt = tokenizer.encode(PROMPT)
    output = runtime.generate([PROMPT], max_new_tokens=args.tokens)[0].token_ids
    runtime.close()
    step = args.per_iteration
    marks = [m for m in (100, 250, 500, 1000, 2000) if m <= len(output)]
    whole, incremental = {m: [] for m in marks}, {m: [] for m in marks}
    for _ in range(5):
        watcher, prompt_text = StopWatcher(tokenizer, prompt, STOPS), tokenizer.decode(prompt)
        for end in range(step, len(output) + 1, step):
            start = time.perf_counter()
            text = tokenizer.decode_continuation(prompt, output[:end], prompt_text)
            assert not any(s in text for s in STOPS)
            redecoded = time.perf_counter()
            assert watcher.feed(output[end - step : end]) is None
            fed = time.perf_counter()
            for mark in marks:
                if end - step < mark <= end:
                    whole[mark].append((redecoded - start) * 1e6)
                    incremental[mark].append((fed - redecoded) * 1e6)
    print(json.dumps({"tokens": len(output), "per_iteration": step, "us_per_iteration": {
        str(m): {"whole_text_redecoded": round(statistics.median(whole[m]), 1),
                 "incremental": round(statistics.median(incremental[m]), 1)} for m in marks}}, indent=1))


if __name__ == "__main__":
    main()
