"""Memory and step times of a (real-size) bundle: what the docs' memory model is checked against.

    python -m tools.make_random_checkpoint --shape tinyllama-1.1b --out /tmp/tl
    python -m tools.make_random_checkpoint --draft-of /tmp/tl --layers 2 --out /tmp/tl-draft
    /usr/bin/time -v speccompile build --target /tmp/tl --draft /tmp/tl-draft --out /tmp/tl-b \\
        --gamma 2 --gamma 4 --gamma 6 --max-seq 512 --max-batch 4        # build peak RSS: "Maximum resident"
    python -m tools.measure real_size --bundle /tmp/tl-b [--repeats 5] [--context 8]

Measures the bundle's weight bytes, the time to open it (twice: the second open is the stamped
one), resident memory after running every kind of call at every compiled γ (greedy and sampled,
batch 1 and 2), and the step times at batch 1 as `speccompile profile` measures them: a target and a
draft decode step and each γ's verification (medians of --repeats).
"""

from pathlib import Path

from tools.measure.harness import timed
from tools.measure.options import Common, bundle
from tools.measure.record import Column, Measured, Table

COMMON = Common(bundle=True, repeats=5)
MB = 1e6
MEMORY_COLUMNS = (Column("target_weights", "MB", 1), Column("draft_weights", "MB", 1),
                  Column("first_open", "s", 3), Column("second_open", "s", 3),
                  Column("rss_all_calls", "MB", 0, "RSS after every call"),
                  Column("kv_cache_batch2", "MB", 1, "KV cache, batch 2"), Column("target_sessions"),
                  Column("graph_variants_run"))
STEP_COLUMNS = (Column("step"), Column("ms", "ms", 2, "time"))


def add_options(parser) -> None:
    parser.add_argument("--context", type=int, default=8, help="tokens in the cache when steps are timed")


def every_call(runtime) -> None:
    prompt = [5, 17, 33, 2, 9, 100, 7, 12]
    for gamma in runtime.gammas:
        for temperature in (0.0, 0.8):
            for batch in (1, 2):
                runtime.generate([prompt] * batch, max_new_tokens=4, gamma=gamma, temperature=temperature, seed=0)


def memory_row(path: Path, runtime, opens: list[float]) -> dict:
    import psutil

    from speccompile.bundle import kv_cache_bytes_per_sequence

    kv = 2 * sum(kv_cache_bytes_per_sequence(runtime.bundle.model(role), runtime.max_seq)
                 for role in ("target", "draft"))
    return {"target_weights": (path / "target.weights").stat().st_size / MB,
            "draft_weights": (path / "draft.weights").stat().st_size / MB,
            "first_open": opens[0], "second_open": opens[1], "rss_all_calls": psutil.Process().memory_info().rss / MB,
            "kv_cache_batch2": kv / MB, "target_sessions": runtime.target.session_count,
            "graph_variants_run": len(runtime.target.loaded_files) + len(runtime.draft.loaded_files)}


def step_rows(timings: dict) -> list[dict]:
    rows = [{"step": "target decode step", "ms": timings["target_step_ms"]},
            {"step": "draft decode step", "ms": timings["draft_step_ms"]}]
    return rows + [{"step": f"verify γ={gamma}", "ms": ms} for gamma, ms in timings["verify_ms"].items()]


def run(args) -> Measured:
    import speccompile
    from speccompile.bundle import open_bundle
    from speccompile.runtime.calibration import measure_costs

    path = Path(bundle(args))
    opens = [timed(open_bundle, path).seconds for _ in range(2)]
    runtime = speccompile.load(path, shared_threads=True)
    every_call(runtime)
    memory = memory_row(path, runtime, opens)
    timings = measure_costs(runtime.target, runtime.draft, runtime.gammas, batch=1, context=args.context,
                            repeats=args.repeats).timings()
    runtime.close()
    return Measured((Table.of("memory", MEMORY_COLUMNS, [memory], "memory"),
                     Table.of("steps", STEP_COLUMNS, step_rows(timings), "step times, batch 1")),
                    {"step_ms_batch1": timings})
