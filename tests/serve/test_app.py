"""The OpenAI-compatible server on loopback, driven by the official `openai` client and raw HTTP:
completions identical to `generate`, streams that add up, statistics that add up, and a 4xx with
OpenAI's error body for every bad request, the server answering normally after each."""

import json
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import openai
import pytest
import uvicorn

import speccompile
from speccompile.errors import SpecCompileError
from speccompile.runtime.output import safe_prefix as _safe_prefix
from speccompile.serve.app import create_app
from speccompile.serve.limits import http_protocol

KEY = "test-key"


def http(method: str, url: str, content: bytes | None = None, headers: dict | None = None) -> tuple[int, dict]:
    """(status, JSON body) of a raw request: what the openai client would not send."""
    request = urllib.request.Request(url, data=content, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def start(app) -> tuple[uvicorn.Server, threading.Thread, str]:
    """A server for `app` on 127.0.0.1 at a free port, on a thread: (server, thread, base URL)."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(500):
        if server.started:
            break
        threading.Event().wait(0.01)
    return server, thread, f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"


def stop(server: uvicorn.Server, thread: threading.Thread) -> None:
    server.should_exit = True
    thread.join(10)


@pytest.fixture(scope="module")
def served(bundles):
    """(runtime, base URL) of a server with an API key."""
    runtime = speccompile.load(bundles("llama", "random"))
    server, thread, url = start(create_app(runtime, "tiny", api_key=KEY))
    yield runtime, url
    stop(server, thread)
    runtime.close()


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[1] + "/v1", api_key=KEY, max_retries=0, timeout=30)


def test_greedy_completions_are_generate_s_and_their_statistics_add_up(served, client):
    runtime, _ = served
    [expected] = runtime.generate(["x y x"], max_new_tokens=12, gamma=4, temperature=0.0)
    response = client.completions.create(model="tiny", prompt="x y x", max_tokens=12, temperature=0)
    assert response.choices[0].text == expected.text and response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == 12
    assert response.usage.prompt_tokens == len(runtime.tokenizer.encode("x y x"))
    extra = response.model_extra
    assert extra["timings"]["predicted_n"] == 12
    assert extra["timings"]["draft_n_accepted"] <= extra["timings"]["draft_n"]
    assert extra["speculative"]["acceptance_rate"] == pytest.approx(
        extra["timings"]["draft_n_accepted"] / max(1, extra["timings"]["draft_n"]))
    ids = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=8, temperature=0)
    assert ids.usage.prompt_tokens == 3
    assert ids.choices[0].text == runtime.generate([[5, 6, 7]], max_new_tokens=8, temperature=0)[0].text


def test_sampled_completions_with_a_seed_are_reproducible(client):
    def sample():
        return client.completions.create(model="tiny", prompt="x y", max_tokens=16, temperature=0.9, seed=7)

    assert sample().choices[0].text == sample().choices[0].text


def test_the_stream_adds_up_to_the_completion_and_ends_with_usage(client):
    whole = client.completions.create(model="tiny", prompt="x y x", max_tokens=20, temperature=0)
    chunks = list(client.completions.create(model="tiny", prompt="x y x", max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20


def test_a_stop_string_ends_the_text_before_it_streamed_or_not(served, client):
    runtime, _ = served
    [full] = runtime.generate(["x y x"], max_new_tokens=24, temperature=0)
    stop = full.text[5:7]  # a string the greedy text contains
    cut = full.text[: full.text.find(stop)]
    whole = client.completions.create(model="tiny", prompt="x y x", max_tokens=24, temperature=0, stop=[stop])
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="x y x", max_tokens=24, temperature=0, stop=[stop], stream=True))
    assert whole.choices[0].text == streamed == cut and whole.choices[0].finish_reason == "stop"


def test_held_back_text_is_what_a_stop_string_could_still_cut():
    assert _safe_prefix("abc de", ["de"]) == "abc "
    assert _safe_prefix("abc d", ["de"]) == "abc "  # "d" may begin "de"
    assert _safe_prefix("abc", ["de"]) == "abc" and _safe_prefix("abc", []) == "abc"


def test_models_and_health(served, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert http("GET", served[1] + "/health") == (200, {"status": "ok"})


BAD_REQUESTS = [
    ("malformed JSON", b"{not json", 400, None),
    ("wrong type", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("negative max_tokens", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("unknown field", {"prompt": "x", "colour": "blue"}, 400, "colour"),
    ("unsupported OpenAI field", {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("logprobs above 20", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("best_of other than n", {"prompt": "x", "best_of": 2}, 400, None),
    ("max_tokens 0 without echo", {"prompt": "x", "max_tokens": 0}, 400, None),
    ("presence_penalty out of range", {"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("logit_bias outside the vocabulary", {"prompt": "x", "logit_bias": {"999999": 1}}, 400, None),
    ("n of 17", {"prompt": "x", "n": 17}, 400, "n"),
    ("num_speculative_tokens not compiled", {"prompt": "x", "num_speculative_tokens": 3}, 400, None),
    ("unknown proposer", {"prompt": "x", "proposer": "oracle"}, 400, None),
    ("no prompt", {"max_tokens": 4}, 400, "prompt"),
    ("token id outside the vocabulary", {"prompt": [10**6], "max_tokens": 4}, 400, None),
    ("prompt too long", {"prompt": list(range(3, 200)), "max_tokens": 4}, 400, None),
    ("another model", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("a lone surrogate in the prompt", {"prompt": "x \ud800 y"}, 400, None),
]


@pytest.mark.parametrize("name, body, status, param", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_every_bad_request_gets_openai_s_error_and_the_server_goes_on(served, client, name, body, status, param):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    got, answer = http("POST", served[1] + "/v1/completions", content, headers)
    assert got == status, answer
    error = answer["error"]
    assert error["type"] == "invalid_request_error" and error["message"] and error["param"] == param
    if name == "prompt too long":
        assert "max sequence length 96" in error["message"]
    assert client.completions.create(model="tiny", prompt="x", max_tokens=2, temperature=0).usage.completion_tokens


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}], ids=["missing", "wrong"])
def test_the_api_key_is_required(served, headers):
    got, answer = http("POST", served[1] + "/v1/completions", json.dumps({"prompt": "x"}).encode(),
                       {**headers, "Content-Type": "application/json"})
    assert got == 401 and answer["error"]["code"] == "invalid_api_key"
    assert http("GET", served[1] + "/health")[0] == 200  # health needs no key


def scrape(url: str) -> dict[str, float]:
    """A Prometheus scrape: each sample's name with its labels -> value."""
    samples = {}
    for line in urllib.request.urlopen(url + "/metrics", timeout=30).read().decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def total(samples: dict, name: str, **labels) -> float:
    """The sum of a series' samples whose labels include these."""
    def matches(key):
        return key.split("{")[0] == name and all(f'{k}="{v}"' in key for k, v in labels.items())
    return sum(v for k, v in samples.items() if matches(k))


def test_metrics_are_vllm_s_and_count_what_the_requests_did(served, client):
    before = scrape(served[1])
    response = client.completions.create(model="tiny", prompt="x y", max_tokens=10, temperature=0,
                                         extra_body={"num_speculative_tokens": 4})  # drafting, paying or not
    after = scrape(served[1])

    def grew(name, **labels):
        return total(after, name, model_name="tiny", **labels) - total(before, name, model_name="tiny", **labels)

    timings, use = response.model_extra["timings"], response.usage
    assert grew("vllm:spec_decode_num_draft_tokens_total") == timings["draft_n"] > 0
    assert grew("vllm:spec_decode_num_accepted_tokens_total") == timings["draft_n_accepted"]
    assert grew("vllm:spec_decode_num_accepted_tokens_per_pos_total") == timings["draft_n_accepted"]
    assert grew("vllm:generation_tokens_total") == use.completion_tokens == 10
    assert grew("vllm:prompt_tokens_total") == use.prompt_tokens
    assert grew("vllm:request_success_total", finished_reason="length") == 1
    for histogram in ("e2e_request_latency_seconds", "request_queue_time_seconds", "time_to_first_token_seconds",
                      "request_time_per_output_token_seconds", "request_prompt_tokens"):
        assert grew(f"vllm:{histogram}_count") == 1, histogram
    # every delivery after the first is a gap: fewer than the tokens when drafts are kept
    gaps = grew("vllm:inter_token_latency_seconds_count")
    assert 1 <= gaps <= 9 and (gaps < 9) == (timings["draft_n_accepted"] > 0)
    assert total(after, "vllm:num_requests_running", model_name="tiny") == 0
    positions = {k.split('position="')[1].split('"')[0] for k in after
                 if k.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total")}
    assert "0" in positions and all(p.isdigit() for p in positions)  # vLLM's: from 0
    assert 'speccompile:spec_decode_gamma{model_name="tiny"}' in after


def test_a_client_that_leaves_mid_stream_cancels_its_request(bundles):
    """Each iteration is slowed to 20 ms, so that 80 tokens take over a second: the request ends
    cancelled soon after its client goes, not at its length."""
    runtime = speccompile.load(bundles("llama", "random"))
    real_step = runtime.scheduler.step

    def slow_step():
        threading.Event().wait(0.02)
        real_step()

    runtime.scheduler.step = slow_step
    server, thread, url = start(create_app(runtime, "tiny"))
    body = json.dumps({"prompt": "x", "max_tokens": 80, "temperature": 0, "stream": True}).encode()
    request = urllib.request.Request(url + "/v1/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    response = urllib.request.urlopen(request, timeout=30)
    assert response.readline().startswith(b"data: ")  # streaming has begun
    response.close()  # the client goes away
    def cancelled() -> float:
        return total(scrape(url), "vllm:request_success_total", model_name="tiny", finished_reason="abort")

    for _ in range(300):
        if cancelled():
            break
        threading.Event().wait(0.01)
    ended = cancelled()
    stop(server, thread)
    runtime.close()
    assert ended == 1 and runtime.scheduler.idle


def test_concurrent_clients_each_get_what_they_would_alone(served, client):
    """8 clients × 25 requests of varied lengths at once: every answer complete and identical to its
    request alone, and nothing left running."""
    runtime, _ = served
    prompts = [[5 + i, 6 + i, 7] for i in range(5)]
    alone = {(i, n): runtime.generate([prompts[i]], max_new_tokens=n, temperature=0)[0].text
             for i in range(5) for n in (3, 9, 17)}
    failures = []

    def worker(w: int):
        for k in range(25):
            i, n = (w + k) % 5, (3, 9, 17)[k % 3]
            try:
                got = client.completions.create(model="tiny", prompt=prompts[i], max_tokens=n, temperature=0)
                if got.choices[0].text != alone[i, n] or got.usage.completion_tokens != n:
                    failures.append((w, k, "different"))
            except Exception as e:  # noqa: BLE001 (every failure is collected and reported)
                failures.append((w, k, repr(e)))

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert failures == [] and runtime.scheduler.idle


def test_a_full_server_answers_429_with_retry_after_then_serves_again(bundles):
    """The engine is held before its next iteration, so that requests stay in flight: with no room
    to wait beyond the slots, the request after max_batch of them is refused, and once the engine
    moves on, served."""
    runtime = speccompile.load(bundles("llama", "random"))
    gate, real_step = threading.Event(), runtime.scheduler.step

    def held_step():
        gate.wait(30)
        real_step()

    runtime.scheduler.step = held_step
    server, thread, url = start(create_app(runtime, "tiny", max_waiting=0))
    body, headers = json.dumps({"prompt": "x", "max_tokens": 4}).encode(), {"Content-Type": "application/json"}
    answers = []
    clients = [threading.Thread(target=lambda: answers.append(http("POST", url + "/v1/completions", body, headers)))
               for _ in range(runtime.max_batch)]
    for client_thread in clients:
        client_thread.start()
    for _ in range(500):  # until all of them are in flight
        if total(scrape(url), "vllm:num_requests_waiting") == runtime.max_batch:
            break
        threading.Event().wait(0.01)
    request = urllib.request.Request(url + "/v1/completions", data=body, method="POST", headers=headers)
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 429 and refused.value.headers["Retry-After"] == "1"
    assert json.loads(refused.value.read())["error"]["code"] == "rate_limit_exceeded"
    gate.set()
    for client_thread in clients:
        client_thread.join(30)
    assert [status for status, _ in answers] == [200] * runtime.max_batch
    assert http("POST", url + "/v1/completions", body, headers)[0] == 200
    stop(server, thread)
    runtime.close()


@pytest.mark.slow
def test_sigterm_drains_the_request_in_flight_and_exits_cleanly(bundles):
    """`speccompile serve` in its own process: a streaming request is in flight when SIGTERM comes;
    it is answered to its end, and the process exits 0. At the default log level each request is
    logged (uvicorn's access log)."""
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "speccompile.cli", "serve", str(bundles("llama", "random")),
                               "--port", str(port)], stderr=subprocess.PIPE, stdout=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except OSError:
                threading.Event().wait(0.1)
        body = json.dumps({"prompt": "x", "max_tokens": 60, "temperature": 0, "stream": True}).encode()
        request = urllib.request.Request(url + "/v1/completions", data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        stream = urllib.request.urlopen(request, timeout=30)
        assert stream.readline().startswith(b"data: ")
        server.send_signal(signal.SIGTERM)
        rest = stream.read().decode()
        assert rest.rstrip().endswith("data: [DONE]")  # drained: the stream ran to its end
        assert server.wait(30) == 0, server.stderr.read().decode()[-2000:]
        assert '"POST /v1/completions HTTP/1.1" 200' in server.stdout.read().decode()
    finally:
        server.kill()


TEMPLATE = ("{% for m in messages %}{{ m['role'] }} says {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant says{% endif %}")


@pytest.fixture(scope="module")
def chat_served(checkpoints, tmp_path_factory):
    """(runtime, client) of a server over a bundle whose checkpoint's tokenizer has a chat template."""
    import shutil

    from speccompile.compiler.build import build_bundle

    root = tmp_path_factory.mktemp("chat")
    target = shutil.copytree(checkpoints("llama"), root / "target")
    config = json.loads((target / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    (target / "chat_template.jinja").unlink(missing_ok=True)
    runtime = speccompile.load(build_bundle(target, target, root / "bundle", gammas=[1, 4], max_seq=96, max_batch=2))
    server, thread, url = start(create_app(runtime, "tiny"))
    yield runtime, openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)
    stop(server, thread)
    runtime.close()


def test_chat_completions_render_the_template_and_stream_deltas(chat_served):
    runtime, chat = chat_served
    messages = [{"role": "system", "content": "x y"}, {"role": "user", "content": "x"}]
    rendered = "system says x y\nuser says x\nassistant says"
    [expected] = runtime.generate([runtime.tokenizer.encode(rendered, special_tokens=False)], max_new_tokens=10,
                                  temperature=0)
    reply = chat.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert reply.object == "chat.completion" and reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == expected.text and reply.usage.completion_tokens == 10
    assert reply.usage.prompt_tokens == len(runtime.tokenizer.encode(rendered, special_tokens=False))
    chunks = list(chat.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=10,
                                               temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text


def test_chat_without_a_template_is_a_clear_400(served):
    got, answer = http("POST", served[1] + "/v1/chat/completions",
                       json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(),
                       {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert got == 400 and "no chat template" in answer["error"]["message"] and answer["error"]["param"] == "messages"


def test_the_server_s_gamma_and_max_batch(bundles):
    runtime = speccompile.load(bundles("llama", "random"), max_batch=2)
    assert runtime.max_batch == runtime.scheduler.max_batch == 2
    server, thread, url = start(create_app(runtime, "tiny", gamma=1))
    status, reply = http("POST", url + "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 12}).encode(),
                         {"Content-Type": "application/json"})
    stop(server, thread)
    runtime.close()
    assert status == 200 and set(reply["speculative"]["gammas_used"]) <= {"0", "1"}
    with pytest.raises(SpecCompileError, match="max_batch must be 1..4"):
        speccompile.load(bundles("llama", "random"), max_batch=5)
    with pytest.raises(SpecCompileError, match="not one this bundle verifies at"):
        speccompile.load(bundles("llama", "random")).check_gamma(3)


def test_serve_refuses_a_bad_gamma_or_max_batch_before_it_listens(bundles):
    from click.testing import CliRunner

    from speccompile.cli import main

    bundle = str(bundles("llama", "random"))
    for args, message in ((["--gamma", "3"], "verifies at (1, 4"), (["--max-batch", "9"], "max_batch must be 1..4")):
        result = CliRunner().invoke(main, ["serve", bundle, "--port", "1", *args])
        assert result.exit_code == 1 and message in result.output, result.output


def test_a_medusa_bundle_serves_greedy_requests_and_refuses_sampling_with_a_400(bundles):
    runtime = speccompile.load(bundles("llama", "medusa"))
    server, thread, url = start(create_app(runtime, "medusa"))
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)
        [expected] = runtime.generate(["x y x"], max_new_tokens=8)
        response = client.completions.create(model="medusa", prompt="x y x", max_tokens=8, temperature=0)
        assert response.choices[0].text == expected.text
        with pytest.raises(openai.BadRequestError, match="greedy only"):
            client.completions.create(model="medusa", prompt="x y x", max_tokens=8)  # OpenAI's default: 1
    finally:
        stop(server, thread)
        runtime.close()


def test_n_samples_are_distinct_and_each_is_the_seeded_request_of_its_own(served, client):
    """vLLM's n: sample i of a seeded request is the request with seed + i, so each is reproducible."""
    def sampled(**options):
        return client.completions.create(model="tiny", prompt="x y", max_tokens=12, temperature=0.9, **options)

    four = sampled(n=4, seed=3)
    texts = [c.text for c in sorted(four.choices, key=lambda c: c.index)]
    assert [c.index for c in four.choices] == [0, 1, 2, 3] and len(set(texts)) == 4
    assert [c.text for c in sampled(n=4, seed=3).choices] == texts
    assert [sampled(seed=3 + i).choices[0].text for i in (0, 2)] == [texts[0], texts[2]]
    assert four.usage.prompt_tokens == len(served[0].tokenizer.encode("x y"))  # a prompt counts once
    assert four.usage.completion_tokens == 48
    streamed = {}
    for chunk in sampled(n=4, seed=3, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[i] for i in range(4)] == texts


def test_a_batch_of_prompts_gets_its_choices_in_order(served, client):
    runtime, _ = served
    expected = [r.text for r in runtime.generate(["x y", [5, 6, 7]], max_new_tokens=6, temperature=0)]
    reply = client.completions.create(model="tiny", prompt=["x y", "x y"], max_tokens=6, temperature=0, n=2)
    assert [c.text for c in reply.choices] == [expected[0]] * 4
    ids = client.completions.create(model="tiny", prompt=[[5, 6, 7], [5, 6, 7]], max_tokens=6, temperature=0)
    assert [c.text for c in ids.choices] == [expected[1]] * 2


def test_stop_token_ids_end_the_completion_with_the_token_kept(served, client):
    runtime, _ = served
    [full] = runtime.generate(["x y x"], max_new_tokens=12, temperature=0)
    stop_id = full.token_ids[4]
    first = full.token_ids.index(stop_id)
    reply = client.completions.create(model="tiny", prompt="x y x", max_tokens=12, temperature=0,
                                      extra_body={"stop_token_ids": [stop_id]})
    assert reply.choices[0].finish_reason == "stop" and reply.usage.completion_tokens == first + 1


def test_a_request_chooses_its_proposer_gamma_and_p_min(served, client):
    def speculative(**fields):
        reply = client.completions.create(model="tiny", prompt="x y x y x y", max_tokens=16, temperature=0,
                                          extra_body=fields)
        return reply.model_extra["speculative"]

    assert set(speculative(proposer="ngram")["by_proposer"]) <= {"ngram"}
    assert set(speculative(proposer="draft", num_speculative_tokens=1)["gammas_used"]) <= {"0", "1"}
    assert speculative(num_speculative_tokens=0)["mode"] == "autoregressive"
    assert speculative(proposer="draft", p_min=1.0)["acceptance_rate"] == 0  # nothing is that confident


def test_tokenize_detokenize_version_and_the_model_card(served, client):
    runtime, url = served
    headers = {"Content-Type": "application/json"}
    ids = runtime.tokenizer.encode("x y x")
    status, answer = http("POST", url + "/tokenize", json.dumps({"prompt": "x y x", "return_token_strs": True})
                          .encode(), headers)
    assert status == 200 and answer["tokens"] == ids and answer["count"] == len(ids)
    assert answer["max_model_len"] == runtime.max_seq and len(answer["token_strs"]) == len(ids)
    assert http("POST", url + "/detokenize", json.dumps({"tokens": ids}).encode(), headers) == (
        200, {"prompt": runtime.tokenizer.decode(ids)})
    assert http("POST", url + "/detokenize", json.dumps({"tokens": [10**6]}).encode(), headers)[0] == 400
    assert http("POST", url + "/tokenize", json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(),
                headers)[0] == 400  # no chat template here
    assert http("GET", url + "/version")[1] == {"version": speccompile.__version__}
    [card] = client.models.list().data
    assert card.model_extra["max_model_len"] == runtime.max_seq
    assert card.model_extra["speculative"]["gammas"] == runtime.gammas
    assert "draft" in card.model_extra["speculative"]["proposers"]
    assert client.models.retrieve("tiny").id == "tiny"


def test_python_m_speccompile_is_the_command_line_and_serve_takes_vllm_s_option_names():
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "speccompile", "serve", "--help"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0
    for option in ("--served-model-name", "--max-num-seqs", "--num-speculative-tokens", "--proposer", "--p-min",
                   "--chat-template", "--log-level", "--backend", "--disable-access-log"):
        assert option in result.stdout, option


def test_chat_takes_text_parts_the_developer_role_and_defaults_max_tokens_to_the_context_left(chat_served):
    runtime, chat = chat_served
    parts = [{"role": "developer", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]},
             {"role": "user", "content": "x"}]
    rendered = "system says x\ny\nuser says x\nassistant says"  # the template names no developer role
    prompt = runtime.tokenizer.encode(rendered, special_tokens=False)
    reply = chat.chat.completions.create(model="tiny", messages=parts, temperature=0, extra_body={"ignore_eos": True})
    assert reply.usage.prompt_tokens == len(prompt)
    reserved = max(runtime.gammas)  # γ auto, the default: its longest verification
    assert reply.usage.completion_tokens == runtime.max_seq - len(prompt) - reserved
    [expected] = runtime.generate([prompt], max_new_tokens=8, temperature=0)
    assert reply.choices[0].message.content.startswith(expected.text)


def test_chat_template_given_to_the_server_renders_where_the_checkpoint_has_none(bundles):
    runtime = speccompile.load(bundles("llama", "random"))
    server, thread, url = start(create_app(runtime, "tiny", chat_template=TEMPLATE))
    try:
        chat = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)
        reply = chat.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                             temperature=0)
        prompt = runtime.tokenizer.encode("user says x\nassistant says", special_tokens=False)
        assert reply.usage.prompt_tokens == len(prompt)
        assert reply.choices[0].message.content == runtime.generate([prompt], max_new_tokens=4)[0].text
    finally:
        stop(server, thread)
        runtime.close()


def test_logprobs_are_the_target_s_with_speculation_and_without(served, client):
    runtime, _ = served
    # at the server's γ: γ auto would choose plain decoding or not by this machine's timings, and a
    # verification's rows round differently from a decode step's (the rtol=1e-5 comparison below)
    [expected] = runtime.generate(["x y x"], max_new_tokens=10, temperature=0, logprobs=3, gamma=4)

    def completion(gamma):
        return client.completions.create(model="tiny", prompt="x y x", max_tokens=10, temperature=0, logprobs=3,
                                          extra_body={"num_speculative_tokens": gamma}).choices[0].logprobs

    spec, plain = completion(4), completion(0)
    # the same to float32 rounding: a verification multiplies γ+1 rows where a decode step multiplies one
    np.testing.assert_allclose(spec.token_logprobs, plain.token_logprobs, rtol=1e-5)
    assert spec.tokens == plain.tokens
    np.testing.assert_allclose(spec.token_logprobs, [e[0] for e in expected.logprobs], rtol=1e-6)
    assert spec.tokens == runtime.tokenizer.token_texts(expected.token_ids)
    assert all(3 <= len(top) <= 4 and max(top.values()) >= chosen - 1e-6  # the 3 best and the chosen token
               for top, chosen in zip(spec.top_logprobs, spec.token_logprobs))
    assert spec.text_offset[0] == 0 and spec.text_offset == sorted(spec.text_offset)


def test_echo_with_logprobs_scores_the_prompt_as_hf_does(served, client, checkpoints):
    """What lm-evaluation-harness's log-likelihood asks: echo, logprobs=1, max_tokens 1 (or 0)."""
    import torch
    import transformers

    runtime, _ = served
    prompt = runtime.tokenizer.encode("x y x y z")
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoints("llama")).eval()
    with torch.no_grad():
        log_p = torch.log_softmax(model(torch.tensor([prompt])).logits[0].double(), -1).numpy()
    for max_tokens in (1, 0):
        reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                          echo=True, logprobs=1)
        scored = reply.choices[0].logprobs
        assert reply.choices[0].text.startswith(runtime.tokenizer.decode(prompt))
        assert len(scored.token_logprobs) == len(prompt) + max_tokens and scored.token_logprobs[0] is None
        np.testing.assert_allclose(scored.token_logprobs[1 : len(prompt)],
                                   log_p[np.arange(len(prompt) - 1), prompt[1:]], atol=2e-5)
        greedy = [max(top.values()) for top in scored.top_logprobs[1 : len(prompt)]]
        np.testing.assert_allclose(greedy, log_p[: len(prompt) - 1].max(-1), atol=2e-5)
    assert reply.usage.completion_tokens == 0


def test_chat_logprobs_come_in_openai_s_chat_shape(chat_served):
    runtime, chat = chat_served
    reply = chat.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=6,
                                         temperature=0, logprobs=True, top_logprobs=2)
    content = reply.choices[0].logprobs.content
    assert len(content) == 6 and all(len(entry.top_logprobs) == 2 for entry in content)
    assert all(entry.top_logprobs[0].logprob >= entry.logprob - 1e-6 for entry in content)
    streamed = [entry for chunk in chat.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=6, temperature=0, logprobs=True,
        top_logprobs=2, stream=True) if chunk.choices and chunk.choices[0].logprobs
        for entry in chunk.choices[0].logprobs.content]
    # the same tokens' log-probabilities; γ auto may verify one request's token and step the other's:
    # the two graphs agree to float32 rounding
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-5)


def test_the_processors_over_http_are_the_python_api_s(served, client):
    runtime, _ = served
    controls = {"presence_penalty": 1.0, "frequency_penalty": 0.5, "repetition_penalty": 1.3, "min_tokens": 3}
    bias = {"7": 3.0}
    [expected] = runtime.generate(["x y x"], max_new_tokens=12, temperature=0, logit_bias={7: 3.0}, **controls)
    reply = client.completions.create(model="tiny", prompt="x y x", max_tokens=12, temperature=0, logit_bias=bias,
                                      presence_penalty=1.0, frequency_penalty=0.5,
                                      extra_body={"repetition_penalty": 1.3, "min_tokens": 3})
    [plain] = runtime.generate(["x y x"], max_new_tokens=12, temperature=0)
    assert reply.choices[0].text == expected.text != plain.text


def test_under_load_the_per_position_acceptance_adds_up_to_the_requests_own(served):
    """Concurrent streams through one server: the scrape's per-position counters grow by exactly the
    requests' own per-position statistics, under vLLM's names and labels."""
    import concurrent.futures

    before = scrape(served[1])
    client = openai.OpenAI(base_url=served[1] + "/v1", api_key=KEY, max_retries=0, timeout=60)

    def one(i):
        return client.completions.create(model="tiny", prompt="x y " * (1 + i % 3), max_tokens=12 + i, temperature=0,
                                          extra_body={"proposer": "draft", "num_speculative_tokens": 4})

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        replies = list(pool.map(one, range(6)))
    after = scrape(served[1])
    kept = [r.model_extra["speculative"]["accepted_by_position"] for r in replies]
    for position in range(max(map(len, kept))):
        grew = (total(after, "vllm:spec_decode_num_accepted_tokens_per_pos_total", model_name="tiny",
                      position=str(position))
                - total(before, "vllm:spec_decode_num_accepted_tokens_per_pos_total", model_name="tiny",
                        position=str(position)))
        assert grew == sum(k[position] for k in kept if position < len(k)), position
    drafted = sum(r.model_extra["timings"]["draft_n"] for r in replies)
    assert total(after, "vllm:spec_decode_num_draft_tokens_total") - total(
        before, "vllm:spec_decode_num_draft_tokens_total") == drafted > 0
    assert total(after, "vllm:request_success_total", model_name="tiny") - total(
        before, "vllm:request_success_total", model_name="tiny") == 6


def test_continuous_usage_stats_count_the_tokens_delivered_so_far(client):
    chunks = list(client.completions.create(model="tiny", prompt="x y x", max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 12 and chunks[-1].usage.completion_tokens == 12


def read_events(url: str, body: dict) -> list:
    """A streamed completion's events, parsed (the [DONE] marker as the string)."""
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                     method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        lines = [line[6:] for line in response.read().decode().splitlines() if line.startswith("data: ")]
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


def test_a_failing_backend_ends_only_the_requests_in_flight_and_health_tells_the_truth(bundles):
    runtime = speccompile.load(bundles("llama", "random"), max_batch=4)
    failing = {"batch of four": True, "always": False}
    real_verify = runtime.target.verify

    def verify(tokens, *args, **kwargs):
        if failing["batch of four"] and len(tokens) < 4:
            time.sleep(0.05)  # hold early iterations: on a loaded machine a client may connect only later
        if (failing["batch of four"] and len(tokens) == 4) or failing["always"]:
            failing["batch of four"] = False  # the first verification of all four streams fails, once
            raise RuntimeError("device lost")
        return real_verify(tokens, *args, **kwargs)

    runtime.target.verify = verify
    server, thread, url = start(create_app(runtime, "tiny"))
    body = {"prompt": "x y", "max_tokens": 40, "temperature": 0, "num_speculative_tokens": 4}
    try:
        streams = []
        clients = [threading.Thread(target=lambda: streams.append(read_events(url, body))) for _ in range(4)]
        for client_thread in clients:
            client_thread.start()
        for client_thread in clients:
            client_thread.join(60)
        assert not failing["batch of four"]  # the failure happened
        for events in streams:  # each ended with an error event naming the failure, then [DONE]
            assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_error"
            assert "device lost" in events[-2]["error"]["message"]
        assert http("GET", url + "/health") == (200, {"status": "ok"})
        status, reply = http("POST", url + "/v1/completions", json.dumps(body).encode(),
                             {"Content-Type": "application/json"})
        assert status == 200 and reply["usage"]["completion_tokens"] == 40  # the server goes on
        failing["always"] = True  # a backend that keeps failing
        for _ in range(3):
            status, reply = http("POST", url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
            assert status == 500 and reply["error"]["type"] == "server_error"
        status, health = http("GET", url + "/health")
        assert status == 503 and health["failures_in_a_row"] >= 3 and "device lost" in health["last_error"]
        failing["always"] = False
        assert http("POST", url + "/v1/completions", json.dumps(body).encode(),
                    {"Content-Type": "application/json"})[0] == 200
        assert http("GET", url + "/health")[0] == 200  # one good iteration: healthy again
    finally:
        stop(server, thread)
        runtime.close()


def test_a_body_past_the_limit_is_a_413_whether_declared_or_chunked(served):
    from http.client import HTTPConnection

    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    huge = json.dumps({"prompt": "x" * (10 << 20)}).encode()
    status, answer = http("POST", served[1] + "/v1/completions", huge, headers)
    assert status == 413 and answer["error"]["code"] == "request_too_large"
    host, port = served[1].removeprefix("http://").split(":")
    connection = HTTPConnection(host, int(port), timeout=30)
    connection.request("POST", "/v1/completions", body=iter([huge[i : i + 65536] for i in range(0, len(huge), 65536)]),
                       headers=headers, encode_chunked=True)
    response = connection.getresponse()
    assert response.status == 413 and json.loads(response.read())["error"]["code"] == "request_too_large"
    connection.close()
    assert http("GET", served[1] + "/health")[0] == 200


def test_idle_and_slow_clients_hold_no_engine_slot(bundles):
    """A client that connects and sends nothing is disconnected; one that reads its stream a byte at a
    time does not keep its request in the engine: the engine finishes it and serves others meanwhile."""
    import socket

    runtime = speccompile.load(bundles("llama", "random"))
    config = uvicorn.Config(create_app(runtime, "tiny"), host="127.0.0.1", port=0, log_level="warning",
                            timeout_keep_alive=1, http=http_protocol())
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        threading.Event().wait(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        idle = socket.create_connection(("127.0.0.1", port), timeout=10)
        slow = socket.create_connection(("127.0.0.1", port), timeout=10)
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        body = json.dumps({"prompt": "x y", "max_tokens": 60, "temperature": 0, "stream": True}).encode()
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert slow.recv(1)  # the stream began; the client reads no more for now
        for _ in range(500):
            if runtime.scheduler.idle:
                break
            threading.Event().wait(0.01)
        assert runtime.scheduler.idle  # finished in the engine while its client sleeps
        status, _ = http("POST", f"http://127.0.0.1:{port}/v1/completions",
                         json.dumps({"prompt": "x", "max_tokens": 4}).encode(), {"Content-Type": "application/json"})
        assert status == 200
        idle.settimeout(10)
        assert idle.recv(1) == b""  # the silent client was disconnected
        rest = b""
        while not rest.endswith(b"data: [DONE]\r\n\r\n0\r\n\r\n") and len(rest) < 1 << 20:
            chunk = slow.recv(4096)
            if not chunk:
                break
            rest += chunk
        assert b"data: [DONE]" in rest  # and it still gets its whole stream when it reads
    finally:
        server.should_exit = True
        thread.join(10)
        runtime.close()


def test_values_at_the_edges_of_their_types_never_reach_the_engine_as_failures(served):
    """Found by fuzzing: a top_k or min_tokens past int64 used to fail the engine's iteration (and every
    request in it); a temperature float32 rounds to 0 is greedy, as vLLM's below 1e-5."""
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    for edge in ({"top_k": 2**70, "temperature": 0.8, "seed": -3}, {"min_tokens": 2**70, "max_tokens": 4},
                 {"temperature": 1e-300, "seed": 2**64 - 1}):
        status, reply = http("POST", served[1] + "/v1/completions",
                             json.dumps({"prompt": "x y", "max_tokens": 4, **edge}).encode(), headers)
        assert status == 200 and reply["usage"]["completion_tokens"] == 4, (edge, reply)
    assert served[0].health()["failures_in_a_row"] == 0


def test_a_chat_whose_rendered_text_no_tokenizer_takes_is_a_400(chat_served):
    """A lone surrogate (JSON can carry one) in a message renders into the prompt's text: a 400 naming
    it, not an error escaping the route (found by tools/fuzz_serve.py)."""
    _, chat = chat_served
    body = b'{"messages": [{"role": "user", "content": "x \\ud800 y"}], "max_tokens": 2}'
    status, answer = http("POST", str(chat.base_url).rstrip("/") + "/chat/completions", body,
                          {"Content-Type": "application/json"})
    assert status == 400 and "not valid Unicode" in answer["error"]["message"], answer
    assert answer["error"]["param"] == "messages"
