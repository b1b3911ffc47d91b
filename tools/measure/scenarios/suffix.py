"""Suffix decoding against prompt lookup where requests repeat structure: the same task over many
held-out functions, each request seen once, in order (so the suffix cache holds only earlier
requests' outputs, never the request's own).

    python -m tools.measure suffix [--bundle DIR] [--prompts 40] [--max-new-tokens 64]
        [--workload grounded|completion|editing] [--gamma 4]

Per prompt, in turn and interleaved: plain decoding, prompt lookup, suffix decoding, auto, and auto
without suffix decoding among its members (as it was before it joined), each greedy at batch 1 (their
tokens are the same). Suffix decoding and each auto run on their own runtime, so each has its own
cache of earlier outputs, and none forgets between prompts: what they learn from earlier requests is
what is measured. Reported over the first and the second half of the prompts (a cold and a warm
cache): the median per-prompt speedup over plain decoding, the acceptance rate and the mean
acceptance length, and drafts per proposer.
"""

import statistics

from tools.measure.harness import interleaved
from tools.measure.options import Common, bundle
from tools.measure.prompts import workload
from tools.measure.record import Column, Measured, Table

COMMON = Common(bundle=True, prompts=40, max_new_tokens=64)
RUNS = ("plain", "ngram", "suffix", "auto", "auto-without-suffix")
COLUMNS = (Column("cache"), Column("run"), Column("speedup", "×", 3), Column("acceptance_rate", digits=3),
           Column("mean_acceptance_length", digits=3), Column("drafts", label="drafts by proposer"))


def add_options(parser) -> None:
    parser.add_argument("--workload", default="grounded", choices=["grounded", "completion", "editing"])
    parser.add_argument("--gamma", type=int, default=4)


def runtimes_for(path) -> dict:
    """One runtime per run that keeps a cache of its own (prompt lookup shares plain decoding's); auto
    with suffix decoding among its members whatever the bundle's default, and auto without it."""
    import speccompile
    from speccompile.core.proposers.auto import Auto
    from speccompile.core.proposers.suffix import SuffixDecoding

    runtimes = {run: speccompile.load(path) for run in ("plain", "suffix", "auto", "auto-without-suffix")}
    runtimes["ngram"] = runtimes["plain"]
    without, with_suffix = runtimes["auto-without-suffix"].proposers, runtimes["auto"].proposers
    if without.draft is not None:
        without.auto = lambda p_min: Auto([without.make("ngram"), without.make("draft", p_min)])
        with_suffix.auto = lambda p_min: Auto([with_suffix.make("ngram"), SuffixDecoding(with_suffix.suffix, False),
                                               with_suffix.make("draft", p_min)])
    else:
        without.auto = lambda p_min: without.make("ngram")
    return runtimes


def one_prompt(runtimes: dict, prompt: str, args) -> dict:
    """Every run on one prompt, in turn: {run: (tokens/s, stats)}."""
    def generate(run: str, _repeat: int):
        options = {"mode": "autoregressive"} if run == "plain" else {"proposer": run.split("-")[0], "gamma": args.gamma}
        return runtimes[run].generate([prompt], max_new_tokens=args.max_new_tokens, **options)[0]

    samples = interleaved({run: lambda repeat, run=run: generate(run, repeat) for run in RUNS}, repeats=1)
    results = {run: s.value for run, [s] in samples.items()}
    assert len({tuple(r.token_ids) for r in results.values()}) == 1, "greedy outputs differ"
    return {run: (len(results[run].token_ids) / s.seconds, results[run].stats) for run, [s] in samples.items()}


def rows_for(label: str, part: list[dict]) -> list[dict]:
    from speccompile.core.stats import pooled

    rows = []
    for run in RUNS[1:]:
        stats = pooled([row[run][1] for row in part])
        rows.append({"cache": label, "run": run,
                     "speedup": statistics.median(row[run][0] / row["plain"][0] for row in part),
                     "acceptance_rate": stats.acceptance_rate, "mean_acceptance_length": stats.mean_acceptance_length,
                     "drafts": ", ".join(f"{name} {counts[1]}" for name, counts in stats.by_proposer.items())})
    return rows


def run(args) -> Measured:
    runtimes = runtimes_for(bundle(args))
    prompts = workload(args.prompts, args.workload)
    for run_name in RUNS:  # warm-up: sessions, caches (and nothing remembered: greedy outputs of another text)
        runtimes[run_name].generate(["import os\n"], max_new_tokens=8, mode="autoregressive")
    measured = [one_prompt(runtimes, prompt, args) for prompt in prompts]
    for runtime in {id(r): r for r in runtimes.values()}.values():
        runtime.close()
    half = len(measured) // 2
    rows = rows_for("cold (first half)", measured[:half]) + rows_for("warm (second half)", measured[half:])
    title = f"{args.workload}, {len(prompts)} prompts, γ {args.gamma}"
    return Measured((Table.of("suffix", COLUMNS, rows, title),))
