"""The draft/target tokenizer gate: refuse what changes token ids, accept what does not."""

import json
import shutil

import pytest

from speccompile.compiler.build import build_bundle
from speccompile.compiler.checkpoint import load_checkpoint
from speccompile.compiler.tokenizer import check_compatible, load_tokenizer
from speccompile.errors import SpecCompileError
from tests.tiny_models import make_checkpoint


def check(target, draft) -> int:
    specs = load_checkpoint(target), load_checkpoint(draft)
    return check_compatible(*specs, load_tokenizer(target), load_tokenizer(draft))


def edit_json(path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


@pytest.fixture
def qwen2_draft(tmp_path, tokenizer):
    """A Qwen2 draft with the Llama target's tokenizer files byte for byte, but its own pad token
    (config.json and tokenizer_config.json). Loaded through transformers, a Qwen2 tokenizer also
    gains the class's default '<|endoftext|>' token that the file does not have."""
    draft = make_checkpoint(tmp_path / "qwen2", "qwen2", size="draft", tokenizer=tokenizer, pad_token_id=1)
    edit_json(draft / "tokenizer_config.json", lambda c: c.update(pad_token="</s>"))
    return draft


def test_a_different_pad_token_is_not_a_mismatch(tmp_path, checkpoints, qwen2_draft):
    target = checkpoints("llama")
    assert (target / "tokenizer.json").read_bytes() == (qwen2_draft / "tokenizer.json").read_bytes()
    assert load_tokenizer(target).pad_token_id != load_tokenizer(qwen2_draft).pad_token_id
    out = build_bundle(target, qwen2_draft, tmp_path / "b", gammas=[2], max_seq=32, single_sequence=False)
    assert json.loads((out / "manifest.json").read_text())["models"]["draft"]["model_type"] == "qwen2"


def copy_with_tokenizer_edit(tmp_path, target, edit):
    draft = shutil.copytree(target, tmp_path / "draft")
    edit_json(draft / "tokenizer.json", edit)
    return draft


def drop_last_merge(tok):
    tok["model"]["merges"] = tok["model"]["merges"][:-1]


@pytest.mark.parametrize("edit, fragment", [
    (drop_last_merge, "merges"),
    (lambda tok: tok.update(normalizer={"type": "Lowercase"}), "normalizer"),
    (lambda tok: tok["pre_tokenizer"].update(add_prefix_space=True), "pre-tokenizer"),
])
def test_same_vocabulary_but_a_different_tokenization_is_refused(tmp_path, checkpoints, edit, fragment):
    target = checkpoints("llama")
    draft = copy_with_tokenizer_edit(tmp_path, target, edit)
    assert load_tokenizer(draft).get_vocab() == load_tokenizer(target).get_vocab()
    with pytest.raises(SpecCompileError, match=f"tokenizers differ: same vocabulary, but different {fragment}"):
        check(target, draft)


def test_a_different_eos_token_is_refused(tmp_path, checkpoints):
    target = checkpoints("llama")
    draft = shutil.copytree(target, tmp_path / "draft")
    edit_json(draft / "tokenizer_config.json", lambda c: c.update(eos_token="<pad>"))
    with pytest.raises(SpecCompileError, match="eos_token is '</s>' in target, '<pad>' in draft"):
        check(target, draft)


def test_moved_ids_are_refused_with_the_token_named(tmp_path, checkpoints):
    def swap_two(tok):
        vocab = tok["model"]["vocab"]
        a, b = list(vocab)[10:12]
        vocab[a], vocab[b] = vocab[b], vocab[a]

    target = checkpoints("llama")
    draft = copy_with_tokenizer_edit(tmp_path, target, swap_two)
    with pytest.raises(SpecCompileError, match="2 with different ids"):
        check(target, draft)
