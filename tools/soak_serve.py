"""A bounded soak of `speccompile serve`: N requests from C concurrent clients on loopback, and the
server's RSS before and after (the process's own, read with psutil).

    python tools/soak_serve.py [--bundle DIR] [--requests 2000] [--clients 8] [--max-tokens 16]

The server runs in a child process (`speccompile serve` on a free port); every response must come
back complete. Printed: requests, wall time, throughput, and RSS after a warm-up round and at the end.
"""

import argparse
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import psutil


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def complete(url: str, prompt: str, max_tokens: int) -> dict:
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    request = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def run(url: str, requests: int, clients: int, max_tokens: int) -> list[str]:
    """Send `requests` completions from `clients` threads; the failures."""
    failures, lock, next_index = [], threading.Lock(), iter(range(requests))

    def client():
        while True:
            with lock:
                i = next(next_index, None)
            if i is None:
                return
            tokens = 4 + i % max_tokens
            try:
                reply = complete(url, f"def f{i % 50}(x):", tokens)
                if reply["usage"]["completion_tokens"] > tokens or not reply["choices"]:
                    failures.append(f"request {i}: {reply}")
            except Exception as e:  # noqa: BLE001 (reported)
                failures.append(f"request {i}: {e!r}")

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", default=None, help="default: the demo bundle")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    port = free_port()
    command = [sys.executable, "-m", "speccompile.cli", "serve", *([args.bundle] if args.bundle else []),
               "--port", str(port)]
    server = subprocess.Popen(command)
    url = f"http://127.0.0.1:{port}/v1/completions"
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        process = psutil.Process(server.pid)
        run(url, 4 * args.clients, args.clients, args.max_tokens)  # warm-up: every batch size's graphs
        before = process.memory_info().rss
        start = time.perf_counter()
        failures = run(url, args.requests, args.clients, args.max_tokens)
        seconds = time.perf_counter() - start
        after = process.memory_info().rss
    finally:
        server.terminate()
        code = server.wait(30)
    print(f"{args.requests} requests from {args.clients} clients in {seconds:.1f} s ({args.requests / seconds:.1f}/s), "
          f"{len(failures)} failed; server RSS {before / 1e6:.1f} MB after warm-up, {after / 1e6:.1f} MB at the end "
          f"({(after - before) / 1e6:+.1f} MB); exit code after SIGTERM {code}")
    for failure in failures[:5]:
        print(failure)


if __name__ == "__main__":
    main()
