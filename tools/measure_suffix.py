"""Suffix decoding against prompt lookup where requests repeat structure: the same task over many
held-out functions, each request seen once, in order (so the suffix cache holds only earlier
requests' outputs, never the request's own).

    python tools/measure_suffix.py [--bundle DIR] [--prompts 40] [--max-new-tokens 64]
        [--workload grounded|completion] [--gamma 4]

Per prompt, in turn and interleaved: plain decoding, prompt lookup, suffix decoding, auto, and auto
without suffix decoding among its members (as it was before it joined), each greedy at batch 1 (their
tokens are the same). Suffix decoding and each auto run on their own runtime, so each has its own
cache of earlier outputs. Reports, over the first and the second half
of the prompts (a cold and a warm cache), the median per-prompt speedup over plain decoding, the
acceptance rate and the mean acceptance length, and drafts per proposer under auto.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from measure_proposers import heldout_functions, workloads  # noqa: E402

import speccompile  # noqa: E402
from speccompile.core.proposers.auto import Auto  # noqa: E402
from speccompile.core.proposers.suffix import SuffixDecoding  # noqa: E402
from speccompile.core.stats import pooled  # noqa: E402

RUNS = ("plain", "ngram", "suffix", "auto", "auto-without-suffix")


def timed(runtime, prompt: str, **options):
    start = time.perf_counter()
    [result] = runtime.generate([prompt], **options)
    return len(result.token_ids) / (time.perf_counter() - start), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", default=None, help="default: the embedded demo bundle")
    parser.add_argument("--prompts", type=int, default=40)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--workload", default="grounded", choices=["grounded", "completion", "editing"])
    parser.add_argument("--gamma", type=int, default=4)
    args = parser.parse_args()
    if args.bundle is None:
        from speccompile.demo import demo_bundle

        args.bundle = demo_bundle()
    runtimes = {run: speccompile.load(args.bundle) for run in ("plain", "suffix", "auto", "auto-without-suffix")}
    runtimes["ngram"] = runtimes["plain"]
    without = runtimes["auto-without-suffix"].proposers  # auto without suffix decoding
    with_suffix = runtimes["auto"].proposers  # auto with it, whatever the bundle's default
    if without.draft is not None:
        without.auto = lambda p_min: Auto([without.make("ngram"), without.make("draft", p_min)])
        with_suffix.auto = lambda p_min: Auto([with_suffix.make("ngram"), SuffixDecoding(with_suffix.suffix, False),
                                               with_suffix.make("draft", p_min)])
    else:
        without.auto = lambda p_min: without.make("ngram")
    prompts = workloads(heldout_functions(args.prompts))[args.workload]
    for run in RUNS:  # warm-up: sessions, caches (and nothing remembered: greedy outputs of another text)
        runtimes[run].generate(["import os\n"], max_new_tokens=8, mode="autoregressive")
    rows = []
    for prompt in prompts:
        row = {}
        for run in RUNS:
            options = {"mode": "autoregressive"} if run == "plain" else {"proposer": run.split("-")[0],
                                                                          "gamma": args.gamma}
            rate, result = timed(runtimes[run], prompt, max_new_tokens=args.max_new_tokens, **options)
            row[run] = (rate, result.stats, result.token_ids)
        assert len({tuple(tokens) for _, _, tokens in row.values()}) == 1, "greedy outputs differ"
        rows.append(row)
    half = len(rows) // 2
    report = {}
    for label, part in (("cold (first half)", rows[:half]), ("warm (second half)", rows[half:])):
        report[label] = {}
        for run in RUNS[1:]:
            stats = pooled([row[run][1] for row in part])
            report[label][run] = {
                "speedup": round(statistics.median(row[run][0] / row["plain"][0] for row in part), 3),
                "acceptance_rate": round(stats.acceptance_rate, 3),
                "mean_acceptance_length": round(stats.mean_acceptance_length, 3),
                "drafts_by_proposer": {name: counts[1] for name, counts in stats.by_proposer.items()}}
    print(json.dumps({"workload": args.workload, "prompts": len(rows), "max_new_tokens": args.max_new_tokens,
                      "gamma": args.gamma, **report}, indent=1))
    for runtime in {id(r): r for r in runtimes.values()}.values():
        runtime.close()


if __name__ == "__main__":
    main()
