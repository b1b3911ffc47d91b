"""Memory and step times of a (real-size) bundle: what the README's memory model is checked against.

    python tools/make_random_checkpoint.py --shape tinyllama-1.1b --out /tmp/tl
    python tools/make_random_checkpoint.py --draft-of /tmp/tl --layers 2 --out /tmp/tl-draft
    /usr/bin/time -v speccompile build --target /tmp/tl --draft /tmp/tl-draft --out /tmp/tl-b \\
        --gamma 2 --gamma 4 --gamma 6 --max-seq 512 --max-batch 4        # build peak RSS: "Maximum resident"
    python tools/measure_real_size.py /tmp/tl-b

Prints one JSON object: the bundle's weight bytes, the time to open it (twice: the second open
is the stamped one), resident memory after running every kind of call at every compiled γ
(greedy and sampled, batch 1 and 2), and the target's step times at batch 1: a decode step and a
verification of γ+1 tokens (medians of --repeats after a warm-up).
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import psutil


def main() -> None:
    import speccompile
    from speccompile.bundle import kv_cache_bytes_per_sequence, open_bundle

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    process = psutil.Process()
    report = {"weights_bytes": {role: (args.bundle / f"{role}.weights").stat().st_size for role in ("target", "draft")}}
    report["open_s"] = [round(_seconds(lambda: open_bundle(args.bundle)), 4) for _ in range(2)]
    runtime = speccompile.load(args.bundle, shared_threads=True)
    prompt = [5, 17, 33, 2, 9, 100, 7, 12]
    for gamma in runtime.gammas:
        for temperature in (0.0, 0.8):
            for batch in (1, 2):
                runtime.generate([prompt] * batch, max_new_tokens=4, gamma=gamma, temperature=temperature, seed=0)
    report["rss_all_calls_bytes"] = process.memory_info().rss
    report["target_sessions"] = len({id(s) for s in runtime.target._sessions.values()})
    report["graph_variants_run"] = len(runtime.target._sessions) + len(runtime.draft._sessions)
    report["kv_cache_bytes_batch2"] = 2 * sum(kv_cache_bytes_per_sequence(runtime.bundle.model(role), runtime.max_seq)
                                              for role in ("target", "draft"))
    report["step_ms_batch1"] = _step_times(runtime.target, prompt, runtime.gammas, args.repeats)
    print(json.dumps(report, indent=1))


def _seconds(call) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def _step_times(target, prompt: list[int], gammas: list[int], repeats: int) -> dict:
    """Median ms of a decode step and of each γ's verification, at batch 1 after `prompt`."""
    target.start(1)
    target.forward(np.array([prompt]), np.array([len(prompt)]))
    context = target.cache_lengths.copy()

    def decode():
        target.forward(np.array([[9]]), np.array([1]))
        target.cache_lengths = context.copy()  # roll back: every repeat at the same context

    def verify(gamma):
        target.verify(np.array([[9] + [1] * gamma]))
        target.cache_lengths = context.copy()

    times = {"decode": [decode] * (repeats + 1)}
    times |= {f"verify_g{g}": [lambda g=g: verify(g)] * (repeats + 1) for g in gammas}
    return {name: round(1e3 * statistics.median([_seconds(c) for c in calls][1:]), 2) for name, calls in times.items()}


if __name__ == "__main__":
    main()
