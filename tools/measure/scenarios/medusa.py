"""Medusa chain vs Medusa trees vs the draft model, on held-out completion prompts, batch 1; then the
typical-acceptance trade-off.

    python -m tools.measure medusa [--prompts 12] [--max-new-tokens 64] [--repeats 3] [--sizes 4,8,16,32]

Prompts: the `completion` workload of the `proposers` scenario (the first 4 lines of held-out stdlib
functions). Bundles: the demo pair (draft model at its default γ=4: γ auto without a profile
calibrates quickly, and noisily) and the demo target with its Medusa heads.
Each repeat runs every variant through all prompts one at a time, in the same order, so that a slow
stretch of the machine hits them alike: plain decoding, the draft model, the Medusa chain (each
head's top candidate), Medusa trees of each size (grown from the heads' accuracies) and the tree the
runtime sizes itself by measured cost. Rates are medians over repeats; speedups are over the plain
runs of the same repeat set. Beside each Medusa row: the cost model's prediction, (1 + expected
accepted) / verification ms against the plain step's ms, from the heads' recorded accuracies.
The second table: `bench --acceptance exact --acceptance typical` on the sized tree.
"""

import statistics
from functools import partial

import speccompile
from tools.measure.harness import interleaved
from tools.measure.options import Common
from tools.measure.prompts import workload
from tools.measure.record import Column, Measured, Table

COMMON = Common(prompts=12, max_new_tokens=64, repeats=3)
VARIANT_COLUMNS = (Column("variant"), Column("tokens_per_s", "tok/s", 1), Column("speedup", "×", 2),
                   Column("acceptance_rate", digits=2, label="acceptance"), Column("mean_acceptance_length", digits=2),
                   Column("verify_ms", "ms", 2, "verify"), Column("draft_ms", "ms", 2, "draft"),
                   Column("tree_nodes", label="nodes"), Column("tree_depth", label="depth"),
                   Column("expected_acceptance_length", digits=2), Column("predicted_speedup", "×", 2, "predicted"))
ACCEPTANCE_COLUMNS = (Column("acceptance"), Column("speedup", "×", 2), Column("mean_acceptance_length", digits=2),
                      Column("token_agreement", digits=3), Column("identical_outputs", digits=2),
                      Column("perplexity", digits=2), Column("exact_perplexity", digits=2))


def add_options(parser) -> None:
    parser.add_argument("--sizes", default="4,8,16,32", help="Medusa tree sizes (nodes, the root included)")


def generate_each(runtime, prompts, max_new_tokens, **options) -> tuple[float, list]:
    """(tokens/s by the engine's clocks, each result's stats), one prompt at a time."""
    results = [runtime.generate([p], max_new_tokens=max_new_tokens, **options)[0] for p in prompts]
    rate = sum(r.stats.new_tokens for r in results) / (sum(r.stats.total_ms for r in results) / 1e3)
    return rate, [r.stats for r in results]


def variants_of(pair, medusa, sizes: str) -> dict:
    """name -> (runtime, tree to set or None, generate's options)."""
    variants = {"autoregressive": (medusa, None, {"mode": "autoregressive"}),
                "draft model": (pair, None, {"proposer": "draft", "gamma": 4}),
                "medusa chain": (medusa, "chain", {})}
    variants |= {f"medusa tree {n}": (medusa, n, {}) for n in map(int, sizes.split(","))}
    variants["medusa tree (sized here)"] = (medusa, None, {})
    return variants


def warm_trees(medusa, variants: dict, prompts) -> dict:
    """Warm-up (sessions, calibration, the sized tree); returns the tree each Medusa variant runs."""
    trees = {}
    for name, (runtime, tree, options) in variants.items():
        if runtime is medusa:
            medusa.set_tree(tree)
        generate_each(runtime, prompts[:1], 8, **options)
        if runtime is medusa and name != "autoregressive":
            trees[name] = medusa.proposers.tree.tree
    return trees


def variant_row(name: str, rates: list[float], stats, plain_rate: float, tree, medusa, step_ms: float) -> dict:
    from speccompile.core.tree import measured_paths

    iterations = max(1, stats.iterations)
    row = {"variant": name, "tokens_per_s": statistics.median(rates), "speedup": statistics.median(rates) / plain_rate,
           "acceptance_rate": stats.acceptance_rate, "mean_acceptance_length": stats.mean_acceptance_length,
           "verify_ms": stats.verify_ms / iterations, "draft_ms": stats.draft_ms / iterations,
           "tree_nodes": None, "tree_depth": None, "expected_acceptance_length": None, "predicted_speedup": None}
    if tree is not None:
        accuracy, paths = medusa.bundle.medusa["top_k_accuracy"], medusa.bundle.medusa["path_probability"]
        expected = tree.expected_accepted(accuracy, measured_paths(paths))
        row |= {"tree_nodes": tree.size, "tree_depth": tree.max_depth, "expected_acceptance_length": 1 + expected,
                "predicted_speedup": (1 + expected) / row["verify_ms"] * step_ms}
    return row


def run(args) -> Measured:
    from speccompile.core.params import GenerationParams
    from speccompile.core.stats import pooled
    from speccompile.demo import demo_bundle, demo_medusa_bundle
    from speccompile.runtime.bench import bench_acceptance

    prompts = workload(args.prompts, "completion")
    pair = speccompile.load(demo_bundle(), shared_threads=True)
    medusa = speccompile.load(demo_medusa_bundle(), shared_threads=True)
    variants = variants_of(pair, medusa, args.sizes)
    trees = warm_trees(medusa, variants, prompts)

    def measured(name: str, _repeat: int):
        runtime, _, options = variants[name]
        if name in trees:
            medusa.set_tree(trees[name])
        return generate_each(runtime, prompts, args.max_new_tokens, **options)

    samples = interleaved({name: partial(measured, name) for name in variants}, args.repeats, cold=(pair, medusa))
    rates = {name: [s.value[0] for s in samples[name]] for name in variants}
    stats = {name: pooled([st for s in samples[name] for st in s.value[1]]) for name in variants}
    step_ms = stats["autoregressive"].decode_ms / stats["autoregressive"].iterations
    plain = statistics.median(rates["autoregressive"])
    rows = [variant_row(name, rates[name], stats[name], plain, trees.get(name), medusa, step_ms) for name in variants]
    sized = trees["medusa tree (sized here)"]
    medusa.set_tree(sized)
    trade_off = [row.to_json() for row in bench_acceptance(medusa, prompts, ["exact", "typical"],
                                                            GenerationParams(max_new_tokens=args.max_new_tokens),
                                                            args.repeats)]
    details = {"prompts": len(prompts), "plain_step_ms": step_ms, "sized_tree": sized.to_json(),
               "tree_sizing": medusa.tree_sizing.record, "acceptance": trade_off}
    pair.close()
    medusa.close()
    return Measured((Table.of("variants", VARIANT_COLUMNS, rows, "Medusa against the draft model"),
                     Table.of("acceptance", ACCEPTANCE_COLUMNS, [{c.name: r[c.name] for c in ACCEPTANCE_COLUMNS}
                                                                 for r in trade_off], "exact and typical acceptance")),
                     details)
