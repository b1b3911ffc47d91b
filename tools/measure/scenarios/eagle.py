"""The demo's EAGLE-3 head against its draft model and its Medusa heads, at batch 1 and batch 8, on
held-out completion prompts.

    python -m tools.measure eagle [--prompts 16] [--max-new-tokens 64] [--repeats 3] [--batches 1,8]

Prompts: the `completion` workload of the `proposers` scenario (the first 4 lines of held-out stdlib
functions). Bundles: the demo bundle (target, draft model and EAGLE-3 head), the same pair
without the head (demo_bundle(head=False): what carrying the head costs plain decoding, the draft
model and the default call), and the demo target with its Medusa heads. Variants:
plain decoding; the draft model at γ=4; the head's chain at γ=4 and at γ auto; proposer eagle_tree
(EAGLE-2 trees of the default TreeShape, sized at the loop's costs, or the chain where that measured
faster; trees for a request alone only); the default call
(proposer auto, γ auto: whatever `generate` does with no options); and the Medusa tree the runtime
sizes. At batch 1 each prompt runs alone; at batch 8 the prompts run as one `generate` call of 8
at a time. Each repeat runs every variant in the same order (interleaved), each after its runtimes
forgot what earlier runs taught them; rates are medians over repeats, speedups over the plain runs
of the same bundle (two runtimes in one process can differ by up to about 10% whatever their code:
a ratio across bundles would carry that). Beside each: acceptance, mean acceptance length, the draft/verify split per
iteration, and the cost model's prediction from the load's calibrated costs and the acceptance
measured (draft model and head at a fixed γ).
"""

import statistics
import time
from functools import partial

import speccompile
from tools.measure.harness import interleaved
from tools.measure.options import Common
from tools.measure.prompts import workload
from tools.measure.record import Column, Measured, Table

COMMON = Common(prompts=16, max_new_tokens=64, repeats=3)
COLUMNS = (Column("batch"), Column("variant"), Column("tokens_per_s", "tok/s", 1), Column("speedup", "×", 2),
           Column("acceptance_rate", digits=2, label="acceptance"),
           Column("mean_acceptance_length", digits=2, label="mean acceptance length"),
           Column("draft_ms", "ms", 2, "draft / iteration"), Column("verify_ms", "ms", 2, "verify / iteration"),
           Column("predicted_speedup", "×", 2, "predicted"))
# name -> (bundle: "pair", "no_head" or "medusa", generate's options, the γ and step kind the cost model
# prices it at); each bundle's first variant is its plain decoding, the baseline of its speedups
VARIANTS = {
    "autoregressive": ("pair", {"mode": "autoregressive"}, None),
    "autoregressive, pair without the head": ("no_head", {"mode": "autoregressive"}, None),
    "draft model, γ=4": ("pair", {"proposer": "draft", "gamma": 4}, (4, "draft")),
    "draft model, γ=4, pair without the head": ("no_head", {"proposer": "draft", "gamma": 4}, (4, "draft")),
    "EAGLE-3 chain, γ=4": ("pair", {"proposer": "eagle", "gamma": 4}, (4, "eagle")),
    "EAGLE-3 chain, γ auto": ("pair", {"proposer": "eagle"}, None),
    "EAGLE-2 tree over the head (batch 1; a chain, γ auto, in a batch)": ("pair", {"proposer": "eagle_tree"}, None),
    "default (auto, γ auto)": ("pair", {}, None),
    "default (auto, γ auto), pair without the head": ("no_head", {}, None),
    "autoregressive, Medusa bundle": ("medusa", {"mode": "autoregressive"}, None),
    "Medusa tree (sized)": ("medusa", {}, None),
}


def add_options(parser) -> None:
    parser.add_argument("--batches", default="1,8", help="batch sizes: 1 runs prompts alone, B in calls of B")


def generate_in_batches(runtime, prompts, batch: int, max_new_tokens: int, **options) -> tuple[float, list]:
    """(tokens/s of wall time, each result's stats): the prompts in calls of `batch` at a time."""
    began, results = time.perf_counter(), []
    for start in range(0, len(prompts), batch):
        results += runtime.generate(prompts[start : start + batch], max_new_tokens=max_new_tokens, **options)
    seconds = time.perf_counter() - began
    return sum(r.stats.new_tokens for r in results) / seconds, [r.stats for r in results]


def predicted(runtime, batch: int, stats, priced) -> float | None:
    """The cost model's speedup at this batch from the load's calibrated costs and the acceptance
    measured, for a fixed γ; None where it does not apply (plain decoding, γ auto, trees)."""
    from speccompile.core.cost_model import tokens_per_ms

    calibration = runtime.policies.calibration
    if priced is None or calibration is None:
        return None
    gamma, steps = priced
    costs = calibration.at_batch(batch)
    return tokens_per_ms(costs, stats.acceptance_by_position[:gamma], gamma, steps) * costs.plain_ms


def row(batch: int, name: str, rates: list[float], stats, plain: float, prediction) -> dict:
    iterations = max(1, stats.iterations)
    return {"batch": batch, "variant": name, "tokens_per_s": statistics.median(rates),
            "speedup": statistics.median(rates) / plain, "acceptance_rate": stats.acceptance_rate,
            "mean_acceptance_length": stats.mean_acceptance_length, "draft_ms": stats.draft_ms / iterations,
            "verify_ms": stats.verify_ms / iterations, "predicted_speedup": prediction}


def run(args) -> Measured:
    from speccompile.core.stats import pooled
    from speccompile.demo import demo_bundle, demo_medusa_bundle

    prompts = workload(args.prompts, "completion")
    runtimes = {"pair": speccompile.load(demo_bundle(), shared_threads=True),
                "no_head": speccompile.load(demo_bundle(head=False), shared_threads=True),
                "medusa": speccompile.load(demo_medusa_bundle(), shared_threads=True)}
    if not runtimes["pair"].bundle.has_eagle:
        raise SystemExit("the demo bundle has no EAGLE-3 head (speccompile/demo/eagle)")
    batches = [int(b) for b in args.batches.split(",")]
    calls = {(batch, name): (runtimes[bundle], options) for batch in batches
             for name, (bundle, options, _) in VARIANTS.items()}
    for runtime, options in calls.values():  # sessions, calibration, the sized tree: before any timing
        runtime.generate(prompts[:2], max_new_tokens=8, **options)

    def measured(key, _repeat: int):
        runtime, options = calls[key]
        return generate_in_batches(runtime, prompts, key[0], args.max_new_tokens, **options)

    samples = interleaved({key: partial(measured, key) for key in calls}, args.repeats, cold=runtimes.values())
    rows = []
    plain_variant = {}  # bundle -> the name of its plain decoding
    for name, (bundle, _, _) in VARIANTS.items():
        plain_variant.setdefault(bundle, name)
    for batch in batches:
        plain = {bundle: statistics.median(s.value[0] for s in samples[batch, name])
                 for bundle, name in plain_variant.items()}
        for name, (bundle, _, priced) in VARIANTS.items():
            stats = pooled([st for s in samples[batch, name] for st in s.value[1]])
            rates = [s.value[0] for s in samples[batch, name]]
            rows.append(row(batch, name, rates, stats, plain[bundle],
                            predicted(runtimes[bundle], batch, stats, priced)))
    calibration = runtimes["pair"].policies.calibration
    details = {"prompts": len(prompts), "calibration": calibration.timings() if calibration else None,
               "eagle": runtimes["pair"].bundle.model("eagle").to_json()}
    for runtime in runtimes.values():
        runtime.close()
    return Measured((Table.of("eagle", COLUMNS, rows, "EAGLE-3 against the draft model and Medusa heads"),), details)
