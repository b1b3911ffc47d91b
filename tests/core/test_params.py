"""GenerationParams: checked once when made, the same record from keywords and from an OpenAI body."""

import pytest

from speccompile.core.grammar import Constraint
from speccompile.core.params import GenerationParams, Mode, SamplingRule
from speccompile.errors import SpecCompileError


@pytest.mark.parametrize("options, message", [
    ({"mode": "fast"}, "mode must be one of speculative, autoregressive, not 'fast'"),
    ({"sampling_rule": "maybe"}, "sampling_rule must be one of coupled, rejection"),
    ({"acceptance": "loose"}, "acceptance must be one of exact, typical"),
    ({"max_new_tokens": 0}, "max_new_tokens must be a positive integer"),
    ({"top_k": 2.5}, "top_k must be an integer"),
    ({"top_p": 0}, r"top_p must be in \(0, 1\]"),
    ({"temperature": "hot"}, "temperature must be a number"),
    ({"seed": 1.5}, "seed must be an integer"),
    ({"stop": ["ok", ""]}, "stop must be a non-empty string"),
    ({"logprobs": 21}, r"logprobs must be an integer in \[0, 20\]"),
    ({"presence_penalty": 3}, r"presence_penalty must be a number in \[-2, 2\]"),
    ({"logit_bias": "x"}, "logit_bias must map token ids to biases"),
    ({"p_min": 2}, r"p_min must be a probability in \[0, 1\]"),
    ({"n": 0}, "n must be a positive integer"),
    ({"proposer": "oracle"}, "proposer must be one of draft, ngram, suffix, medusa, eagle, eagle_tree, auto"),
    ({"colour": "blue"}, "unknown generation option 'colour'"),
    ({"regex": "a+", "choice": ["a"]}, "give one constraint, not regex and choice"),
])
def test_a_bad_option_is_one_clear_error(options, message):
    with pytest.raises(SpecCompileError, match=message):
        GenerationParams.of(**options)


def test_values_are_normalised_once():
    params = GenerationParams.of(stop="end", logit_bias={"7": 1, 3: -2}, seed=-1, mode="autoregressive",
                                 temperature=1e-7, regex="[0-9]+")
    assert params.stop == ("end",) and params.logit_bias == ((3, -2.0), (7, 1.0))
    assert params.seed == 2**64 - 1 and params.mode is Mode.AUTOREGRESSIVE and params.temperature == 0.0
    assert params.constraint == Constraint.of(regex="[0-9]+")
    assert GenerationParams.of(params, max_new_tokens=5).stop == ("end",)  # keywords replace fields


def test_sample_i_is_seeded_seed_plus_i_and_the_seed_chooses_the_rule():
    params = GenerationParams(seed=2**64 - 1, temperature=1.0)
    assert [params.for_sample(i).seed for i in range(3)] == [2**64 - 1, 0, 1]
    assert GenerationParams().for_sample(5).seed is None
    assert params.default_sampling_rule() is SamplingRule.COUPLED
    assert GenerationParams().default_sampling_rule() is SamplingRule.REJECTION
    assert GenerationParams(sampling_rule="coupled").default_sampling_rule() is SamplingRule.COUPLED


def test_an_openai_body_maps_onto_the_record():
    completion = GenerationParams.from_openai({"max_tokens": 0, "echo": True, "logprobs": 3, "top_k": -1,
                                               "num_speculative_tokens": 0, "stop": "x"})
    assert (completion.max_new_tokens, completion.logprobs, completion.prompt_logprobs) == (1, 3, 3)
    assert completion.top_k == 0 and completion.gamma == 0 and completion.stop == ("x",)
    chat = GenerationParams.from_openai({"max_tokens": 9, "max_completion_tokens": 4, "logprobs": True,
                                         "top_logprobs": 2, "response_format": {"type": "json_object"}}, chat=True)
    assert (chat.max_new_tokens, chat.logprobs, chat.prompt_logprobs) == (4, 2, None)
    assert chat.constraint == Constraint.of(json_object=True)
    defaults = GenerationParams(proposer="ngram", gamma=4)
    assert GenerationParams.from_openai({"max_tokens": 2}, defaults).proposer == "ngram"  # unset: the server's
    with pytest.raises(SpecCompileError, match="give one of response_format and structured_outputs"):
        GenerationParams.from_openai({"response_format": {"type": "json_object"},
                                      "structured_outputs": {"regex": "a"}})
