"""The runtime tokenizer: a continuation's text is what it adds after the prompt."""

import json

import pytest
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


def byte_level_bpe(tmp_path):
    """A byte-level BPE (GPT-2's and Llama 3's kind) that has learnt only ASCII words, so an accented
    letter, a CJK character or an emoji is two to four byte tokens: single tokens split characters."""
    from tokenizers import trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["def parse_args(argv):\n    return argv[1:]\n"] * 20, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    return Tokenizer(tmp_path, {"eos_token_ids": [0]})


def streamed(tokenizer, prompt_ids, ids, step) -> list[str]:
    stream = tokenizer.stream(prompt_ids)
    return [stream.add(ids[i : i + step]) for i in range(0, len(ids), step)]


@pytest.mark.parametrize("step", [1, 3])
def test_a_stream_adds_up_to_the_whole_continuation_with_characters_split_across_tokens(tmp_path, step):
    tokenizer = byte_level_bpe(tmp_path)
    ids = tokenizer.encode("def héllo():\n    return '世界 🎉'")
    prompt, continuation = ids[:2], ids[2:]
    whole = tokenizer.decode_continuation(prompt, continuation)
    assert any(tokenizer.decode([i]).endswith("\ufffd") for i in continuation)  # characters are split
    pieces = streamed(tokenizer, prompt, continuation, step)
    assert "".join(pieces) == whole
    assert not any("\ufffd" in piece for piece in pieces)  # a split character waits until it is whole


def test_a_stream_holds_back_an_unfinished_character(tmp_path):
    tokenizer = byte_level_bpe(tmp_path)
    ids = tokenizer.encode("ab 世")
    first_byte = next(k for k in range(len(ids)) if tokenizer.decode(ids[: k + 1]).endswith("\ufffd"))
    assert "".join(streamed(tokenizer, ids[:1], ids[1 : first_byte + 1], 1)) == "b "
    assert tokenizer.decode_continuation(ids[:1], ids[1 : first_byte + 1]) == "b \ufffd"


def test_a_stream_keeps_the_space_before_its_first_word(tmp_path):
    tokenizer = sentencepiece_style(tmp_path)
    assert "".join(streamed(tokenizer, tokenizer.encode("Hello"), [2, 3], 1)) == " world!"


def test_token_texts_name_partial_characters_by_their_bytes(bundles):
    from speccompile.runtime.runtime import load

    tokenizer = load(bundles("llama", "random")).tokenizer
    ids = tokenizer.encode("a ✓")
    texts = tokenizer.token_texts(ids)
    assert texts[0] == "a" and texts[-3:] == ["bytes:\\xe2", "bytes:\\x9c", "bytes:\\x93"]
    assert "".join(texts[:2]) == "a "
