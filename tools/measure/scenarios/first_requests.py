"""What a fresh load costs its first requests: `load()` (with its calibration, timed apart), then the
same request of 16 tokens twice and the same batch of 8 twice, each call's wall time as its caller
saw it and its time to first token (the batch's slowest); medians over --repeats fresh runtimes.

    python -m tools.measure first_requests [--pairs demo] [--repeats 3]

The pairs are the `never_slower` scenario's.
"""

import time

from tools.measure.harness import interleaved
from tools.measure.options import Common
from tools.measure.record import Column, Measured, Spread, Table
from tools.measure.scenarios.never_slower import PAIRS, pairs

COMMON = Common(repeats=3)
CALLS = (("first", 1), ("second", 1), ("first_batch8", 8), ("second_batch8", 8))  # (label, prompts)
COLUMNS = (Column("pair"), Column("load_s", "s", 3, "load()"), Column("calibration_s", "s", 3, "of which calibration"),
           *(column for label, _ in CALLS for column in (Column(f"{label}_s", "s", 4, label.replace("_", " ")),
                                                         Column(f"{label}_ttft_ms", "ms", 1,
                                                                f"{label.replace('_', ' ')} TTFT"))))


def add_options(parser) -> None:
    parser.add_argument("--pairs", default="demo,poor,tiny,smollm2")


def fresh_runtime(bundle, prompts: list[str], calibrating: list[float]) -> dict:
    """load() and the calls on a new runtime: each call's wall time and slowest time to first token."""
    import speccompile

    before = len(calibrating)
    began = time.perf_counter()
    runtime = speccompile.load(bundle)
    times = {"load_s": time.perf_counter() - began, "calibration_s": sum(calibrating[before:])}
    for label, count in CALLS:
        began = time.perf_counter()
        results = runtime.generate(prompts[:count], max_new_tokens=16)
        times[f"{label}_s"] = time.perf_counter() - began
        times[f"{label}_ttft_ms"] = max(r.stats.ttft_ms for r in results)
    runtime.close()
    return times


def timing_calibration(calibrating: list[float]):
    """Wrap LoadPolicies.calibrate to append each call's seconds; returns the original, to put back."""
    from speccompile.runtime.policies import LoadPolicies

    real = LoadPolicies.calibrate

    def timed(self, *args):
        began = time.perf_counter()
        real(self, *args)
        calibrating.append(time.perf_counter() - began)

    LoadPolicies.calibrate = timed
    return real


def measure(name: str, repeats: int) -> dict:
    from speccompile.runtime.policies import LoadPolicies

    bundle, prompts = PAIRS[name]()
    calibrating = []
    real = timing_calibration(calibrating)
    try:
        [samples] = interleaved({name: lambda _: fresh_runtime(bundle, prompts, calibrating)}, repeats).values()
    finally:
        LoadPolicies.calibrate = real
    return {"pair": name, **{key: Spread.of(s.value[key] for s in samples) for key in samples[0].value}}


def run(args) -> Measured:
    return Measured((Table.of("first_requests", COLUMNS, [measure(name, args.repeats) for name in pairs(args.pairs)]),))
