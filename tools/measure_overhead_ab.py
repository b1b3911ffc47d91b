r"""Two versions of the engine in one process, on the same bundle, interleaved: the loop's own work
per iteration of each (as tools/measure_overhead.py measures it), where fresh processes drift too much
to compare them.

    git worktree add /tmp/old <commit>
    mkdir /tmp/oldpkg && cp -r /tmp/old/speccompile /tmp/oldpkg/speccompile_old
    grep -rl speccompile /tmp/oldpkg/speccompile_old --include=*.py | xargs sed -i \
        's/\bspeccompile\./speccompile_old./g; s/from speccompile import/from speccompile_old import/g'
    PYTHONPATH=/tmp/oldpkg [OLD_BUNDLE=DIR] python tools/measure_overhead_ab.py BUNDLE BATCH TOKENS ROUNDS [stop]

OLD_BUNDLE: the same bundle as the old engine's format version reads it (greedy runs read no graph
that changed), when the two versions read different format versions.

Prints the medians of each and the median of the rounds' new/old ratios (the order alternates).
"""

import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import measure_overhead as mo  # noqa: E402
from speccompile_old.runtime.runtime import load as load_old  # noqa: E402

import speccompile  # noqa: E402

B = sys.argv[1]
B_OLD = os.environ.get("OLD_BUNDLE", B)  # the old engine may read only an older format: the same graphs
batch, n, rounds = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
stop = len(sys.argv) > 5
rts = {"old": load_old(B_OLD), "new": speccompile.load(B)}
acc = {}
for name, rt in rts.items():
    acc[name] = mo.counted_steps(rt, mo.timed_engines(rt))
prompts = [mo.PROMPT + " " * i for i in range(batch)]
opts = dict(max_new_tokens=n, gamma=4)
if stop:
    opts["stop"] = ["\x00never\x00", "<|never|>"]
for rt in rts.values():
    rt.generate(prompts, max_new_tokens=16)
res = {k: [] for k in rts}
for r in range(rounds):
    for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
        steps = acc[name]
        steps.update(n=0, ms=0.0, engine_ms=0.0)
        rts[name].generate(prompts, **opts)
        res[name].append((steps["ms"] - steps["engine_ms"]) / steps["n"])
ratios = [b / a for a, b in zip(res["old"], res["new"])]
medians = {f"{name}_ms": round(statistics.median(values), 4) for name, values in res.items()}
print(json.dumps({"batch": batch, "tokens": n, "stop": stop, **medians,
                  "median_ratio": round(statistics.median(ratios), 3), "ratios": [round(x, 2) for x in ratios]}))
