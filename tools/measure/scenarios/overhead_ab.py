r"""Two versions of the engine in one process, on the same bundle, interleaved: the loop's own work
per iteration of each (as the `overhead` scenario measures it), where fresh processes drift too much
(10 to 30% here) to compare them.

    git worktree add /tmp/old <commit>
    mkdir /tmp/oldpkg && cp -r /tmp/old/speccompile /tmp/oldpkg/speccompile_old
    grep -rl speccompile /tmp/oldpkg/speccompile_old --include=*.py | xargs sed -i \
        's/\bspeccompile\./speccompile_old./g; s/from speccompile import/from speccompile_old import/g'
    PYTHONPATH=/tmp/oldpkg python -m tools.measure overhead_ab [--bundle DIR] [--old-bundle DIR] \
        [--batch 1] [--max-new-tokens 256] [--repeats 7] [--stop]

--old-bundle: the same bundle as the old engine's format version reads it (greedy runs read no graph
that changed), when the two versions read different format versions (default: --bundle). The two
take turns going first; each row: each version's median, and the median of the repeats' new/old ratios.
"""

import importlib

import speccompile
from speccompile.errors import SpecCompileError
from tools.measure.harness import interleaved
from tools.measure.options import Common, bundle
from tools.measure.record import Column, Measured, Spread, Table
from tools.measure.scenarios.overhead import NEVER, PROMPT, counted_steps, one_round, timed_engines

COMMON = Common(bundle=True, max_new_tokens=256, repeats=7)
COLUMNS = (Column("batch"), Column("tokens"), Column("stop_strings"),
           Column("old_ms", "ms", 4, "old: overhead per iteration"),
           Column("new_ms", "ms", 4, "new: overhead per iteration"), Column("new_over_old", "×", 3, "new / old"))


def add_options(parser) -> None:
    parser.add_argument("--old-bundle", help="the bundle as the old version reads it (default: --bundle)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--stop", action="store_true", help="stop strings that never match")


def load_old(path):
    try:
        return importlib.import_module("speccompile_old.runtime.runtime").load(path)
    except ModuleNotFoundError:
        raise SpecCompileError("overhead_ab needs the old version importable as speccompile_old (PYTHONPATH): "
                               "see python -m tools.measure overhead_ab --help") from None


def run(args) -> Measured:
    new_bundle = bundle(args)
    runtimes = {"old": load_old(args.old_bundle or new_bundle), "new": speccompile.load(new_bundle)}
    steps = {name: counted_steps(rt, timed_engines(rt)) for name, rt in runtimes.items()}
    prompts = [PROMPT + " " * i for i in range(args.batch)]
    options = dict(max_new_tokens=args.max_new_tokens, gamma=4, **({"stop": NEVER} if args.stop else {}))
    for runtime in runtimes.values():  # warm-up
        runtime.generate(prompts, max_new_tokens=16)
    samples = interleaved({name: lambda _, name=name: one_round(runtimes[name], prompts, options, steps[name])
                           for name in runtimes}, args.repeats, cold=runtimes.values(), alternate=True)
    per_iteration = {name: [s.value["overhead_ms"] for s in samples[name]] for name in runtimes}
    ratios = [new / old for old, new in zip(per_iteration["old"], per_iteration["new"])]
    row = {"batch": args.batch, "tokens": args.max_new_tokens, "stop_strings": args.stop,
           "old_ms": Spread.of(per_iteration["old"]), "new_ms": Spread.of(per_iteration["new"]),
           "new_over_old": Spread.of(ratios)}
    for runtime in runtimes.values():
        runtime.close()
    return Measured((Table.of("overhead_ab", COLUMNS, [row]),))
