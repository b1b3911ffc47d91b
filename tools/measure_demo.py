"""Measure the demo pair: held-out acceptance, step-time ratio, speed, sampling acceptance.

    python tools/measure_demo.py [--bundle DIR] [--out measurements.json]

Prompts are the first lines of held-out standard-library files (never seen in training): each
prompt is a file's first `--prompt-lines` non-empty lines. Everything runs on ONNX Runtime, CPU.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import speccompile  # noqa: E402
from speccompile.corpus import read_texts, stdlib_split  # noqa: E402
from speccompile.runtime.bench import bench  # noqa: E402
from speccompile.runtime.calibration import measure_costs  # noqa: E402


def heldout_prompts(count: int, lines: int, from_code: bool = False) -> list[str]:
    """`lines` non-empty lines of held-out files: from each file's start, or (from_code) from its
    first line that starts a top-level def or class (skipping licence headers and docstrings)."""
    _, heldout = stdlib_split()
    prompts = []
    for text in read_texts(heldout):
        body = [line for line in text.splitlines() if line.strip()]
        if from_code:
            starts = [i for i, line in enumerate(body) if line.startswith(("def ", "class "))]
            body = body[starts[0]:] if starts else []
        body = body[:lines]
        if len(body) == lines:
            prompts.append("\n".join(body) + "\n")
        if len(prompts) == count:
            break
    return prompts


def acceptance(runtime, prompts, gamma, max_new_tokens, **sampling) -> dict:
    drafted = accepted = iterations = 0
    by_position = [0] * gamma
    for i, prompt in enumerate(prompts):
        [r] = runtime.generate([prompt], max_new_tokens=max_new_tokens, gamma=gamma, seed=i, **sampling)
        drafted += r.stats.draft_tokens
        accepted += r.stats.accepted_tokens
        iterations += r.stats.iterations
        by_position = [a + b for a, b in zip(by_position, r.stats.accepted_at)]
    return {"acceptance_rate": accepted / drafted, "mean_accepted_drafts": accepted / iterations,
            "acceptance_by_position": [n / iterations for n in by_position], "prompts": len(prompts)}


def step_times(runtime, contexts=(64, 128, 256), rounds: int = 3) -> dict:
    """Target step, draft step and γ=4 verification (ms) per context: medians over `rounds` rounds of
    `measure_costs` (each a median of 20 calls), so that one slow stretch of the machine moves one
    round, not the result."""
    engines = runtime.target, runtime.draft, runtime.gammas
    measured = [[measure_costs(*engines, batch=1, context=c, repeats=20) for c in contexts] for _ in range(rounds)]
    by_context = {}
    for i, context in enumerate(contexts):
        target = statistics.median(r[i].target_step for r in measured)
        draft = statistics.median(r[i].draft_step for r in measured)
        verify = statistics.median(r[i].verify[4] for r in measured)
        by_context[context] = {"target": target, "draft": draft, "draft_to_target_ratio": draft / target,
                               "verify_gamma4": verify}
    return {"by_context": by_context,
            "draft_to_target_ratio_mean": statistics.mean(c["draft_to_target_ratio"] for c in by_context.values())}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", default=None, help="default: the embedded demo bundle")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--prompt-lines", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    runtime = speccompile.load(args.bundle, shared_threads=True)  # as the CLI runs it
    prompts = heldout_prompts(args.prompts, args.prompt_lines)
    code_prompts = heldout_prompts(args.prompts, args.prompt_lines, from_code=True)
    results = {"greedy_gamma4": acceptance(runtime, prompts, 4, args.max_new_tokens),
               "greedy_gamma4_code_prompts": acceptance(runtime, code_prompts, 4, args.max_new_tokens)}
    for t in (0.7, 1.0):
        results[f"temperature_{t}_gamma4"] = acceptance(runtime, prompts, 4, args.max_new_tokens, temperature=t)
    results["step_ms"] = step_times(runtime)
    summary, details = bench(runtime, prompts[:8], max_new_tokens=args.max_new_tokens, repeats=3, gamma=4)
    costs = ("target_step_ms", "draft_step_ms", "verify_ms", "overhead_ms_per_iteration")
    results["bench_gamma4_batch1"] = {**summary, **{k: details[k] for k in costs}}
    text = json.dumps(results, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
