"""The coupled rule against rejection sampling on the demo pair: acceptance, mean acceptance length
and speed over plain sampling, at temperatures 0.7 and 1.0 (batch 1, held-out prompts, seeded).

    python tools/measure_sampling_rules.py [--bundle DIR] [--prompts 12] [--max-new-tokens 64]
        [--rounds 3] [--proposer draft] [--gamma 4]

Per temperature and round, interleaved on the same prompts: plain sampling (the target alone), then
speculative sampling under each rule. Speed is tokens per second over the round's prompts, each
rule's over the same round's plain rate, median over rounds; acceptance is pooled over the rounds.
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
from speccompile.core.stats import pooled  # noqa: E402

RULES = ("coupled", "rejection")


def run(runtime, prompts, seed: int, **options) -> tuple[float, list]:
    start, tokens, stats = time.perf_counter(), 0, []
    for i, prompt in enumerate(prompts):
        [result] = runtime.generate([prompt], seed=seed + i, **options)
        tokens += len(result.token_ids)
        stats.append(result.stats)
    return tokens / (time.perf_counter() - start), stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", default=None)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--proposer", default="draft")
    parser.add_argument("--gamma", default="4")
    args = parser.parse_args()
    if args.bundle is None:
        from speccompile.demo import demo_bundle

        args.bundle = demo_bundle()
    gamma = args.gamma if args.gamma == "auto" else int(args.gamma)
    runtime = speccompile.load(args.bundle)
    prompts = workloads(heldout_functions(args.prompts))["completion"]
    runtime.generate(prompts[:1], max_new_tokens=8, temperature=1.0)  # warm-up
    report = {}
    for temperature in (0.7, 1.0):
        options = dict(max_new_tokens=args.max_new_tokens, temperature=temperature)
        ratios, stats = {rule: [] for rule in RULES}, {rule: [] for rule in RULES}
        for round_ in range(args.rounds):
            plain, _ = run(runtime, prompts, 1000 * round_, mode="autoregressive", **options)
            for rule in RULES:
                rate, round_stats = run(runtime, prompts, 1000 * round_, proposer=args.proposer, gamma=gamma,
                                        sampling_rule=rule, **options)
                ratios[rule].append(rate / plain)
                stats[rule] += round_stats
        report[str(temperature)] = {rule: {"speedup": round(statistics.median(ratios[rule]), 3),
                                           "acceptance_rate": round(pooled(stats[rule]).acceptance_rate, 3),
                                           "mean_acceptance_length": round(pooled(stats[rule]).mean_acceptance_length,
                                                                           3)}
                                    for rule in RULES}
    print(json.dumps({"proposer": args.proposer, "gamma": gamma, "prompts": len(prompts), **report}, indent=1))
    runtime.close()


if __name__ == "__main__":
    main()
