"""The runtime tokenizer: a continuation's text is what it adds after the prompt."""

import json

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from speccompile.runtime.tokenizer import Tokenizer


def sentencepiece_style(tmp_path):
    """A Metaspace tokenizer, as Llama 2 / TinyLlama / Mistral ship: '▁' marks a word's leading space,
    and decoding a text drops the space of its first word."""
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3}
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.save(str(tmp_path / "tokenizer.json"))
    return Tokenizer(tmp_path, {"eos_token_ids": []})


def test_a_continuation_keeps_the_space_before_its_first_word(tmp_path):
    tokenizer = sentencepiece_style(tmp_path)
    prompt = tokenizer.encode("Hello")
    assert tokenizer.decode([2, 3]) == "world!"  # alone, the first word loses its space
    assert tokenizer.decode_continuation(prompt, [2, 3]) == " world!"
    assert tokenizer.decode(prompt) + tokenizer.decode_continuation(prompt, [2, 3]) == "Hello world!"


def test_generation_results_carry_the_continuations_text(bundles, monkeypatch):
    import speccompile

    runtime = speccompile.load(bundles("llama", "random"))
    [result] = runtime.generate([[5, 17, 33, 2, 9]], max_new_tokens=6, gamma=1)
    assert result.text == runtime.tokenizer.decode_continuation([5, 17, 33, 2, 9], result.token_ids)
    assert json.dumps(result.to_dict())  # plain data
