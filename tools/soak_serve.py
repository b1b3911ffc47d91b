"""A bounded soak of `speccompile serve` under a mixed load: N requests from C concurrent clients on
loopback, each one of: a completion of a random length, a stream read to its end, a stream the
client abandons after its first chunk, a sampled completion with stop strings and logprobs, and a
bad request (unknown field, malformed JSON, a prompt too long). The server's RSS before and after
(the process's own, read with psutil).

    python tools/soak_serve.py [--bundle DIR] [--requests 10000] [--clients 8] [--max-tokens 32]

No request may be lost: every one gets exactly one final answer (a complete body, a stream ending in
[DONE], a 4xx for the bad ones; an abandoned stream is ended by its client), and the server's own
count of finished requests (vllm:request_success_total) equals the requests it accepted. Printed:
outcomes by kind, failures, throughput, RSS after a warm-up and at the end, the server's counts.
"""

import argparse
import collections
import json
import random
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import psutil

KINDS = ("completion", "completion", "completion", "stream", "stream", "abandoned stream", "sampled", "bad request")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body, stream_chunks: int | None = None) -> tuple[int, str]:
    """(status, text); with stream_chunks, the client stops reading after that many lines."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            if stream_chunks is None:
                return response.status, response.read().decode()
            lines = [response.readline() for _ in range(stream_chunks)]
            return response.status, b"".join(lines).decode()  # closed here: the client goes away
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def one(url: str, i: int, max_tokens: int) -> tuple[str, str | None, bool]:
    """Request i: (its kind, what was wrong with its answer or None, whether the server accepted it)."""
    kind, rng = KINDS[i % len(KINDS)], random.Random(i)
    prompt = f"def f{i % 50}(x):" + " y" * rng.randrange(0, 40)
    tokens = rng.randrange(1, max_tokens + 1)
    if kind == "bad request":
        body = rng.choice([{"prompt": prompt, "colour": "blue"}, b"{not json", {"prompt": list(range(5, 2000))}])
        status, text = post(url, body)
        ok = status == 400 and "error" in json.loads(text)
        return kind, None if ok else f"{status}: {text[:200]}", False
    if kind in ("stream", "abandoned stream"):
        abandoned = kind == "abandoned stream"
        status, text = post(url, {"prompt": prompt, "max_tokens": tokens, "stream": True}, 1 if abandoned else None)
        ok = status == 200 and (abandoned or text.rstrip().endswith("data: [DONE]"))
        return kind, None if ok else f"{status}: {text[-200:]}", status == 200
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0}
    if kind == "sampled":
        body |= {"temperature": 0.8, "seed": i, "stop": ["\n\n"], "logprobs": 2}
    status, text = post(url, body)
    reply = json.loads(text) if status == 200 else {}
    ok = status == 200 and reply["choices"] and reply["usage"]["completion_tokens"] <= tokens
    return kind, None if ok else f"{status}: {text[:200]}", status == 200


def run(url: str, requests: int, clients: int, max_tokens: int):
    outcomes, failures, lock, indices = collections.Counter(), [], threading.Lock(), iter(range(requests))
    accepted = 0

    def client():
        nonlocal accepted
        while True:
            with lock:
                i = next(indices, None)
            if i is None:
                return
            try:
                kind, problem, taken = one(url, i, max_tokens)
            except Exception as e:  # noqa: BLE001 (reported: a request without a final answer)
                kind, problem, taken = KINDS[i % len(KINDS)], f"{type(e).__name__}: {e}", True
            with lock:
                outcomes[kind, "ok" if problem is None else "failed"] += 1
                accepted += taken
                if problem is not None:
                    failures.append(f"request {i} ({kind}): {problem}")

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes, failures, accepted


def finished_count(base: str) -> tuple[float, float]:
    """(requests the server counts as finished, requests it counts as running or waiting)."""
    text = urllib.request.urlopen(base + "/metrics", timeout=30).read().decode()
    finished = sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("vllm:request_success_total"))
    busy = sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")))
    return finished, busy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", default=None, help="default: the demo bundle")
    parser.add_argument("--requests", type=int, default=10000)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    port = free_port()
    command = [sys.executable, "-m", "speccompile", "serve", *([args.bundle] if args.bundle else []),
               "--port", str(port), "--disable-access-log"]
    server = subprocess.Popen(command)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(base + "/health", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        process = psutil.Process(server.pid)
        run(base + "/v1/completions", 4 * args.clients, args.clients, args.max_tokens)  # warm-up
        time.sleep(1)  # abandoned streams of the warm-up end
        before, (finished_before, _) = process.memory_info().rss, finished_count(base)
        start = time.perf_counter()
        outcomes, failures, accepted = run(base + "/v1/completions", args.requests, args.clients, args.max_tokens)
        seconds = time.perf_counter() - start
        time.sleep(2)  # the last abandoned streams are cancelled at the engine's next iterations
        after, (finished_after, busy) = process.memory_info().rss, finished_count(base)
    finally:
        server.terminate()
        code = server.wait(60)
    print(f"{args.requests} requests from {args.clients} clients in {seconds:.1f} s ({args.requests / seconds:.1f}/s), "
          f"{len(failures)} without the right final answer")
    for (kind, verdict), count in sorted(outcomes.items()):
        print(f"  {kind:18} {verdict:6} {count}")
    print(f"accepted by the server: {accepted}; it counts {finished_after - finished_before:.0f} finished, "
          f"{busy:.0f} still running or waiting")
    print(f"server RSS {before / 1e6:.1f} MB after warm-up, {after / 1e6:.1f} MB at the end "
          f"({(after - before) / 1e6:+.1f} MB); exit code after SIGTERM {code}")
    for failure in failures[:10]:
        print(failure)


if __name__ == "__main__":
    main()
