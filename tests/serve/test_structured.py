"""Structured output over HTTP, through the `openai` client: response_format (json_schema, json_object)
on both routes, streamed and not, equal to the Python API's constrained generation and valid against
the schema; vLLM's structured_outputs and guided_json mean the same; a schema that does not compile,
or two constraints at once, is a 400 naming the problem, and the server goes on."""

import json

import jsonschema
import openai
import pytest

import speccompile
from speccompile.serve.app import create_app
from tests.serve.test_app import TEMPLATE, start, stop

# bounded everywhere, so that even a random model's output closes the object within max_tokens
SCHEMA = {"type": "object", "properties": {"size": {"enum": ["small", "medium", "large"]},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["size", "count", "ok"]}
FORMAT = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "x y"}]


@pytest.fixture(scope="module")
def served(bundles):
    runtime = speccompile.load(bundles("llama", "random"))
    server, thread, url = start(create_app(runtime, "tiny", chat_template=TEMPLATE))
    yield runtime, openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    stop(server, thread)
    runtime.close()


def rendered(runtime, messages) -> list[int]:
    text = "".join(f"{m['role']} says {m['content']}\n" for m in messages) + "assistant says"
    return runtime.tokenizer.encode(text, special_tokens=False)


def test_completions_with_a_json_schema_are_the_python_api_s_and_validate(served):
    runtime, client = served
    [expected] = runtime.generate(["x y x"], max_new_tokens=60, temperature=0, json_schema=SCHEMA)
    reply = client.completions.create(model="tiny", prompt="x y x", max_tokens=60, temperature=0,
                                      extra_body={"response_format": FORMAT})
    assert reply.choices[0].text == expected.text and reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].text), SCHEMA)
    [unconstrained] = runtime.generate(["x y x"], max_new_tokens=60, temperature=0)
    assert unconstrained.text != expected.text


def test_chat_with_a_json_schema_streamed_and_not(served):
    runtime, client = served
    [expected] = runtime.generate([rendered(runtime, MESSAGES)], max_new_tokens=60, temperature=0, json_schema=SCHEMA)
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=60, temperature=0,
                                           response_format=FORMAT)
    content = reply.choices[0].message.content
    assert content == expected.text and reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(content), SCHEMA)
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=60, temperature=0,
                                                 response_format=FORMAT, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == content


def test_sampled_constrained_chats_validate_every_time(served):
    _, client = served
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=60, temperature=1.0, seed=3,
                                           n=4, response_format=FORMAT)
    for choice in reply.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_vllm_s_names_for_the_same_constraint_give_the_same_text(served):
    _, client = served
    texts = [client.completions.create(model="tiny", prompt="x y x", max_tokens=60, temperature=0,
                                       extra_body=extra).choices[0].text
             for extra in ({"response_format": FORMAT}, {"structured_outputs": {"json": SCHEMA}},
                           {"guided_json": SCHEMA})]
    assert texts[0] == texts[1] == texts[2]
    choice = client.completions.create(model="tiny", prompt="x", max_tokens=8, temperature=0,
                                       extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}})
    assert choice.choices[0].text in ("alpha", "beta")
    anything = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=30, temperature=0,
                                              response_format={"type": "json_object"})
    assert anything.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("extra, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "json_schema does not compile"),
    ({"response_format": {"type": "json_schema"}}, "needs json_schema"),
    ({"guided_regex": "(unclosed"}, "regex does not compile"),
    ({"response_format": FORMAT, "guided_regex": "a"}, "give one of response_format and guided_"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "give one constraint"),
])
def test_a_constraint_that_cannot_be_used_is_a_400_naming_it(served, extra, message):
    _, client = served
    with pytest.raises(openai.BadRequestError, match=message):
        client.completions.create(model="tiny", prompt="x", max_tokens=4, extra_body=extra)
    assert client.completions.create(model="tiny", prompt="x", max_tokens=2).usage.completion_tokens == 2


def test_a_structured_outputs_field_that_asks_for_nothing_constrains_nothing(served):
    """{"json_object": false} and nulls (what a client fills in by default): plain output, not an error."""
    _, client = served
    nothing = {"structured_outputs": {"json_object": False, "regex": None, "json": None}}
    asked = client.completions.create(model="tiny", prompt="x y x", max_tokens=8, temperature=0, extra_body=nothing)
    plain = client.completions.create(model="tiny", prompt="x y x", max_tokens=8, temperature=0)
    assert asked.choices[0].text == plain.choices[0].text
