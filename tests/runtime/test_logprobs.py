"""Log-probabilities are the target's own, identical with speculation and without, and equal to
HF's; the logits processors (penalties, logit_bias, min_tokens) keep speculative output identical to
autoregressive decoding and to HF's generate with the same processors."""

import numpy as np
import pytest
import torch
import transformers

import speccompile
from speccompile.core.sampling import transform
from speccompile.errors import SpecCompileError
from tests.conftest import FAMILIES

PROMPT_TEXT = "x y x y z"


@pytest.fixture(scope="module")
def hf_models(checkpoints):
    made = {}

    def get(family):
        if family not in made:
            made[family] = transformers.AutoModelForCausalLM.from_pretrained(checkpoints(family)).eval()
        return made[family]
    return get


def hf_log_softmax(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1).numpy()


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_logprobs_are_hf_s_and_the_same_at_every_gamma(family, bundles, hf_models):
    runtime = speccompile.load(bundles(family))  # a draft that agrees: drafted positions are kept
    prompt = runtime.tokenizer.encode(PROMPT_TEXT)
    runs = {gamma: runtime.generate([prompt], max_new_tokens=12, gamma=gamma, logprobs=5, prompt_logprobs=3)[0]
            for gamma in (0, 1, 4)}
    runtime.close()
    plain = runs[0]
    assert runs[4].stats.accepted_tokens > 0  # positions after the first of a verification are reported
    log_p = hf_log_softmax(hf_models(family), prompt + plain.token_ids)
    n = len(prompt)
    for result in runs.values():
        assert result.token_ids == plain.token_ids
        chosen = np.array([entry[0] for entry in result.logprobs])
        np.testing.assert_allclose(chosen, log_p[np.arange(n - 1, n - 1 + 12), plain.token_ids], atol=2e-5)
        for position, (_, top_ids, top_values) in enumerate(result.logprobs):
            expected = np.argsort(-log_p[n - 1 + position])[:5]
            assert top_ids == expected.tolist()
            np.testing.assert_allclose(top_values, log_p[n - 1 + position, expected], atol=2e-5)
        scores = np.array([entry[0] for entry in result.prompt_logprobs])  # the prompt's, after its first token
        np.testing.assert_allclose(scores, log_p[np.arange(n - 1), prompt[1:]], atol=2e-5)
        assert all(len(entry[1]) == 3 for entry in result.prompt_logprobs)


def test_sampled_logprobs_are_of_the_distribution_drawn_from(bundles, hf_models):
    """Temperature and top-k applied: the log of the transformed distribution, -inf outside the top-k."""
    runtime = speccompile.load(bundles("llama"))
    prompt = runtime.tokenizer.encode(PROMPT_TEXT)
    options = {"max_new_tokens": 10, "temperature": 0.7, "top_k": 8, "seed": 5, "logprobs": 8}
    plain, spec = (runtime.generate([prompt], gamma=gamma, **options)[0] for gamma in (0, 4))
    runtime.close()
    assert spec.token_ids == plain.token_ids  # the coupled rule: a seed fixes the tokens
    with torch.no_grad():
        logits = hf_models("llama")(torch.tensor([prompt + plain.token_ids])).logits[0].numpy()
    n = len(prompt)
    expected = np.log(transform(logits[n - 1 : n - 1 + 10], 0.7, 8).astype(np.float64))
    for result in (plain, spec):
        chosen = [entry[0] for entry in result.logprobs]
        np.testing.assert_allclose(chosen, expected[np.arange(10), plain.token_ids], atol=1e-4)
        assert all(np.isfinite(entry[2]).all() for entry in result.logprobs)  # the top 8 are the kept 8


class OpenAIPenalties(transformers.LogitsProcessor):
    """OpenAI's presence and frequency penalties over the generated tokens (HF has none)."""

    def __init__(self, prompt_length: int, presence: float, frequency: float):
        self.start, self.presence, self.frequency = prompt_length, presence, frequency

    def __call__(self, input_ids, scores):
        for row, ids in enumerate(input_ids[:, self.start :]):
            counts = torch.bincount(ids, minlength=scores.shape[1]).to(scores.dtype)
            scores[row] -= self.frequency * counts + self.presence * (counts > 0).to(scores.dtype)
        return scores


def hf_greedy(model, prompt: list[int], new: int, **options) -> list[int]:
    processors = options.pop("processors", None)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, logits_processor=processors,
                         pad_token_id=2, **options)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_processors_keep_speculation_identical_to_autoregressive_and_to_hf(family, bundles, hf_models):
    runtime = speccompile.load(bundles(family))
    model = hf_models(family)
    prompt = runtime.tokenizer.encode(PROMPT_TEXT)
    plain_text = hf_greedy(model, prompt, 16)
    eos = min(runtime.tokenizer.eos_token_ids)
    cases = [  # (ours, HF's generate arguments)
        ({"repetition_penalty": 1.8}, {"repetition_penalty": 1.8}),
        ({"logit_bias": {plain_text[3]: -100, 7: 4.0}}, {"sequence_bias": {(plain_text[3],): -100.0, (7,): 4.0}}),
        ({"presence_penalty": 1.5, "frequency_penalty": 1.0},
         {"processors": transformers.LogitsProcessorList([OpenAIPenalties(len(prompt), 1.5, 1.0)])}),
        # EOS made likely, held off for 6 tokens
        ({"logit_bias": {eos: 9.0}, "min_tokens": 6}, {"sequence_bias": {(eos,): 9.0}, "min_new_tokens": 6}),
    ]
    for ours, theirs in cases:
        expected = hf_greedy(model, prompt, 16, **theirs)
        assert expected != plain_text, ours  # the processors change the output
        for gamma in (0, 4):
            result = runtime.generate([prompt], max_new_tokens=16, gamma=gamma, **ours)[0]
            assert result.token_ids == expected, (ours, gamma)
    runtime.close()


def test_processors_and_logprobs_are_checked_and_refused_clearly(bundles):
    runtime = speccompile.load(bundles("llama"))
    for options, message in (({"presence_penalty": 3}, "presence_penalty must be"),
                             ({"repetition_penalty": 0}, "repetition_penalty must be > 0"),
                             ({"logit_bias": {10**6: 1}}, "outside the vocabulary"),
                             ({"logit_bias": {5: 500}}, r"in \[-100, 100\]"),
                             ({"logprobs": 21}, r"logprobs must be an integer in \[0, 20\]"),
                             ({"min_tokens": -1}, "min_tokens must be")):
        with pytest.raises(SpecCompileError, match=message):
            runtime.generate(["x"], max_new_tokens=2, **options)
    runtime.close()
    medusa = speccompile.load(bundles("llama", "medusa"))
    with pytest.raises(SpecCompileError, match="Medusa tree verification applies no logits processors"):
        medusa.generate(["x"], max_new_tokens=2, logprobs=1)
    medusa.close()


def test_a_prompt_scored_in_chunks_beside_a_decoding_request_is_scored_as_hf_scores_it(bundles, hf_models):
    """Prefill chunks of 4 tokens (another request decodes meanwhile): every position scored once, in order."""
    runtime = speccompile.load(bundles("llama"), prefill_chunk=4)
    prompt = runtime.tokenizer.encode("x y z " * 6)
    busy = runtime.submit("y x", max_new_tokens=40, gamma=4)
    scored = runtime.submit(prompt, max_new_tokens=3, prompt_logprobs=1, gamma=4).result()
    busy.result()
    runtime.close()
    log_p = hf_log_softmax(hf_models("llama"), prompt)
    assert len(scored.prompt_logprobs) == len(prompt) - 1
    np.testing.assert_allclose([e[0] for e in scored.prompt_logprobs], log_p[np.arange(len(prompt) - 1), prompt[1:]],
                               atol=2e-5)
