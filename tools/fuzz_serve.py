"""The suite's server fuzz (tests/serve/fuzz.py), for longer: N generated requests across the POST
routes against a server on the given bundle (default: the demo bundle's), counted by route and
status; every one must be a 2xx or a 4xx in OpenAI's error shape. Prints the counts, the failures
(a 5xx, a 4xx without OpenAI's body, a hang past the timeout) with their bodies, and whether the
server still answers a normal request. A progress line every --every requests, so a long run that is
stopped still says how far it got.

    python -m tools.fuzz_serve [--bundle DIR | --tiny] [--requests 20000] [--seed 0]

--tiny serves the suite's tiny llama pair (random target and draft, built into a temporary directory):
the same server paths at a fraction of the demo pair's cost per request.
"""

import argparse
import collections
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import speccompile
from speccompile.serve.app import create_app
from tests.serve.fuzz import MODEL, acceptable, requests
from tests.serve.test_app import TEMPLATE, start, stop
from tests.serve.test_fuzz import send


def tiny_bundle(workdir: Path) -> Path:
    from speccompile.compiler.build import build_bundle
    from tests.tiny_models import make_checkpoint, make_tokenizer

    tokenizer = make_tokenizer()
    target = make_checkpoint(workdir / "target", "llama", seed=0, size="target", tokenizer=tokenizer)
    draft = make_checkpoint(workdir / "draft", "llama", seed=1, size="draft", tokenizer=tokenizer)
    return build_bundle(target, draft, workdir / "bundle", gammas=[1, 4], max_seq=96, max_batch=4)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bundle", default=None)
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="serve the suite's tiny llama pair")
    parser.add_argument("--every", type=int, default=1000, help="print progress every N requests")
    parser.add_argument("--failures", default=None, help="also write each failing body, whole, to this file")
    args = parser.parse_args()
    workdir = tempfile.TemporaryDirectory()
    bundle = tiny_bundle(Path(workdir.name)) if args.tiny else args.bundle
    runtime = speccompile.load(bundle, max_batch=2) if bundle else speccompile.load()
    app = create_app(runtime, MODEL, max_waiting=64, chat_template=TEMPLATE)
    server, thread, url = start(app)
    counts, by_status, failures = collections.Counter(), collections.Counter(), []
    began = time.perf_counter()
    lock = threading.Lock()

    @settings(max_examples=args.requests, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def run(data):
        route, body = data.draw(requests(app.openapi()))
        try:
            status, answer = send(url, route, body)
            problem = acceptable(status, answer)
        except Exception as e:  # noqa: BLE001 (a hang or a dropped connection is a failure to count)
            status, problem = "no answer", f"{type(e).__name__}: {e}"
        with lock:
            counts[route, status] += 1
            by_status[status] += 1
            if problem is not None:
                failures.append((route, body[:400], problem))
                if args.failures:
                    with open(args.failures, "ab") as out:
                        out.write(route.encode() + b" " + body + b"\n")
            done = sum(counts.values())
            if done % args.every == 0:
                statuses = dict(sorted(by_status.items(), key=str))
                print(f"{done} requests, {time.perf_counter() - began:.0f} s: {statuses}, failures {len(failures)}",
                      flush=True)

    random.seed(args.seed)
    run()
    took = time.perf_counter() - began
    status, answer = send(url, "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 4}).encode())
    stop(server, thread)
    runtime.close()
    workdir.cleanup()
    print(f"{sum(counts.values())} requests in {took:.0f} s")
    for (route, code), count in sorted(counts.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        print(f"  {route:22} {code!s:>10}  {count}")
    print(f"failures: {len(failures)}")
    for route, body, problem in failures[:20]:
        print(f"  {route} {body!r}: {problem}")
    print(f"a normal request afterwards: {status}")
    sys.exit(1 if failures or status != 200 else 0)


if __name__ == "__main__":
    main()
