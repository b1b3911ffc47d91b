"""Scale-out on a local single-node Ray cluster: two replicas of the server behind Ray Serve's proxy,
each answering as one server does (greedy completions equal `generate`, streams that add up)."""

import json
import socket
import urllib.request

import openai
import pytest

import speccompile

ray = pytest.importorskip("ray", reason="the ray extra is not installed")


@pytest.mark.slow
def test_two_replicas_serve_the_same_routes_and_both_answer(bundles):
    from ray import serve

    from speccompile.serve.ray_app import application

    bundle = str(bundles("llama", "random"))
    [expected] = speccompile.load(bundle).generate(["x y"], max_new_tokens=8, temperature=0)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        port = start_serve_on_a_free_port(serve)
        serve.run(application(bundle, replicas=2, model_name="tiny", cpus_per_replica=0.5))
        url = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        reply = client.completions.create(model="tiny", prompt="x y", max_tokens=8, temperature=0)
        assert reply.choices[0].text == expected.text
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="tiny", prompt="x y", max_tokens=8, temperature=0, stream=True))
        assert streamed == expected.text
        servers = set()
        body = json.dumps({"prompt": "x y", "max_tokens": 4, "temperature": 0}).encode()
        for _ in range(24):
            request = urllib.request.Request(url + "/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as response:
                servers.add(response.headers["x-speccompile-server"])
        assert len(servers) == 2, servers  # both replicas took requests
    finally:
        serve.shutdown()
        ray.shutdown()


def start_serve_on_a_free_port(serve, attempts: int = 3) -> int:
    """Ray Serve's proxy on a loopback port that was free a moment before: Ray's own processes take
    ephemeral ports as they start, and one may take it first (the proxy then fails to bind), so a
    few fresh ports are tried."""
    for attempt in range(attempts):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            return port
        except Exception as e:  # noqa: BLE001 (Ray wraps the proxy's failure in its own task error)
            if "Failed to bind" not in str(e) or attempt == attempts - 1:
                raise
            serve.shutdown()
    raise AssertionError("unreachable")
