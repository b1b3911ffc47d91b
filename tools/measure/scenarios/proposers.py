"""Proposers on three workloads of held-out code: speedup, acceptance and mean accepted length each.

    python -m tools.measure proposers [--bundle DIR] [--prompts 12] [--max-new-tokens 64] [--repeats 3]
        [--gamma auto] [--proposers draft,ngram,auto]

Every prompt comes from a top-level function (6 to 16 lines) of a held-out standard-library file
(never seen in training), in one of three workloads (tools/measure/prompts.py: completion, editing,
grounded); with --prompts FILE, the file's prompts are the one workload. Per workload, `bench` runs
plain decoding and every proposer interleaved (same prompts, batch 1, medians over repeats, every
measured run cold). Beside it: how much the target's own greedy output repeats its prompt (the
share of generated tokens that complete a 3-gram that occurs in the prompt), which bounds what
prompt lookup can find there.
"""

from tools.measure.options import Common, bundle
from tools.measure.prompts import all_workloads
from tools.measure.record import Column, Measured, Table

COMMON = Common(bundle=True, prompts=12, max_new_tokens=64, repeats=3)
PROPOSERS = ["draft", "ngram", "auto"]
COLUMNS = (Column("workload"), Column("prompt_copy_rate", digits=2, label="copies"), Column("proposer"),
           Column("speedup", "×", 2), Column("acceptance_rate", digits=2, label="acceptance"),
           Column("mean_acceptance_length", digits=2, label="accept length"),
           Column("ar_tokens_per_s", "tok/s", 1, "AR"), Column("spec_tokens_per_s", "tok/s", 1, "speculative"),
           Column("drafts", label="drafts by proposer (share kept)"))


def add_options(parser) -> None:
    parser.add_argument("--gamma", default="auto", help="a compiled γ, or auto (the runtime's policy)")
    parser.add_argument("--proposers", default=",".join(PROPOSERS), help="a draft-free bundle: ngram")


def prompt_copy_rate(runtime, prompts: list[str], max_new_tokens: int) -> float:
    """Share of the target's greedy tokens that complete a 3-gram occurring in their prompt."""
    copied = total = 0
    for prompt, result in zip(prompts, runtime.generate(prompts, max_new_tokens=max_new_tokens, mode="autoregressive")):
        ids = runtime.tokenizer.encode(prompt)
        grams = {tuple(ids[i : i + 3]) for i in range(len(ids) - 2)}
        history = ids + result.token_ids
        for i in range(len(ids), len(history)):
            copied += tuple(history[i - 2 : i + 1]) in grams
            total += 1
    return copied / total


def drafts(by_proposer: dict) -> str:
    """Each proposer's drafts under the run, and the share of them kept."""
    return ", ".join(f"{name} {d.draft_tokens} ({d.acceptance_rate:.2f})" for name, d in by_proposer.items())


def run(args) -> Measured:
    import speccompile
    from speccompile.core.params import GenerationParams
    from speccompile.runtime.bench import bench_proposers

    runtime = speccompile.load(bundle(args), shared_threads=True)  # as the CLI runs it
    params = GenerationParams(max_new_tokens=args.max_new_tokens,
                              gamma=args.gamma if args.gamma == "auto" else int(args.gamma))
    rows, summaries = [], []
    for workload, prompts in all_workloads(args.prompts).items():
        copy = prompt_copy_rate(runtime, prompts, args.max_new_tokens)
        for result in bench_proposers(runtime, prompts, args.proposers.split(","), params, args.repeats):
            summaries.append({"workload": workload, **result.to_json()})
            rows.append({"workload": workload, "prompt_copy_rate": copy, "drafts": drafts(result.by_proposer),
                         **{c.name: getattr(result, c.name) for c in COLUMNS[2:-1]}})
    runtime.close()
    return Measured((Table.of("proposers", COLUMNS, rows),), {"bench": summaries})
