"""`speccompile distill --medusa K` end to end on tiny random targets, and the heads' file format."""

import json
import logging

import numpy as np
import pytest
from click.testing import CliRunner

from speccompile.cli import main
from speccompile.errors import SpecCompileError
from speccompile.medusa_heads import CONFIG, WEIGHTS, load_medusa_heads, write_medusa_heads
from speccompile.training import medusa as module
from speccompile.training.medusa import MedusaOptions, train_medusa
from tests.training.test_distill import corpus, interrupted_at_step_15, said  # noqa: F401 (a fixture)

OPTIONS = dict(heads=3, batch=4, seq_len=32, lr=1e-2, checkpoint_every=10, eval_windows=4, eval_prompt=16,
               eval_new_tokens=16, generated_fraction=0.5)


def log_steps(out):
    return [json.loads(line) for line in (out / "distill_log.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, checkpoints, corpus):  # noqa: F811
    """Heads on a random target: its text is not predictable ahead, but its distributions are matched."""
    out = tmp_path_factory.mktemp("medusa") / "heads"
    return train_medusa(checkpoints("llama"), corpus, out, MedusaOptions(steps=40, **OPTIONS))


# -- the heads -----------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_untrained_heads_are_the_targets_next_token_head(checkpoints, family):
    import torch
    import transformers

    target = transformers.AutoModelForCausalLM.from_pretrained(checkpoints(family), dtype=torch.float32).eval()
    ids = torch.randint(0, 300, (2, 12))
    hidden_size = target.get_output_embeddings().weight.shape[1]
    with torch.no_grad():
        expected = target(ids).logits
        hidden = module.target_hidden(target, ids)
        for head in module.new_heads(hidden_size, 2):
            torch.testing.assert_close(module.head_logits(target, head, hidden), expected)


def test_head_kl_is_distills_kl():
    import torch

    from speccompile.training.distill import _kl

    teacher, student = torch.randn(2, 5, 40) * 3, torch.randn(2, 5, 40) * 3
    p, entropy = module._teacher(teacher)
    torch.testing.assert_close(module._head_kl(p, entropy, student), _kl(teacher, student))


# -- training --------------------------------------------------------------------------------------


def test_training_writes_the_heads_format(trained, checkpoints):
    config, heads = load_medusa_heads(trained)
    target_config = json.loads((checkpoints("llama") / "config.json").read_text())
    assert config["format"] == "speccompile-medusa" and config["version"] == 1 and config["lm_head"] == "target"
    assert (config["num_heads"], config["hidden_size"]) == (3, target_config["hidden_size"])
    assert (config["vocab_size"], config["target_model_type"]) == (target_config["vocab_size"], "llama")
    ranks = np.array(config["top_k_accuracy"])
    assert ranks.shape == (3, 10) and (ranks >= 0).all() and (ranks.sum(1) <= 1 + 1e-6).all()
    training = config["training"]
    assert training["top1"] == ranks[:, 0].tolist()
    assert np.allclose(training["top5"], ranks[:, :5].sum(1), atol=1e-3)
    assert len(training["kl_final"]) == len(training["heldout_kl"]) == 3 and config["options"]["steps"] == 40
    assert [entry["step"] for entry in log_steps(trained)] == list(range(1, 41))
    assert not any(p.name.endswith(".tmp") for p in trained.iterdir())
    from safetensors.numpy import load_file

    stored = load_file(str(trained / WEIGHTS))
    assert sorted(stored) == sorted(f"medusa.{k}.{part}" for k in range(3) for part in ("weight", "bias"))
    assert all(t.dtype == np.float16 for t in stored.values())
    assert all(np.abs(w).max() > 0 for w, _ in heads)  # trained away from the zero start


def test_training_lowers_every_heads_kl(trained):
    kls = np.array([entry["kl"] for entry in log_steps(trained)])
    first, last = kls[:5].mean(0), kls[-5:].mean(0)
    assert (last < 0.9 * first).all(), (first, last)


def test_trained_heads_match_the_target_better_on_its_own_heldout_text(trained):
    training = json.loads((trained / CONFIG).read_text())["training"]
    assert all(a < 0.95 * b for a, b in zip(training["heldout_kl"], training["untrained_heldout_kl"])), training


def test_an_interrupted_run_resumes_from_its_last_checkpoint(tmp_path, checkpoints, corpus, monkeypatch,  # noqa: F811
                                                             caplog):
    out = tmp_path / "m"
    interrupted_at_step_15(module, monkeypatch,
                           lambda: train_medusa(checkpoints("llama"), corpus, out, MedusaOptions(steps=20, **OPTIONS)))
    assert (out / "distill_state.pt").exists() and not (out / WEIGHTS).exists()
    caplog.set_level(logging.INFO, logger="speccompile")
    train_medusa(checkpoints("llama"), corpus, out, MedusaOptions(steps=20, **OPTIONS))
    assert any("resuming from the checkpoint at step 10" in line for line in said(caplog))
    assert [entry["step"] for entry in log_steps(out)] == list(range(1, 21))
    assert load_medusa_heads(out)[0]["num_heads"] == 3


def test_resume_with_other_heads_or_onto_a_draft_is_refused(tmp_path, checkpoints, corpus):  # noqa: F811
    from speccompile.training.distill import DistillOptions, distill

    out = train_medusa(checkpoints("llama"), corpus, tmp_path / "m", MedusaOptions(steps=2, **OPTIONS))
    with pytest.raises(SpecCompileError, match="same options or a new --out"):
        train_medusa(checkpoints("llama"), corpus, out, MedusaOptions(steps=4, **{**OPTIONS, "heads": 2}))
    draft = distill(checkpoints("llama"), corpus, tmp_path / "d",
                    DistillOptions(steps=2, layers=1, hidden=32, batch=4, seq_len=32, eval_windows=2))
    with pytest.raises(SpecCompileError, match="same options or a new --out"):
        train_medusa(checkpoints("llama"), corpus, draft, MedusaOptions(steps=4, **OPTIONS))


# -- the format -------------------------------------------------------------------------------------


def test_load_medusa_heads_round_trips_in_float16(tmp_path):
    rng = np.random.default_rng(0)
    heads = [(rng.standard_normal((8, 8)).astype(np.float32), rng.standard_normal(8).astype(np.float32))
             for _ in range(2)]
    write_medusa_heads(tmp_path, {"vocab_size": 50, "target_model_type": "llama", "top_k_accuracy": [[0.5]]}, heads)
    config, loaded = load_medusa_heads(tmp_path)
    assert (config["num_heads"], config["hidden_size"], config["vocab_size"]) == (2, 8, 50)
    for (w, b), (w2, b2) in zip(heads, loaded):
        assert w2.dtype == np.float32 and b2.dtype == np.float32
        assert np.array_equal(w2, w.astype(np.float16).astype(np.float32))
        assert np.array_equal(b2, b.astype(np.float16).astype(np.float32))


def test_load_medusa_heads_explains_what_is_wrong(tmp_path):
    with pytest.raises(SpecCompileError, match="not a Medusa heads directory"):
        load_medusa_heads(tmp_path / "missing")
    heads = [(np.zeros((4, 4), np.float32), np.zeros(4, np.float32))]
    write_medusa_heads(tmp_path, {"vocab_size": 9, "target_model_type": "llama"}, heads)
    config = json.loads((tmp_path / CONFIG).read_text())
    (tmp_path / CONFIG).write_text(json.dumps({**config, "num_heads": 2}))
    with pytest.raises(SpecCompileError, match="does not hold the 2 heads of hidden size 4"):
        load_medusa_heads(tmp_path)
    (tmp_path / CONFIG).write_text(json.dumps({**config, "format": "other"}))
    with pytest.raises(SpecCompileError, match="expected 'speccompile-medusa'"):
        load_medusa_heads(tmp_path)
    (tmp_path / CONFIG).write_text(json.dumps(config))
    (tmp_path / WEIGHTS).write_bytes(b"not safetensors")
    with pytest.raises(SpecCompileError, match="unreadable safetensors file"):
        load_medusa_heads(tmp_path)


# -- user errors: one line from the CLI -------------------------------------------------------------


def medusa_error(*args):
    """The one error line (after what was under way: an out directory is checked once the target is loaded)."""
    result = CliRunner().invoke(main, ["distill", *map(str, args)])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    errors = [line for line in lines if line.startswith("Error: ")]
    assert errors == lines[-1:], result.output
    return errors[0]


def test_cli_errors_are_one_line(tmp_path, checkpoints, corpus):  # noqa: F811
    target, out = checkpoints("llama"), tmp_path / "m"
    common = ["--target", target, "--corpus", corpus, "--out", out]
    assert "--medusa must be positive, got 0" in medusa_error(*common, "--medusa", "0")
    assert "needs windows of at least 42 tokens" in medusa_error(*common, "--medusa", "40", "--seq-len", "32")
    assert "--layers shapes a draft" in medusa_error(*common, "--medusa", "2", "--layers", "2")
    assert "no config.json" in medusa_error("--target", tmp_path / "none", "--corpus", corpus, "--out", out,
                                            "--medusa", "2")
    assert not out.exists()
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert "is not empty and holds no distillation checkpoint" in medusa_error(*common, "--medusa", "2")


def test_cli_trains_heads(tmp_path, checkpoints, corpus):  # noqa: F811
    out = tmp_path / "m"
    result = CliRunner().invoke(main, ["distill", "--target", str(checkpoints("llama")), "--corpus", str(corpus),
                                       "--out", str(out), "--medusa", "2", "--steps", "3", "--batch", "2",
                                       "--seq-len", "24"])
    assert result.exit_code == 0, result.output
    config, heads = load_medusa_heads(out)
    assert config["num_heads"] == len(heads) == 2 and config["options"]["seq_len"] == 24
