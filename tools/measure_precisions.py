"""Speculative vs autoregressive decoding of real-size bundles of several target precisions, and what
each one's verification costs in decode steps.

    python tools/make_random_checkpoint.py --shape tinyllama-1.1b --residual-scale 0.001 --out /tmp/tl
    python tools/make_random_checkpoint.py --draft-of /tmp/tl --layers 2 --out /tmp/tl-draft
    for w in float32 int8 int4; do
        speccompile build --target /tmp/tl --draft /tmp/tl-draft --out /tmp/tl-$w --target-weights $w \\
            --gamma 4 --max-seq 512 --max-batch 4
    done
    python tools/measure_precisions.py /tmp/tl-float32 /tmp/tl-int8 /tmp/tl-int4

Per bundle, in one process each (the default `speccompile.load()`, as an application runs it):
the time from `load()` to the first generated token and the process's peak RSS; a target decode
step and a verification of γ+1 tokens back to back (`calibration.measure_costs`, medians, at
context 64); then `bench` with the draft model proposing at γ: plain and speculative decoding
interleaved over the same held-out prompts (three functions of held-out standard-library files,
their first four lines each), with the loop's own step times, acceptance and the cost model's
prediction. The bundles run one after the other, `--rounds` times, so that every precision sees
the host in each of its moods.
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ONE_BUNDLE = r"""
import json, sys, time
started = time.perf_counter()
import speccompile
from speccompile.runtime.bench import bench_proposers
from speccompile.runtime.calibration import measure_costs
sys.path.insert(0, sys.argv[2])
from measure_proposers import heldout_functions, workloads
runtime = speccompile.load(sys.argv[1])
runtime.generate([[5, 17, 33, 2, 9, 100, 7, 12]], max_new_tokens=1)
first_token_s = time.perf_counter() - started
gamma, tokens, repeats = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
costs = measure_costs(runtime.target, runtime.draft, [gamma], batch=1, context=64, repeats=5)
prompts = workloads(heldout_functions(3))["completion"]
[(summary, details)] = bench_proposers(runtime, prompts, ["draft"], tokens, repeats, gamma)
loop = {key: details[key] for key in ("target_step_ms", "verify_ms", "draft_step_ms")}
import resource
print(json.dumps({"peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
                  "load_to_first_token_s": first_token_s, "session": runtime.target.session_source,
                  "step_ms": costs.target_step, "verify_ms": costs.verify[gamma],
                  "draft_step_ms": costs.draft_step, "bench": {**summary, **loop}}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundles", nargs="+", type=Path)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    tools = str(Path(__file__).resolve().parent)
    runs = {bundle: [] for bundle in args.bundles}
    for _ in range(args.rounds):
        for bundle in args.bundles:
            out = subprocess.run([sys.executable, "-c", ONE_BUNDLE, str(bundle), tools, str(args.gamma),
                                  str(args.max_new_tokens), str(args.repeats)], capture_output=True, text=True,
                                 check=True).stdout
            runs[bundle].append(json.loads(out.splitlines()[-1]))
            print(json.dumps({"bundle": str(bundle), **runs[bundle][-1]}), flush=True)
    print(f"\n| bundle | load → first token | decode step | verify {args.gamma + 1} tokens | ratio | AR tok/s | "
          "speculative tok/s | speedup | predicted | acceptance | mean acceptance length | "
          "loop: step / verify / draft |")
    print("| --- " * 12 + "|")
    for bundle, rows in runs.items():
        print(_row(bundle, rows))


def _row(bundle: Path, rows: list[dict]) -> str:
    def median(get):
        return statistics.median(get(r) for r in rows)

    def bench(key):
        return median(lambda r: r["bench"][key])

    step, verify = median(lambda r: r["step_ms"]), median(lambda r: r["verify_ms"])
    return (f"| {bundle.name} | {median(lambda r: r['load_to_first_token_s']):.1f} s | {step:.1f} ms | "
            f"{verify:.1f} ms | {verify / step:.2f} | {bench('ar_tokens_per_s'):.1f} | "
            f"{bench('spec_tokens_per_s'):.1f} | "
            f"{bench('speedup'):.2f}× | {bench('predicted_speedup'):.2f}× | {bench('acceptance_rate'):.2f} | "
            f"{bench('mean_acceptance_length'):.2f} | {bench('target_step_ms'):.1f} / {bench('verify_ms'):.1f} / "
            f"{bench('draft_step_ms'):.1f} ms |")


if __name__ == "__main__":
    main()
