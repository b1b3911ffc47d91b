"""Time from `speccompile.load()` to the first generated token, split into its parts.

    python tools/measure_load.py BUNDLE [--cold] [--repeats 3]

Each repeat runs in a fresh process: import, `load()` (the bundle's integrity stamp, the tokenizer,
each model's session: saved pre-packed or made now, see runtime/prepacked.py), then one generated
token (prefill of an 8-token prompt and the first step). `--cold` drops the page cache before each
repeat (root only: `sync; echo 3 > /proc/sys/vm/drop_caches`), so the bundle's bytes come from disk.
Prints one JSON object per repeat, then the medians.
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ONE_LOAD = r"""
import json, sys, time
started = time.perf_counter()
import speccompile
from speccompile.bundle import open_bundle
from speccompile.runtime import onnxruntime_engine
imported = time.perf_counter()
sessions = []
make_session = onnxruntime_engine.OrtModel._new_session
def timed(self, file):
    began = time.perf_counter()
    session = make_session(self, file)
    sessions.append((f"{self.role}_session_s", time.perf_counter() - began, self.session_source))
    return session
onnxruntime_engine.OrtModel._new_session = timed
open_bundle(sys.argv[1])
opened = time.perf_counter()
runtime = speccompile.load(sys.argv[1])
loaded = time.perf_counter()
runtime.generate([[5, 17, 33, 2, 9, 100, 7, 12]], max_new_tokens=1)
first = time.perf_counter()
parts = {"import_s": imported - started, "integrity_s": opened - imported, "load_s": loaded - opened,
         "first_token_s": first - loaded, "total_s": first - started}
parts.update({name: seconds for name, seconds, _ in sessions})
parts["sessions"] = {name: how for name, _, how in sessions}
print(json.dumps(parts))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--cold", action="store_true", help="drop the page cache before each repeat (root)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    runs = []
    for _ in range(args.repeats):
        if args.cold:
            subprocess.run(["sync"], check=True)
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
        out = subprocess.run([sys.executable, "-c", ONE_LOAD, str(args.bundle)], capture_output=True, text=True,
                             check=True).stdout
        runs.append(json.loads(out.splitlines()[-1]))
        print(json.dumps(runs[-1]), flush=True)
    keys = [key for key, value in runs[0].items() if isinstance(value, float)]
    print(json.dumps({"median": {key: round(statistics.median(r[key] for r in runs), 3) for key in keys}}))


if __name__ == "__main__":
    main()
