r"""Two versions of speccompile in one process, interleaved: tokens/s of `generate` on the demo prompts,
speculative and plain, at a batch size, each version on the bundle its format reads; the median of
the repeats' new/old ratios (fresh processes drift 10-30% on this machine, too much to compare).

    git worktree add /tmp/old <commit>
    mkdir /tmp/oldpkg && cp -r /tmp/old/speccompile /tmp/oldpkg/speccompile_old
    grep -rl speccompile /tmp/oldpkg/speccompile_old --include=*.py | xargs sed -i \
        's/\bspeccompile\./speccompile_old./g; s/from speccompile import/from speccompile_old import/g'
    PYTHONPATH=/tmp/oldpkg python -m tools.measure ab_generate --old-bundle OLD_BUNDLE [--bundle NEW_BUNDLE] \
        [--batch 1] [--max-new-tokens 64] [--repeats 7] [--gamma 4|default] [--proposer NAME] [--prompts 8]

Two runtimes in one process can differ by up to about 10% whatever their code (the same bundle
loaded twice: a target step 5.37 against 5.99 ms, more often the one loaded second the faster): the
plain row's new/old carries that difference, and "over plain's" (each repeat's speculative new/old
over its plain new/old) is the change to speculation net of it.

--gamma: the speculative calls' γ, or "default": the call with no γ, each version's default.
--proposer: the speculative calls' proposer (default: none given, each version's default).
"""

from functools import partial

from speccompile.errors import SpecCompileError
from tools.measure.harness import interleaved
from tools.measure.options import Common, bundle
from tools.measure.prompts import demo_prompts
from tools.measure.record import Column, Measured, Spread, Table
from tools.measure.scenarios.overhead_ab import load_old

COMMON = Common(bundle=True, prompts=8, max_new_tokens=64, repeats=7)
COLUMNS = (Column("batch"), Column("mode"), Column("old_tokens_per_s", "tok/s", 0, "old"),
           Column("new_tokens_per_s", "tok/s", 0, "new"), Column("new_over_old", "×", 3, "new / old"),
           Column("over_plain", "×", 3, "new / old over plain's"))


def add_options(parser) -> None:
    parser.add_argument("--old-bundle", required=True, help="the bundle the old version reads")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--gamma", default="4", help="the speculative calls' γ, or default: no γ given")
    parser.add_argument("--proposer", help="the speculative calls' proposer (default: none given)")


def gamma_option(text: str) -> int | str:
    if text == "default":
        return text
    if not text.isdigit():
        raise SpecCompileError(f"--gamma: a number or default, got {text!r}")
    return int(text)


def generate_options(gamma, proposer: str | None = None) -> dict:
    """γ 0: plain decoding (asked as mode "autoregressive", which both versions read); "default": no γ."""
    if not gamma:
        return {"mode": "autoregressive"}
    return ({} if gamma == "default" else {"gamma": gamma}) | ({"proposer": proposer} if proposer else {})


def tokens(runtime, prompts: list[str], batch: int, max_new_tokens: int, gamma, proposer: str | None,
           _repeat: int = 0) -> int:
    made = 0
    for start in range(0, len(prompts), batch):
        results = runtime.generate(prompts[start : start + batch], max_new_tokens=max_new_tokens,
                                   **generate_options(gamma, proposer))
        made += sum(len(r.token_ids) for r in results)
    return made


def run(args) -> Measured:
    import speccompile

    speculative = gamma_option(args.gamma)
    prompts = args.prompts.pick(demo_prompts)
    runtimes = {"old": load_old(args.old_bundle), "new": speccompile.load(bundle(args))}
    variants = {f"{name} {gamma}": partial(tokens, runtime, prompts, args.batch, args.max_new_tokens, gamma,
                                           args.proposer)
                for gamma in (speculative, 0) for name, runtime in runtimes.items()}
    for call in variants.values():  # warm: every graph loaded, the engine threads started
        call()
    samples = interleaved(variants, args.repeats, cold=runtimes.values(), alternate=True)
    rows, ratios = [], {}
    speculating = f"speculative γ={speculative}" + (f", {args.proposer}" if args.proposer else "")
    for gamma, mode in ((speculative, speculating), (0, "plain")):
        rates = {name: [s.value / s.seconds for s in samples[f"{name} {gamma}"]] for name in runtimes}
        ratios[gamma] = [n / o for n, o in zip(rates["new"], rates["old"])]
        rows.append({"batch": args.batch, "mode": mode, "old_tokens_per_s": Spread.of(rates["old"]),
                     "new_tokens_per_s": Spread.of(rates["new"]), "new_over_old": Spread.of(ratios[gamma]),
                     "over_plain": None})
    rows[0]["over_plain"] = Spread.of(s / p for s, p in zip(ratios[speculative], ratios[0]))
    for runtime in runtimes.values():
        runtime.close()
    return Measured((Table.of("ab_generate", COLUMNS, rows),))
