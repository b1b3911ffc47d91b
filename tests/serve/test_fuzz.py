"""The server under generated input (tests/serve/fuzz.py): 300 requests across its four POST
routes, each answered with a 2xx or a 4xx in OpenAI's error shape, never a 5xx or a hang, and the
server answering a normal request after them. tools/fuzz_serve.py runs the same for longer (the
suite's share: about 40 s of its ten minutes on two cores)."""

import json
import urllib.error
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import speccompile
from speccompile.serve.app import create_app
from tests.serve.fuzz import acceptable, requests
from tests.serve.test_app import TEMPLATE, start, stop


def send(url: str, route: str, body: bytes) -> tuple[int, object]:
    request = urllib.request.Request(url + route, data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            raw = response.read().decode()
            status = response.status
    except urllib.error.HTTPError as error:
        raw, status = error.read().decode(), error.code
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:
        return status, raw  # a stream: server-sent events


@pytest.fixture(scope="module")
def fuzzed_server(bundles):
    runtime = speccompile.load(bundles("llama", "random"), max_batch=2)
    app = create_app(runtime, "tiny", max_waiting=64, chat_template=TEMPLATE)
    server, thread, url = start(app)
    yield url, app.openapi()
    stop(server, thread)
    runtime.close()


@pytest.mark.slow
@settings(max_examples=300, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_generated_requests_get_a_2xx_or_an_openai_4xx_and_never_a_5xx(fuzzed_server, data):
    url, openapi = fuzzed_server
    route, body = data.draw(requests(openapi))
    status, answer = send(url, route, body)
    problem = acceptable(status, answer)
    assert problem is None, f"{route} {body[:300]!r}: {problem}"
    if isinstance(answer, str):  # a stream ends with [DONE]
        assert answer.rstrip().endswith("data: [DONE]"), answer[-300:]


def test_the_server_answers_normally_after_the_fuzz(fuzzed_server):
    url, _ = fuzzed_server
    status, answer = send(url, "/v1/completions", json.dumps({"prompt": "x y", "max_tokens": 4}).encode())
    assert status == 200 and answer["usage"]["completion_tokens"] == 4
