"""Time from `speccompile.load()` to the first generated token, split into its parts.

    python -m tools.measure load [--bundle DIR] [--cold] [--repeats 3]

Each repeat runs in a fresh process: import, the bundle's integrity stamp (`open_bundle`), `load()`
(the tokenizer, each model's session: from its saved optimized graph or made now, see
runtime/saved_graphs.py), then
one generated token (prefill of an 8-token prompt and the first step). `--cold` drops the page cache
before each repeat (root only: `sync; echo 3 > /proc/sys/vm/drop_caches`), so the bundle's bytes
come from disk, and adds the time to read the files a start reads (tokenizer, graphs, weights and
the saved optimized graphs), also from a dropped page cache: the floor a cold start is held to.
Each part: the median over repeats and the range. Then what the bundle takes on disk beside its
weights files (the tensors as stored), and what this machine's saved graphs of it take in the
user's cache.
"""

import subprocess
import time
from pathlib import Path

from tools.measure.harness import in_fresh_process, interleaved
from tools.measure.options import Common, bundle
from tools.measure.record import Column, Measured, Spread, Table

COMMON = Common(bundle=True, repeats=3)
COLUMNS = (Column("part"), Column("seconds", "s", 3), Column("session"))
PARTS = {"import_s": "import speccompile", "integrity_s": "integrity stamp", "load_s": "load()",
         "first_token_s": "first token", "total_s": "total"}

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


def add_options(parser) -> None:
    parser.add_argument("--cold", action="store_true", help="drop the page cache before each repeat (root)")


def drop_page_cache() -> None:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def one_load(path: Path, cold: bool) -> dict:
    if cold:
        drop_page_cache()
    return in_fresh_process(ONE_LOAD, path)


def run(args) -> Measured:
    path = bundle(args)
    [samples] = interleaved({"load": lambda _: one_load(path, args.cold)}, args.repeats).values()
    runs = [s.value for s in samples]
    sessions = runs[-1]["sessions"]  # "saved" or "made" per session, the same in every repeat
    rows = [{"part": label, "seconds": Spread.of(r[key] for r in runs), "session": None}
            for key, label in PARTS.items()]
    rows[3:3] = [{"part": f"{key.removesuffix('_s').replace('_', ' ')} (in load())",
                  "seconds": Spread.of(r[key] for r in runs), "session": how} for key, how in sessions.items()]
    if args.cold:  # what reading the bytes a start reads takes, from a dropped page cache: the floor
        reads = [read_seconds(start_files(path)) for _ in range(args.repeats)]
        rows.append({"part": "reading the bytes a start reads", "seconds": Spread.of(reads), "session": None})
    return Measured((Table.of("load", COLUMNS, rows), Table.of("disk", DISK_COLUMNS, [disk(path)])),
                    {"cold": args.cold, "runs": runs})


def start_files(path: Path) -> list[Path]:
    """The files a start reads: the bundle's manifest, tokenizer, graphs and weights, and this
    machine's saved optimized graphs of it."""
    from speccompile.bundle import open_bundle
    from speccompile.runtime.saved_graphs import saved_dir

    saved = saved_dir(open_bundle(path))
    files = [f for f in path.rglob("*") if f.is_file() and "profiles" not in f.parts]
    return files + [f for f in saved.rglob("*") if f.is_file()]


def read_seconds(files: list[Path]) -> float:
    drop_page_cache()
    started = time.perf_counter()
    for file in files:
        with open(file, "rb", buffering=0) as f:
            while f.read(16 << 20):
                pass
    return time.perf_counter() - started


DISK_COLUMNS = (Column("bundle", "GB", 3), Column("weights", "GB", 3, "its weights files"),
                Column("ratio", "×", 3, "bundle / weights"), Column("saved", "GB", 3, "saved optimized graphs (cache)"))


def disk(path: Path) -> dict:
    from speccompile.bundle import open_bundle
    from speccompile.runtime.saved_graphs import saved_dir

    def size(files) -> float:
        return sum(f.stat().st_size for f in files if f.is_file()) / 1e9

    bundle = size(path.rglob("*"))
    weights = size(path.glob("*.weights"))
    return {"bundle": bundle, "weights": weights, "ratio": bundle / weights if weights else None,
            "saved": size(saved_dir(open_bundle(path)).rglob("*"))}
