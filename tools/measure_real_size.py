"""Memory and step times of a (real-size) bundle: what the README's memory model is checked against.

    python tools/make_random_checkpoint.py --shape tinyllama-1.1b --out /tmp/tl
    python tools/make_random_checkpoint.py --draft-of /tmp/tl --layers 2 --out /tmp/tl-draft
    /usr/bin/time -v speccompile build --target /tmp/tl --draft /tmp/tl-draft --out /tmp/tl-b \\
        --gamma 2 --gamma 4 --gamma 6 --max-seq 512 --max-batch 4        # build peak RSS: "Maximum resident"
    python tools/measure_real_size.py /tmp/tl-b

Prints one JSON object: the bundle's weight bytes, the time to open it (twice: the second open
is the stamped one), resident memory after running every kind of call at every compiled γ
(greedy and sampled, batch 1 and 2), and the step times at batch 1 as `speccompile profile` measures
them: a target and a draft decode step and each γ's verification (medians of --repeats).
"""

import argparse
import json
import time
from pathlib import Path

import psutil


def main() -> None:
    import speccompile
    from speccompile.bundle import kv_cache_bytes_per_sequence, open_bundle
    from speccompile.runtime.calibration import measure_costs

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--context", type=int, default=8, help="tokens in the cache when steps are timed")
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
    report["target_sessions"] = runtime.target.session_count
    report["graph_variants_run"] = len(runtime.target.loaded_files) + len(runtime.draft.loaded_files)
    report["kv_cache_bytes_batch2"] = 2 * sum(kv_cache_bytes_per_sequence(runtime.bundle.model(role), runtime.max_seq)
                                              for role in ("target", "draft"))
    report["step_ms_batch1"] = measure_costs(runtime.target, runtime.draft, runtime.gammas, batch=1,
                                             context=args.context, repeats=args.repeats).timings()
    print(json.dumps(report, indent=1))


def _seconds(call) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


if __name__ == "__main__":
    main()
