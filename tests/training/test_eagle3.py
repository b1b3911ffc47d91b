"""`speccompile/training/eagle3.py`: an EAGLE-3 head trained on a frozen tiny target, end to end.

Oracle for what is trained: tests/eagle_reference.py, the head's drafting after a prompt. The
training-time test's unroll, at a window's last prompt index, must give the reference's drafts for
the same weights: then what training scores is what the compiled head will draft.
"""

import json
import logging

import numpy as np
import pytest
import torch
import transformers

from speccompile.compiler.draft_vocab import corpus_frequencies
from speccompile.eagle_head import load_eagle3_head
from speccompile.errors import SpecCompileError
from speccompile.training.eagle3 import Eagle3Options, HeadModel, target_features, train_eagle3
from tests.eagle_reference import Eagle3Reference, draft, random_head
from tests.training.test_distill import corpus, said  # noqa: F401 (a fixture)

OPTIONS = dict(ttt_steps=3, batch=4, seq_len=32, lr=1e-2, checkpoint_every=20, eval_windows=8)
PROMPT = "def parse_args(argv):\n    return"


def log_entries(out) -> list[dict]:
    return [json.loads(line) for line in (out / "distill_log.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def deep_target(tmp_path_factory, tokenizer):
    """Seven layers, so EAGLE's default aux layers (2, 3, 4) are three; HF's default init, under which
    the target's next token follows the text smoothly enough for a head to learn in seconds."""
    from tests.tiny_models import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("deep") / "t", "llama", tokenizer=tokenizer, init_std=0.02,
                           num_hidden_layers=7)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, deep_target, corpus):  # noqa: F811
    return train_eagle3(deep_target, corpus, tmp_path_factory.mktemp("eagle3") / "head",
                        Eagle3Options(steps=60, **OPTIONS))


def hf_target(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


# -- training ------------------------------------------------------------------------------------


def test_training_raises_agreement_above_the_untrained_heads(tmp_path, deep_target, corpus, trained):  # noqa: F811
    untrained = train_eagle3(deep_target, corpus, tmp_path / "u", Eagle3Options(steps=1, **{**OPTIONS, "lr": 1e-9}))
    before = json.loads((untrained / "config.json").read_text())["training"]["agreement"]
    after = json.loads((trained / "config.json").read_text())["training"]
    assert len(after["agreement"]) == 3 and after["agreement"][0] >= before[0] + 0.05, (before, after)
    assert after["steps"] == 60 and after["corpus_tokens"] > 1000 and after["options"]["aux_layer_ids"] == [2, 3, 4]
    entries = log_entries(trained)
    assert [e["step"] for e in entries] == list(range(1, 61)) and all(len(e["kl"]) == 3 for e in entries)
    assert [e["step"] for e in entries if "agreement" in e] == [20, 40, 60]
    assert entries[-1]["agreement"] == after["agreement"]
    first, last = np.mean([e["loss"] for e in entries[:10]]), np.mean([e["loss"] for e in entries[-10:]])
    assert last < 0.8 * first, (first, last)


def test_the_written_head_is_the_trained_one(trained, deep_target):
    head = load_eagle3_head(trained)
    c = head.config
    assert head.embed_tokens is None  # the target's embedding is borrowed, not written
    assert c.aux_layer_ids == (2, 3, 4) and not c.norm_before_residual and c.rope_scaling is None
    assert (c.hidden_size, c.target_hidden_size, c.vocab_size) == (64, 64, c.draft_vocab_size)
    state = torch.load(trained / "distill_state.pt", weights_only=False)["draft"]
    for name, value in state.items():
        assert np.array_equal(getattr(head, name.removesuffix(".weight")), value.numpy()), name


def reference_and_unrolled(head, target, tokenizer, k: int) -> tuple[list[int], list[int], np.ndarray, np.ndarray]:
    """The reference's k greedy drafts after PROMPT and its logits for them [k, V_draft]; and the training
    unroll's at the prompt's last index of a window that goes on with the target's token and those drafts."""
    prompt = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    embed = target.get_input_embeddings().weight.detach()
    with torch.no_grad():
        features, logits = target_features(target, torch.tensor([prompt]), head.config.aux_layer_ids)
    tokens = prompt + [int(logits[0, -1].argmax())]
    expected, hidden = draft(head, features[0].numpy(), tokens, k, embed_tokens=embed.numpy())
    # the catch-up's last position, then each fed-back step's
    expected_logits = Eagle3Reference(head, embed.numpy()).logits(torch.from_numpy(hidden[len(prompt) - 1 :]))
    window = torch.tensor([tokens + expected[:-1].tolist()])
    padded = torch.cat([features, torch.zeros(1, k, features.shape[-1])], dim=1)  # no features after the prompt
    model = HeadModel.from_head(head, embed).double()
    with torch.no_grad():
        steps = [step[0, len(prompt) - 1] for step in model.unroll(padded.double(), window, k)]
    unrolled = [int(model.draft_targets()[step.argmax()]) for step in steps]
    return expected.tolist(), unrolled, expected_logits.numpy(), torch.stack(steps).numpy()


def test_the_written_heads_drafts_are_the_references(trained, deep_target, tokenizer):
    expected, unrolled, _, _ = reference_and_unrolled(load_eagle3_head(trained), hf_target(deep_target), tokenizer, 3)
    assert unrolled == expected


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_the_unroll_computes_the_references_drafting(deep_target, tokenizer, norm_before_residual):
    """Each step's attention over the context and the chain's earlier drafts, and its RoPE positions,
    are the reference's: its logits, not only their argmax, for a random head of either residual."""
    config = json.loads((deep_target / "config.json").read_text())
    head = random_head(config, seed=3, norm_before_residual=norm_before_residual, aux_layer_ids=(2, 3, 4),
                       rope_theta=5000.0)
    expected, unrolled, expected_logits, logits = reference_and_unrolled(head, hf_target(deep_target), tokenizer, 5)
    assert unrolled == expected
    np.testing.assert_allclose(logits, expected_logits, rtol=1e-9, atol=1e-9 * np.abs(expected_logits).max())


# -- the draft vocabulary and the aux layers -----------------------------------------------------


def test_the_draft_vocabulary_is_the_most_frequent_tokens(tmp_path, tokenizer, corpus):  # noqa: F811
    """On a three-layer target, with its three layers named: lm_head starts as the target's rows of them."""
    from speccompile.compiler.draft_vocab import read_frequencies
    from tests.tiny_models import make_checkpoint

    shallow = make_checkpoint(tmp_path / "t", "llama", tokenizer=tokenizer, num_hidden_layers=3)
    out = train_eagle3(shallow, corpus, tmp_path / "h", Eagle3Options(
        steps=1, draft_vocab=40, aux_layer_ids=(2, 0, 1), **{**OPTIONS, "lr": 1e-9}))
    head = load_eagle3_head(out)
    counts = corpus_frequencies(corpus, tokenizer, head.config.vocab_size)
    expected = np.sort(np.argsort(-counts, kind="stable")[:40])
    targets = np.arange(40) + head.d2t
    assert targets.tolist() == expected.tolist() and head.t2d.sum() == 40 and head.t2d[targets].all()
    assert head.config.aux_layer_ids == (0, 1, 2)
    assert read_frequencies(out).tolist() == counts.tolist()  # what build --eagle-vocab ranks by
    lm_head = hf_target(shallow).get_output_embeddings().weight.detach().numpy()
    np.testing.assert_allclose(head.lm_head, lm_head[targets], atol=1e-6)


def test_a_shallow_target_needs_its_aux_layers_named(tmp_path, checkpoints, corpus):  # noqa: F811
    with pytest.raises(SpecCompileError, match="not three distinct layers of this 2-layer target: name three"):
        train_eagle3(checkpoints("llama"), corpus, tmp_path / "h", Eagle3Options(steps=1, **OPTIONS))
    with pytest.raises(SpecCompileError, match="reads the input of target layer 2"):
        train_eagle3(checkpoints("llama"), corpus, tmp_path / "h", Eagle3Options(
            steps=1, aux_layer_ids=(0, 1, 2), **OPTIONS))
    with pytest.raises(SpecCompileError, match="three distinct layer ids"):
        train_eagle3(checkpoints("llama"), corpus, tmp_path / "h", Eagle3Options(
            steps=1, aux_layer_ids=(0, 1, 1), **OPTIONS))
    with pytest.raises(SpecCompileError, match="needs windows of at least 8 tokens"):
        train_eagle3(checkpoints("llama"), corpus, tmp_path / "h", Eagle3Options(**{**OPTIONS, "ttt_steps": 7,
                                                                                     "seq_len": 6}))
    assert not (tmp_path / "h").exists()


# -- resuming ------------------------------------------------------------------------------------


def test_resume_continues_from_the_checkpoint_and_refuses_another_shape(tmp_path, deep_target, corpus,  # noqa: F811
                                                                         caplog):
    out = tmp_path / "h"
    options = {**OPTIONS, "checkpoint_every": 10}
    train_eagle3(deep_target, corpus, out, Eagle3Options(steps=10, **options))
    caplog.set_level(logging.INFO, logger="speccompile")
    caplog.clear()  # the second run's lines alone (an earlier test may have set the logger to INFO already)
    train_eagle3(deep_target, corpus, out, Eagle3Options(steps=20, **options))
    assert any("resuming from the checkpoint at step 10" in line for line in said(caplog))
    assert not any(line.startswith("initial head") for line in said(caplog))
    assert [e["step"] for e in log_entries(out)] == list(range(1, 21))
    assert json.loads((out / "config.json").read_text())["training"]["steps"] == 20
    with pytest.raises(SpecCompileError, match="same options or a new --out") as refused:
        train_eagle3(deep_target, corpus, out, Eagle3Options(steps=30, draft_vocab=40, **options))
    assert "\n" not in str(refused.value)
