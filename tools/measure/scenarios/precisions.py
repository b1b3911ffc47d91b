"""Speculative vs autoregressive decoding of real-size bundles of several target precisions, and what
each one's verification costs in decode steps.

    python -m tools.make_random_checkpoint --shape tinyllama-1.1b --residual-scale 0.001 --out /tmp/tl
    python -m tools.make_random_checkpoint --draft-of /tmp/tl --layers 2 --out /tmp/tl-draft
    for w in float32 int8 int4; do
        speccompile build --target /tmp/tl --draft /tmp/tl-draft --out /tmp/tl-$w --target-weights $w \\
            --gamma 4 --max-seq 512 --max-batch 4
    done
    python -m tools.measure precisions /tmp/tl-float32 /tmp/tl-int8 /tmp/tl-int4 [--gamma 4|auto]
        [--proposer draft|auto] [--rounds 1] [--max-new-tokens 64] [--repeats 3]

Per bundle, in one process each (the default `speccompile.load()`, as an application runs it):
the time from `load()` to the first generated token and the process's peak RSS; a target decode
step and a verification of γ+1 tokens back to back (`calibration.measure_costs`, medians, at
context 64; at γ=4 under --gamma auto); then `bench` with the draft model proposing at γ (or, with
`--gamma auto --proposer auto`, the default call: the proposer and γ the runtime picks, which may be
plain decoding where speculation does not pay): plain and speculative decoding, each request
`--max-new-tokens` long (past the end-of-sequence token, which a random model may draw early),
interleaved over the same held-out prompts (three functions of held-out standard-library files,
their first four lines each), with the loop's own step times, acceptance and the cost model's
prediction: of decoding alone, and of whole requests (prefill and the loop's overhead added,
cost_model.predicted_end_to_end_speedup), which is what the measured speedup times. The bundles
run one after the other, `--rounds` times, so that every precision sees the host in each of its
moods; each cell is the median over rounds.
"""

from pathlib import Path

from tools.measure.harness import in_fresh_process, interleaved
from tools.measure.options import Common, positive
from tools.measure.record import Column, Measured, Spread, Table

COMMON = Common(max_new_tokens=64, repeats=3)

ONE_BUNDLE = r"""
import json, sys, time
started = time.perf_counter()
import speccompile
from speccompile.core.params import GenerationParams
from speccompile.runtime.bench import bench_proposers
from speccompile.runtime.calibration import measure_costs
from tools.measure.prompts import heldout_functions, workloads
runtime = speccompile.load(sys.argv[1])
runtime.generate([[5, 17, 33, 2, 9, 100, 7, 12]], max_new_tokens=1)
first_token_s = time.perf_counter() - started
gamma = None if sys.argv[2] == "auto" else int(sys.argv[2])
tokens, repeats, proposer = int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
timed = gamma or 4
costs = measure_costs(runtime.target, runtime.draft, [timed], batch=1, context=64, repeats=5)
prompts = workloads(heldout_functions(3))["completion"]
params = GenerationParams(max_new_tokens=tokens, gamma=gamma, ignore_eos=True)  # every request the same length
[result] = bench_proposers(runtime, prompts, [proposer], params, repeats)
loop = {key: getattr(result.costs, key) for key in ("target_step_ms", "verify_ms", "draft_step_ms",
                                                   "predicted_end_to_end")}
import resource
print(json.dumps({"peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
                  "load_to_first_token_s": first_token_s, "session": runtime.target.session_source,
                  "step_ms": costs.target_step, "verify_ms": costs.verify[timed],
                  "draft_step_ms": costs.draft_step, "bench": {**result.to_json(), **loop}}))
"""


def columns(gamma: int | None) -> tuple[Column, ...]:
    gamma = gamma or 4  # the verification timed beside γ auto
    return (Column("bundle"), Column("load_to_first_token", "s", 1, "load → first token"),
            Column("peak_rss", "GB", 2), Column("step", "ms", 1, "decode step"),
            Column("verify", "ms", 1, f"verify {gamma + 1} tokens"), Column("verify_over_step", "×", 2, "ratio"),
            Column("ar_tokens_per_s", "tok/s", 1, "AR"), Column("spec_tokens_per_s", "tok/s", 1, "speculative"),
            Column("speedup", "×", 2), Column("predicted_speedup", "×", 2, "predicted (decoding)"),
            Column("predicted_end_to_end", "×", 2, "predicted (whole requests)"),
            Column("acceptance_rate", digits=2, label="acceptance"), Column("mean_acceptance_length", digits=2),
            Column("loop_step", "ms", 1, "loop: step"), Column("loop_verify", "ms", 1, "loop: verify"),
            Column("loop_draft", "ms", 1, "loop: draft"))


def add_options(parser) -> None:
    parser.add_argument("bundles", nargs="+", type=Path)
    parser.add_argument("--gamma", type=lambda v: None if v == "auto" else positive(v), default=4,
                        help="γ of the speculative runs, or auto (the runtime's choice, the default call's)")
    parser.add_argument("--proposer", default="draft", help="the speculative runs' proposer (auto: the default)")
    parser.add_argument("--rounds", type=positive, default=1, help="fresh processes per bundle, interleaved")


def one_bundle(path: Path, gamma: int | None, max_new_tokens: int, repeats: int, proposer: str) -> dict:
    """One fresh process (ONE_BUNDLE)."""
    return in_fresh_process(ONE_BUNDLE, path, "auto" if gamma is None else gamma, max_new_tokens, repeats, proposer)


def row(path: Path, runs: list[dict]) -> dict:
    def over_rounds(get) -> Spread:
        return Spread.of(get(r) for r in runs)

    bench = {key: over_rounds(lambda r, key=key: r["bench"][key])
             for key in ("ar_tokens_per_s", "spec_tokens_per_s", "speedup", "predicted_speedup", "acceptance_rate",
                         "mean_acceptance_length", "target_step_ms", "verify_ms", "draft_step_ms",
                         "predicted_end_to_end")}
    return {"bundle": path.name, "load_to_first_token": over_rounds(lambda r: r["load_to_first_token_s"]),
            "peak_rss": over_rounds(lambda r: r["peak_rss_gb"]), "step": over_rounds(lambda r: r["step_ms"]),
            "verify": over_rounds(lambda r: r["verify_ms"]),
            "verify_over_step": over_rounds(lambda r: r["verify_ms"] / r["step_ms"]),
            **{key: bench[key] for key in ("ar_tokens_per_s", "spec_tokens_per_s", "speedup", "predicted_speedup",
                                           "predicted_end_to_end", "acceptance_rate", "mean_acceptance_length")},
            "loop_step": bench["target_step_ms"], "loop_verify": bench["verify_ms"],
            "loop_draft": bench["draft_step_ms"]}


def run(args) -> Measured:
    variants = {str(path): (lambda _, p=path: one_bundle(p, args.gamma, args.max_new_tokens, args.repeats,
                                                         args.proposer))
                for path in args.bundles}
    samples = interleaved(variants, args.rounds)  # fresh processes: cold by construction
    runs = {path: [s.value for s in samples[str(path)]] for path in args.bundles}
    return Measured((Table.of("precisions", columns(args.gamma), [row(p, r) for p, r in runs.items()]),),
                    {"runs": {str(p): r for p, r in runs.items()}})
