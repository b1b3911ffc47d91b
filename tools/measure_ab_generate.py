r"""Two versions of speccompile in one process, interleaved: tokens/s of `generate` on the demo prompts,
speculative and plain, at a batch size, each version on the bundle its format reads; the median of
the rounds' new/old ratios (fresh processes drift 10-30% on this machine, too much to compare).

    git worktree add /tmp/old <commit>
    mkdir /tmp/oldpkg && cp -r /tmp/old/speccompile /tmp/oldpkg/speccompile_old
    grep -rl speccompile /tmp/oldpkg/speccompile_old --include=*.py | xargs sed -i \
        's/\bspeccompile\./speccompile_old./g; s/from speccompile import/from speccompile_old import/g'
    PYTHONPATH=/tmp/oldpkg python tools/measure_ab_generate.py OLD_BUNDLE NEW_BUNDLE [BATCH] [TOKENS] [ROUNDS] [GAMMA]

GAMMA: the speculative calls' γ (default 4), or "default": the call with no γ, each version's default.
"""

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from speccompile_old.runtime.runtime import load as load_old  # noqa: E402

import speccompile  # noqa: E402
from speccompile.demo import DEMO_PROMPTS  # noqa: E402

old_bundle, new_bundle = sys.argv[1], sys.argv[2]
batch, tokens, rounds = (int(a) for a in (sys.argv[3:] + ["1", "64", "7"][len(sys.argv) - 3 :])[:3])
speculative = sys.argv[6] if len(sys.argv) > 6 else "4"
speculative = speculative if speculative == "default" else int(speculative)
prompts = json.loads(Path(DEMO_PROMPTS).read_text())[:8]
runtimes = {"old": load_old(old_bundle), "new": speccompile.load(new_bundle)}


def rate(runtime, gamma) -> float:
    """γ 0: plain decoding (asked as mode "autoregressive", which both versions read); "default": no γ."""
    began, made = time.perf_counter(), 0
    options = {} if gamma == "default" else {"gamma": gamma} if gamma else {"mode": "autoregressive"}
    for start in range(0, len(prompts), batch):
        results = runtime.generate(prompts[start : start + batch], max_new_tokens=tokens, **options)
        made += sum(len(r.token_ids) for r in results)
    return made / (time.perf_counter() - began)


for runtime in runtimes.values():  # warm: every graph loaded, the engine threads started
    rate(runtime, speculative), rate(runtime, 0)
speeds = {(name, gamma): [] for name in runtimes for gamma in (speculative, 0)}
for round_ in range(rounds):
    order = list(runtimes) if round_ % 2 == 0 else list(reversed(runtimes))
    for gamma in (speculative, 0):
        for name in order:
            speeds[name, gamma].append(rate(runtimes[name], gamma))
for gamma, label in ((speculative, f"speculative γ={speculative}"), (0, "plain")):
    ratios = [n / o for n, o in zip(speeds["new", gamma], speeds["old", gamma])]
    print(f"batch {batch}, {label}: old {statistics.median(speeds['old', gamma]):.0f} tok/s, new "
          f"{statistics.median(speeds['new', gamma]):.0f} tok/s, new/old median {statistics.median(ratios):.3f} "
          f"(rounds {min(ratios):.3f}..{max(ratios):.3f})")
for runtime in runtimes.values():
    runtime.close()
