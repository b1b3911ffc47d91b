"""One request spec on every surface: each option of GenerationParams reaches the engine's request
from the Python API (`submit`, `generate`) and from both routes (completions, chat), with the value
asked; and one seeding rule, so the same seed gives the same tokens whichever surface asks.

A new option is a field of GenerationParams; this test lists a value for each field, and fails when a
field has none (a field added without saying how it reaches every surface) or when it does not arrive.
"""

import json

import pytest

import speccompile
from speccompile.core.grammar import Constraint
from speccompile.core.params import FIELD_ORDER, AcceptanceRule, GenerationParams, Mode, SamplingRule
from speccompile.serve.app import create_app
from tests.serve.test_app import TEMPLATE, http, start, stop

# field -> (a value other than the default, valid on the test bundle; the body asking for it, or None
# where the routes do not take it; the chat body where it differs from completions')
VALUES = {
    "max_new_tokens": (3, {"max_tokens": 3}),
    "temperature": (0.5, {"temperature": 0.5}),
    "top_k": (5, {"top_k": 5}),
    "top_p": (0.9, {"top_p": 0.9}),
    "min_p": (0.05, {"min_p": 0.05}),
    "seed": (11, {"seed": 11}),
    "stop": (("zz",), {"stop": ["zz"]}),
    "stop_token_ids": ((7,), {"stop_token_ids": [7]}),
    "ignore_eos": (True, {"ignore_eos": True}),
    "min_tokens": (2, {"min_tokens": 2}),
    "presence_penalty": (0.5, {"presence_penalty": 0.5}),
    "frequency_penalty": (0.25, {"frequency_penalty": 0.25}),
    "repetition_penalty": (1.2, {"repetition_penalty": 1.2}),
    "logit_bias": (((5, 1.5),), {"logit_bias": {"5": 1.5}}),
    "logprobs": (2, {"logprobs": 2}, {"logprobs": True, "top_logprobs": 2}),
    "prompt_logprobs": (1, {"prompt_logprobs": 1}, None),  # chat reports no prompt log-probabilities
    "gamma": (4, {"num_speculative_tokens": 4}),
    "mode": (Mode.SPECULATIVE, None),  # vLLM's routes have no mode either: γ 0 asks for plain decoding
    "proposer": ("ngram", {"proposer": "ngram"}),
    "p_min": (0.2, {"p_min": 0.2}),
    "sampling_rule": (SamplingRule.REJECTION, {"sampling_rule": "rejection"}),
    "acceptance": (AcceptanceRule.TYPICAL, None),  # Medusa bundles only (tests/runtime/test_medusa.py)
    "constraint": (Constraint.of(regex="[a-z]+"), {"structured_outputs": {"regex": "[a-z]+"}}),
    "n": (2, {"n": 2}),
}
PROMPT = "x y x"


def test_every_field_has_a_value_here():
    assert set(VALUES) == set(FIELD_ORDER)


@pytest.fixture(scope="module")
def runtime(bundles):
    with speccompile.load(bundles("llama", "random")) as runtime:
        yield runtime


@pytest.fixture(scope="module")
def served(runtime):
    """(base URL, the specs of the requests the routes submitted) of a server over `runtime`."""
    seen = []
    submit_async = runtime.submit_async

    def spy(*args, **kwargs):
        handle = submit_async(*args, **kwargs)
        seen.append(handle.request.spec)
        return handle

    runtime.submit_async = spy
    server, thread, url = start(create_app(runtime, "tiny", chat_template=TEMPLATE))
    yield url, seen
    stop(server, thread)
    del runtime.submit_async


def route(url: str, chat: bool, body: dict) -> tuple[int, dict]:
    if chat:
        body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3} | body
    else:
        body = {"prompt": PROMPT, "max_tokens": 3} | body
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return http("POST", url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})


@pytest.mark.parametrize("name", [n for n in FIELD_ORDER if n != "acceptance"])
def test_an_option_reaches_the_engine_from_the_python_api(runtime, name):
    value = VALUES[name][0]
    assert getattr(runtime.submit(PROMPT, **{name: value}).request.spec, name) == value
    assert getattr(runtime.submit(PROMPT, GenerationParams.of(**{name: value})).request.spec, name) == value
    results = runtime.generate([PROMPT], **{name: value})
    assert len(results) == (value if name == "n" else 1)


def test_typical_acceptance_reaches_the_engine_s_check(runtime):
    with pytest.raises(speccompile.SpecCompileError, match="typical acceptance needs a bundle built with --medusa"):
        runtime.submit(PROMPT, acceptance="typical")


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("name", [n for n in FIELD_ORDER if VALUES[n][1] is not None])
def test_an_option_reaches_the_engine_from_both_routes(served, name, chat):
    url, seen = served
    value, body, *chat_body = VALUES[name]
    body = chat_body[0] if chat and chat_body else body
    if body is None:
        pytest.skip(f"the chat route does not take {name}")
    del seen[:]
    status, answer = route(url, chat, body)
    assert status == 200, answer
    assert seen and getattr(seen[0], name) == value


def test_the_same_seed_gives_the_same_tokens_on_every_surface(runtime, served):
    """generate([p], seed=s), submit(p, seed=s) and the server's seed s; and sample i of n is seed + i."""
    options = dict(max_new_tokens=12, temperature=0.9, seed=21)
    [generated] = runtime.generate([PROMPT], **options)
    submitted = runtime.submit(PROMPT, **options).result()
    status, answer = route(served[0], False, {"max_tokens": 12, "temperature": 0.9, "seed": 21, "n": 3})
    assert status == 200, answer
    texts = [choice["text"] for choice in answer["choices"]]
    assert generated.token_ids == submitted.token_ids and generated.text == submitted.text == texts[0]
    samples = runtime.generate([PROMPT], n=3, **options)
    assert [s.text for s in samples] == texts
    assert samples[2].token_ids == runtime.submit(PROMPT, **(options | {"seed": 23})).result().token_ids
    assert len(set(texts)) > 1  # each sample its own stream
