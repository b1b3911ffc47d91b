"""Requests generated from the server's own OpenAPI schema, with values nobody wrote by hand: each
field of its declared type (edges and far beyond its bounds, NaN and infinities, unicode including
lone surrogates, token ids outside the vocabulary), of another type, missing, or beside unknown
fields; and bodies that are deeply nested or not JSON at all. Shared by the suite's fuzz test (a few
hundred examples per route) and tools/fuzz_serve.py (tens of thousands).

Every answer must be a 2xx, or a 4xx with OpenAI's error body: never a 5xx, never a hang.
"""

import json
import math

from hypothesis import strategies as st

ROUTES = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
MODEL = "tiny"  # the served model's name, which valid bodies ask for
OK = (200,)
REFUSED = (400, 401, 404, 413, 429)  # a 422 would mean a validation error escaped OpenAI's shape
# fields whose full range would make an example slow, not more telling: kept small most of the time
SMALL = {"max_tokens": 48, "max_completion_tokens": 48, "n": 3, "min_tokens": 48, "logprobs": 20, "top_logprobs": 20,
         "prompt_logprobs": 20, "best_of": 3}

text = st.text(st.characters(codec=None, exclude_categories=()), max_size=40)  # surrogates included
numbers = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-(2**70), 2**70),
                    st.sampled_from([0, -1, 1, 2, 0.5, 1e-300, 1e300]))
json_values = st.recursive(st.one_of(st.none(), st.booleans(), numbers, text),
                           lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                   st.dictionaries(text, inner, max_size=4)), max_leaves=12)


def resolve(schema, components: dict) -> dict:
    if not isinstance(schema, dict):  # `true`: anything
        return {}
    while "$ref" in schema:
        schema = components[schema["$ref"].split("/")[-1]]
    return schema


def value_of(schema: dict, components: dict, name: str = "", depth: int = 0, valid: bool = False):
    """A value of the schema's type: within its bounds when `valid`, else mostly near them and
    sometimes far outside."""
    schema = resolve(schema, components)
    if "anyOf" in schema:
        return st.one_of(*(value_of(s, components, name, depth, valid) for s in schema["anyOf"]))
    if "enum" in schema or "const" in schema:
        named = st.sampled_from(schema.get("enum", [schema.get("const")]))
        return named if valid else st.one_of(named, text)
    if name == "model" and valid:
        return st.sampled_from([MODEL, None])
    kind = schema.get("type")
    if kind == "integer":
        low = int(schema.get("minimum", schema.get("exclusiveMinimum", -6) + 1))
        high = int(min(schema.get("maximum", 10**6), SMALL.get(name, 10**6)))
        inside = st.integers(low, max(low, high if name not in ("prompt", "tokens") else 400))
        if valid:
            return inside
        return st.one_of(inside, st.integers(-(2**70), 2**70), st.sampled_from([-1, 0, 1, 2**31, 2**63, 2**64]))
    if kind == "number":
        low = schema.get("minimum", schema.get("exclusiveMinimum", -1e3))
        high = schema.get("maximum", 1e3)
        inside = st.floats(low, high, allow_nan=False, exclude_min="exclusiveMinimum" in schema)
        return inside if valid else st.one_of(inside, numbers)
    if kind == "string":
        words = st.sampled_from(["x y x", "x", "auto", "draft", "ngram", "suffix", "user", "coupled", "rejection",
                                 "tiny", "\U0001f600 x"])
        return st.one_of(words, text) if valid else st.one_of(text, words, st.sampled_from(["", "\u0000"]))
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        items = schema.get("items", {})
        size = 6 if name in ("prompt", "tokens", "messages") else 3
        element = value_of(items, components, name, depth + 1, valid) if depth < 3 else json_values
        return st.lists(element, min_size=1 if valid else 0, max_size=size)
    if kind == "object" or "properties" in schema:
        if "properties" not in schema:
            values = value_of(schema.get("additionalProperties", {}), components, name, depth + 1, valid)
            keys = st.integers(0, 400).map(str) if valid else text | st.integers(-10, 10**7).map(str)
            return st.dictionaries(keys, values, max_size=3)
        return body_of(schema, components, depth + 1, valid)
    return json_values


def body_of(schema: dict, components: dict, depth: int = 0, valid: bool | None = None):
    """An object of the schema's properties: the required ones present and a few others. A third of
    the bodies are valid (each value of its type, in its bounds: they reach the engine); the others
    have values far out of bounds, of another type, missing fields or an unknown one."""
    if valid is None:
        return st.one_of(sparse(schema, components, depth), body_of(schema, components, depth, True),
                         body_of(schema, components, depth, False), body_of(schema, components, depth, False))
    schema = resolve(schema, components)
    properties, required = schema.get("properties", {}), set(schema.get("required", []))

    def field(name, sub):
        typed = value_of(sub, components, name, depth, valid) if depth < 4 else json_values
        return typed if valid else st.one_of(typed, typed, typed, json_values)

    optional = {name: field(name, sub) for name, sub in properties.items() if name not in required}
    present = st.fixed_dictionaries({name: field(name, sub) for name, sub in properties.items() if name in required},
                                    optional={**optional, **({} if valid else {"unknown_field": json_values})})
    return present if valid else st.one_of(present, st.dictionaries(text, json_values, max_size=3))


def sparse(schema: dict, components: dict, depth: int = 0):
    """A valid object of the required properties and at most three others: what most clients send,
    and what reaches the engine's deepest paths (sampling, seeds, processors, logprobs)."""
    schema = resolve(schema, components)
    properties, required = schema.get("properties", {}), set(schema.get("required", []))
    optional = sorted(set(properties) - required)

    @st.composite
    def build(draw):
        names = sorted(required) + draw(st.lists(st.sampled_from(optional), max_size=3, unique=True))
        return {name: draw(value_of(properties[name], components, name, depth, True)) for name in names}

    return build()


def requests(openapi: dict):
    """(route, body bytes) pairs for the routes above, from the schema of each route's request body."""
    components = openapi["components"]["schemas"]
    routes = []
    for route in ROUTES:
        content = openapi["paths"][route]["post"]["requestBody"]["content"]["application/json"]["schema"]
        routes.append(st.tuples(st.just(route), body_of(content, components).map(encode)))
    broken = st.sampled_from([b"", b"{", b"[]", b"null", b"\xff\xfe", b"{" * 5000 + b"}" * 5000,
                              b"[" * 100000 + b"]" * 100000, json.dumps({"prompt": "x" * (5 << 20)}).encode()])
    return st.one_of(*routes, st.tuples(st.sampled_from(ROUTES), broken))


def encode(body: dict) -> bytes:
    """JSON as a lenient client writes it: NaN and infinities as bare words, lone surrogates escaped."""
    return json.dumps(body, allow_nan=True).encode()


def acceptable(status: int, answer) -> str | None:
    """Why an answer is wrong (None: it is right)."""
    if status in OK:
        return None
    if status not in REFUSED:
        return f"status {status}"
    error = answer.get("error") if isinstance(answer, dict) else None
    if not isinstance(error, dict) or not isinstance(error.get("message"), str) or not error["message"]:
        return f"a {status} without OpenAI's error body: {str(answer)[:200]}"
    return None


def finite(value) -> bool:
    return not isinstance(value, float) or math.isfinite(value)
