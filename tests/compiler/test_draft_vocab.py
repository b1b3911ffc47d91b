"""Draft vocabulary: which tokens the draft's greedy LM head keeps, and what the build does with them."""

import json

import numpy as np
import onnx
import pytest

import speccompile
from speccompile.bundle import open_bundle
from speccompile.compiler.build import build_bundle
from speccompile.compiler.draft_vocab import (
    FREQUENCIES_FILE,
    corpus_frequencies,
    read_frequencies,
    select_vocab,
    write_frequencies,
)
from speccompile.errors import SpecCompileError
from tests.tiny_models import TEXT


def test_the_most_frequent_tokens_are_kept_ties_to_the_lower_id_and_eos_always():
    counts = np.array([5, 0, 9, 9, 1, 7, 0, 3])
    assert select_vocab(counts, 3, 8, always=[]).tolist() == [2, 3, 5]
    assert select_vocab(counts, 3, 8, always=[6]).tolist() == [2, 3, 6]  # EOS never seen, still kept
    assert select_vocab(counts, 4, 8, always=[1, 6]).tolist() == [1, 2, 3, 6]
    assert select_vocab(counts[:5], 6, 8, always=[]).tolist() == [0, 1, 2, 3, 4, 5]  # ids beyond the counts rank last


@pytest.mark.parametrize("size, message", [(0, "between 1 and 7"), (8, "between 1 and 7"), (1, "end-of-sequence")])
def test_impossible_sizes_are_user_errors(size, message):
    with pytest.raises(SpecCompileError, match=message):
        select_vocab(np.ones(8, np.int64), size, 8, always=[3, 4])


def test_frequencies_round_trip_and_a_broken_file_is_reported(tmp_path):
    assert read_frequencies(tmp_path) is None
    write_frequencies(tmp_path, np.array([3, 0, 2]), "corpus.txt")
    assert read_frequencies(tmp_path).tolist() == [3, 0, 2]
    assert json.loads((tmp_path / FREQUENCIES_FILE).read_text())["tokens"] == 5
    (tmp_path / FREQUENCIES_FILE).write_text("{}")
    with pytest.raises(SpecCompileError, match="not a token frequency file"):
        read_frequencies(tmp_path)


def test_corpus_frequencies_count_the_train_part(tmp_path, tokenizer):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(TEXT) * 20)
    counts = corpus_frequencies(corpus, tokenizer, len(tokenizer))
    ids = tokenizer("".join(TEXT) * 20, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    train = ids[: int(len(ids) * 0.95)]  # the corpus' last 5% is held out, as in distill
    assert counts.tolist() == np.bincount(train, minlength=len(tokenizer)).tolist()


def with_frequencies(tmp_path, checkpoint, keep: list[int], vocab: int):
    """A copy of `checkpoint` whose token frequencies rank exactly `keep` on top."""
    import shutil

    copy = shutil.copytree(checkpoint, tmp_path / "draft-with-frequencies")
    counts = np.zeros(vocab, np.int64)
    counts[keep] = 100
    write_frequencies(copy, counts, "test")
    return copy


def test_greedy_draft_graph_scores_only_the_kept_tokens(tmp_path, checkpoints, tokenizer):
    keep = list(range(3, 40))
    draft = with_frequencies(tmp_path, checkpoints("llama", "draft"), keep, len(tokenizer))
    bundle = open_bundle(build_bundle(checkpoints("llama"), draft, tmp_path / "b", gammas=[2], max_seq=64, max_batch=2,
                                      draft_vocab=len(keep) + 1))
    eos = list(bundle.manifest.tokenizer.eos_token_ids)
    assert bundle.model("draft").scored_vocab == len(keep) + 1
    assert bundle.model("target").scored_vocab == bundle.vocab_size
    greedy = onnx.load(str(bundle.graph_path("draft_forward")))
    [logits] = [o for o in greedy.graph.output if o.name == "logits"]
    assert logits.type.tensor_type.shape.dim[1].dim_value == len(keep) + 1
    [ids] = [onnx.numpy_helper.to_array(t) for t in greedy.graph.initializer if t.name == "vocab_ids"]
    assert ids.tolist() == sorted(keep + eos)
    sample = onnx.load(str(bundle.graph_path("draft_sample")), load_external_data=False)
    assert "vocab_ids" not in {t.name for t in sample.graph.initializer}  # sampling keeps the whole head


def test_draft_vocab_without_frequencies_is_a_clear_error(tmp_path, checkpoints):
    with pytest.raises(SpecCompileError, match=f"no {FREQUENCIES_FILE}.*--draft-vocab-corpus"):
        build_bundle(checkpoints("llama"), checkpoints("llama", "draft"), tmp_path / "b", draft_vocab=16, max_seq=64)
    assert not (tmp_path / "b").exists()


def test_a_copy_draft_is_accepted_exactly_where_the_target_stays_inside_the_vocabulary(tmp_path, checkpoints):
    """With the target as its own draft, a drafted token is the target's argmax among the kept
    tokens: accepted iff the target's choice is kept. Output is the target's either way."""
    target = checkpoints("llama")
    prompt = [5, 17, 33, 2, 9, 100, 7]
    reference = speccompile.load(build_bundle(target, target, tmp_path / "full", gammas=[4], max_seq=64, max_batch=1,
                                              draft_weights="float32"))
    [expected] = reference.generate([prompt], max_new_tokens=16, mode="autoregressive")
    vocab, eos = reference.bundle.vocab_size, set(reference.bundle.manifest.tokenizer.eos_token_ids)
    produced = sorted(set(expected.token_ids))
    assert not eos & set(produced), "the test needs 16 tokens without an end of sequence"
    others = [i for i in range(vocab) if i not in produced and i not in eos][: len(produced)]
    for keep, acceptance in ((produced, 1.0), (others, 0.0)):
        draft = with_frequencies(tmp_path / f"k{acceptance}", target, keep, vocab)
        bundle = build_bundle(target, draft, tmp_path / f"b{acceptance}", gammas=[4], max_seq=64, max_batch=1,
                              draft_weights="float32", draft_vocab=len(keep) + len(eos))
        runtime = speccompile.load(bundle)
        [result] = runtime.generate([prompt], max_new_tokens=16, gamma=4)
        assert result.token_ids == expected.token_ids
        assert result.stats.acceptance_rate == acceptance
