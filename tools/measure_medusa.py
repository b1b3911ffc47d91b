"""Medusa chain vs Medusa trees vs the draft model, on held-out completion prompts, batch 1; then the
typical-acceptance trade-off.

    python tools/measure_medusa.py [--prompts 12] [--max-new-tokens 64] [--repeats 3] [--sizes 4,8,16,32]

Prompts: the `completion` workload of measure_proposers.py (the first 4 lines of held-out stdlib
functions). Bundles: the demo pair (draft model at its default γ=4: γ auto without a profile calibrates
quickly, and noisily) and the demo target with its Medusa heads.
Each repeat runs every variant through all prompts one at a time, in the same order, so that a slow
stretch of the machine hits them alike: plain decoding, the draft model, the Medusa chain (each
head's top candidate), Medusa trees of each size (grown from the heads' accuracies) and the tree the
runtime sizes itself by measured cost. Rates are medians over repeats; speedups are over the plain
runs of the same repeat set. Beside each Medusa row: the cost model's prediction, (1 + expected
accepted) / verification ms against the plain step's ms, from the heads' recorded accuracies.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from measure_proposers import heldout_functions, workloads  # noqa: E402

import speccompile  # noqa: E402
from speccompile.core.stats import pooled  # noqa: E402
from speccompile.core.tree import measured_paths  # noqa: E402
from speccompile.demo import demo_bundle, demo_medusa_bundle  # noqa: E402
from speccompile.runtime.bench import bench_acceptance  # noqa: E402


def run(runtime, prompts, max_new_tokens, **options):
    results = [runtime.generate([p], max_new_tokens=max_new_tokens, **options)[0] for p in prompts]
    rate = sum(r.stats.new_tokens for r in results) / (sum(r.stats.total_ms for r in results) / 1e3)
    return rate, [r.stats for r in results]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes", default="4,8,16,32", help="Medusa tree sizes (nodes, the root included)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    prompts = workloads(heldout_functions(args.prompts))["completion"]
    pair = speccompile.load(demo_bundle(), shared_threads=True)
    medusa = speccompile.load(demo_medusa_bundle(), shared_threads=True)
    accuracy = medusa.bundle.medusa["top_k_accuracy"]
    variants = {"autoregressive": (medusa, None, {"mode": "autoregressive"}),
                "draft model": (pair, None, {"proposer": "draft", "gamma": 4}),
                "medusa chain": (medusa, "chain", {})}
    variants |= {f"medusa tree {n}": (medusa, n, {}) for n in map(int, args.sizes.split(","))}
    variants["medusa tree (sized here)"] = (medusa, None, {})
    trees = {}  # the tree each Medusa variant runs
    for name, (runtime, tree, options) in variants.items():  # warm-up: sessions, calibration, the sized tree
        if runtime is medusa:
            medusa.set_tree(tree)
        run(runtime, prompts[:1], 8, **options)
        if runtime is medusa and name != "autoregressive":
            trees[name] = medusa.proposers.tree.tree
    rates, stats = {name: [] for name in variants}, {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, (runtime, _, options) in variants.items():
            if name in trees:
                medusa.set_tree(trees[name])
            rate, run_stats = run(runtime, prompts, args.max_new_tokens, **options)
            rates[name].append(rate)
            stats[name] += run_stats
    ar = pooled(stats["autoregressive"])
    step_ms = ar.decode_ms / ar.iterations
    rows = []
    for name in variants:
        s = pooled(stats[name])
        row = {"variant": name, "tokens_per_s": statistics.median(rates[name]),
               "speedup": statistics.median(rates[name]) / statistics.median(rates["autoregressive"]),
               "acceptance_rate": s.acceptance_rate, "mean_acceptance_length": s.mean_acceptance_length,
               "verify_ms": s.verify_ms / max(1, s.iterations), "draft_ms": s.draft_ms / max(1, s.iterations)}
        if name in trees:
            expected = trees[name].expected_accepted(accuracy, measured_paths(medusa.bundle.medusa["path_probability"]))
            row |= {"tree_nodes": trees[name].size, "tree_depth": trees[name].max_depth,
                    "expected_acceptance_length": 1 + expected,
                    "predicted_speedup": (1 + expected) / row["verify_ms"] * step_ms}
        rows.append(row)
    sized = trees["medusa tree (sized here)"]
    medusa.set_tree(sized)
    trade_off = bench_acceptance(medusa, prompts, ["exact", "typical"], args.max_new_tokens, args.repeats)
    report = {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
              "plain_step_ms": step_ms, "sized_tree": sized.to_json(), "tree_sizing": medusa.tree_sizing.record,
              "rows": rows, "acceptance": trade_off}
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(f"plain decoding: {rows[0]['tokens_per_s']:.1f} tok/s, {step_ms:.2f} ms per step")
    print("| variant | tok/s | speedup | acceptance | mean accepted length | verify ms | nodes | predicted |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows[1:]:
        nodes = r.get("tree_nodes", "")
        predicted = f"{r['predicted_speedup']:.2f}x" if "predicted_speedup" in r else ""
        print(f"| {r['variant']} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | {r['acceptance_rate']:.2f} | "
              f"{r['mean_acceptance_length']:.2f} | {r['verify_ms']:.2f} | {nodes} | {predicted} |")
    print("\n| acceptance | speedup | mean accepted length | token agreement | identical outputs | perplexity |")
    print("|---|---|---|---|---|---|")
    for r in trade_off:
        print(f"| {r['acceptance']} | {r['speedup']:.2f}x | {r['mean_acceptance_length']:.2f} | "
              f"{r['token_agreement']:.3f} | {r['identical_outputs']:.2f} | {r['perplexity']:.2f} |")
    print(f"(the exact output's perplexity: {trade_off[0]['exact_perplexity']:.2f})")


if __name__ == "__main__":
    main()
