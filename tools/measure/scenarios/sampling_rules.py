"""The coupled rule against rejection sampling on the demo pair: acceptance, mean acceptance length
and speed over plain sampling, at temperatures 0.7 and 1.0 (batch 1, held-out prompts, seeded).

    python -m tools.measure sampling_rules [--bundle DIR] [--prompts 12] [--max-new-tokens 64]
        [--repeats 3] [--proposer draft] [--gamma 4]

Per temperature and repeat, interleaved on the same prompts and seeds (new seeds each repeat): plain
sampling (the target alone), then speculative sampling under each rule, each run cold. Speed is
tokens per second over the repeat's prompts, each rule's over the same repeat's plain rate, median
over repeats; acceptance is pooled over the repeats.
"""

from tools.measure.harness import interleaved
from tools.measure.options import Common, bundle
from tools.measure.prompts import workload
from tools.measure.record import Column, Measured, Spread, Table

COMMON = Common(bundle=True, prompts=12, max_new_tokens=64, repeats=3)
RULES = ("coupled", "rejection")
TEMPERATURES = (0.7, 1.0)
COLUMNS = (Column("temperature", digits=1), Column("rule"), Column("speedup", "×", 3),
           Column("acceptance_rate", digits=3, label="acceptance"), Column("mean_acceptance_length", digits=3))


def add_options(parser) -> None:
    parser.add_argument("--proposer", default="draft")
    parser.add_argument("--gamma", default="4", help="a compiled γ, or auto")


def generate_each(runtime, prompts: list[str], seed: int, **options) -> tuple[int, list]:
    """(tokens made, each result's stats), one prompt at a time, prompt i seeded seed + i."""
    results = [runtime.generate([p], seed=seed + i, **options)[0] for i, p in enumerate(prompts)]
    return sum(len(r.token_ids) for r in results), [r.stats for r in results]


def at_temperature(runtime, prompts: list[str], temperature: float, args) -> list[dict]:
    from speccompile.core.stats import pooled

    gamma = args.gamma if args.gamma == "auto" else int(args.gamma)
    options = dict(max_new_tokens=args.max_new_tokens, temperature=temperature)
    variants = {"plain": lambda repeat: generate_each(runtime, prompts, 1000 * repeat, mode="autoregressive",
                                                      **options)}
    variants |= {rule: lambda repeat, rule=rule: generate_each(runtime, prompts, 1000 * repeat, proposer=args.proposer,
                                                               gamma=gamma, sampling_rule=rule, **options)
                 for rule in RULES}
    samples = interleaved(variants, args.repeats, cold=[runtime])
    rates = {name: [s.value[0] / s.seconds for s in runs] for name, runs in samples.items()}
    rows = []
    for rule in RULES:
        stats = pooled([st for s in samples[rule] for st in s.value[1]])
        rows.append({"temperature": temperature, "rule": rule,
                     "speedup": Spread.of(r / p for r, p in zip(rates[rule], rates["plain"])),
                     "acceptance_rate": stats.acceptance_rate, "mean_acceptance_length": stats.mean_acceptance_length})
    return rows


def run(args) -> Measured:
    import speccompile

    runtime = speccompile.load(bundle(args))
    prompts = workload(args.prompts, "completion")
    runtime.generate(prompts[:1], max_new_tokens=8, temperature=1.0)  # warm-up
    rows = [row for t in TEMPERATURES for row in at_temperature(runtime, prompts, t, args)]
    runtime.close()
    title = f"proposer {args.proposer}, γ {args.gamma}, {len(prompts)} prompts"
    return Measured((Table.of("sampling_rules", COLUMNS, rows, title),))
