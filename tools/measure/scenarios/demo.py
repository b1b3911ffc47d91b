"""The demo pair: held-out acceptance, step-time ratio, speed, sampling acceptance (its model card's figures).

    python -m tools.measure demo [--bundle DIR] [--prompts 24] [--prompt-lines 6] [--max-new-tokens 64]
        [--repeats 3] [--out FILE]

Prompts are the first lines of held-out standard-library files (never seen in training): each
prompt is a file's first `--prompt-lines` non-empty lines; the code prompts start at a file's first
top-level def or class. Acceptance at γ 4, greedy and sampled (seeded); the target's and draft's step
times by context (medians of 3 rounds of `measure_costs`); then `bench` at γ 4, batch 1, on 8 prompts.
Everything runs on ONNX Runtime, CPU.
"""

import statistics

import speccompile
from tools.measure.options import Common, bundle
from tools.measure.prompts import heldout_prompts
from tools.measure.record import Column, Measured, Table

COMMON = Common(bundle=True, prompts=24, max_new_tokens=64, repeats=3)
CONTEXTS = (64, 128, 256)
ACCEPTANCE_COLUMNS = (Column("setting"), Column("prompts"), Column("acceptance_rate", digits=3),
                      Column("mean_accepted_drafts", digits=2), Column("acceptance_by_position", digits=2))
STEP_COLUMNS = (Column("context", "tokens"), Column("target", "ms", 2, "target step"),
                Column("draft", "ms", 2, "draft step"),
                Column("draft_to_target_ratio", digits=3, label="draft / target"),
                Column("verify_gamma4", "ms", 2, "verify γ=4"))
BENCH_COLUMNS = (Column("ar_tokens_per_s", "tok/s", 1, "plain"), Column("spec_tokens_per_s", "tok/s", 1, "speculative"),
                 Column("speedup", "×", 2), Column("predicted_speedup", "×", 2, "predicted"),
                 Column("acceptance_rate", digits=2), Column("mean_acceptance_length", digits=2),
                 Column("target_step_ms", "ms", 2, "target step"), Column("draft_step_ms", "ms", 2, "draft step"),
                 Column("verify_ms", "ms", 2, "verify"), Column("overhead_ms_per_iteration", "ms", 2, "overhead"))


def add_options(parser) -> None:
    parser.add_argument("--prompt-lines", type=int, default=6)


def acceptance(runtime, prompts, gamma, max_new_tokens, **sampling) -> dict:
    drafted = accepted = iterations = 0
    by_position = [0] * gamma
    for i, prompt in enumerate(prompts):
        [r] = runtime.generate([prompt], max_new_tokens=max_new_tokens, gamma=gamma, seed=i, proposer="draft",
                               **sampling)
        drafted += r.stats.draft_tokens
        accepted += r.stats.accepted_tokens
        iterations += r.stats.iterations
        by_position = [a + b for a, b in zip(by_position, r.stats.accepted_at)]
    return {"acceptance_rate": accepted / drafted, "mean_accepted_drafts": accepted / iterations,
            "acceptance_by_position": [n / iterations for n in by_position], "prompts": len(prompts)}


def step_times(runtime, contexts=CONTEXTS, rounds: int = 3) -> dict:
    """Target step, draft step and γ=4 verification (ms) per context: medians over `rounds` rounds of
    `measure_costs` (each a median of 20 calls), so that one slow stretch of the machine moves one
    round, not the result."""
    from speccompile.runtime.calibration import measure_costs

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


def measure(runtime, args) -> dict:
    """The model card's measurements (its measurements.json: the record's details)."""
    from speccompile.core.params import GenerationParams
    from speccompile.runtime.bench import bench

    prompts = args.prompts.pick(lambda n: heldout_prompts(n, args.prompt_lines))
    code_prompts = args.prompts.pick(lambda n: heldout_prompts(n, args.prompt_lines, from_code=True))
    results = {"greedy_gamma4": acceptance(runtime, prompts, 4, args.max_new_tokens),
               "greedy_gamma4_code_prompts": acceptance(runtime, code_prompts, 4, args.max_new_tokens)}
    for t in (0.7, 1.0):
        results[f"temperature_{t}_gamma4"] = acceptance(runtime, prompts, 4, args.max_new_tokens, temperature=t)
    results["step_ms"] = step_times(runtime)
    params = GenerationParams(max_new_tokens=args.max_new_tokens, gamma=4, proposer="draft")
    result = bench(runtime, prompts[:8], params, args.repeats)
    costs = ("target_step_ms", "draft_step_ms", "verify_ms", "overhead_ms_per_iteration")
    results["bench_gamma4_batch1"] = {**result.to_json(), **{k: getattr(result.costs, k) for k in costs}}
    return results


def run(args) -> Measured:
    runtime = speccompile.load(bundle(args), shared_threads=True)  # as the CLI runs it
    results = measure(runtime, args)
    runtime.close()
    settings = {"greedy_gamma4": "greedy, γ=4", "greedy_gamma4_code_prompts": "greedy, γ=4, code prompts",
                "temperature_0.7_gamma4": "temperature 0.7, γ=4", "temperature_1.0_gamma4": "temperature 1.0, γ=4"}
    acceptance_rows = [{"setting": label, **{**results[key], "acceptance_by_position":
                                             tuple(results[key]["acceptance_by_position"])}}
                       for key, label in settings.items()]
    step_rows = [{"context": context, **times} for context, times in results["step_ms"]["by_context"].items()]
    bench_row = {c.name: results["bench_gamma4_batch1"][c.name] for c in BENCH_COLUMNS}
    return Measured((Table.of("acceptance", ACCEPTANCE_COLUMNS, acceptance_rows, "acceptance on held-out prompts"),
                     Table.of("steps", STEP_COLUMNS, step_rows, "step times, batch 1"),
                     Table.of("bench", BENCH_COLUMNS, [bench_row], "bench, γ=4, batch 1, 8 prompts")), results)
