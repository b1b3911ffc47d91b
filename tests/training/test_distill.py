"""`speccompile distill` end to end on tiny random models."""

import json
import logging

import pytest

import speccompile
from speccompile.compiler.draft_vocab import corpus_frequencies, read_frequencies
from speccompile.errors import SpecCompileError
from speccompile.training.distill import DistillOptions, distill

CORPUS_LINES = [
    "def parse_args(argv):\n    return argv[1:]\n",
    "import os\nimport sys\nprint(os.path.join('a', 'b'))\n",
    "class Model:\n    def __init__(self, n):\n        self.n = n\n",
]
OPTIONS = dict(layers=1, hidden=32, batch=8, seq_len=32, lr=3e-3, checkpoint_every=10, eval_windows=8)


def said(caplog) -> list[str]:
    """What distill reported (its INFO lines, which the CLI shows)."""
    return [record.getMessage() for record in caplog.records if record.name.startswith("speccompile")]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    for i in range(40):
        (root / f"f{i}.py").write_text(CORPUS_LINES[i % 3] * (1 + i % 5) + f"x{i} = {i}\n")
    return root


@pytest.fixture(scope="module")
def smooth_target(tmp_path_factory, tokenizer):
    """A random target with HF's default init: smooth enough for a tiny draft to learn in seconds."""
    from tests.tiny_models import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("smooth") / "t", "llama", tokenizer=tokenizer, init_std=0.02)


def acceptance(target, draft, out):
    bundle = speccompile.build(target, draft, out, gammas=[4], max_seq=96)
    prompts = ["def parse_args(argv):\n", "import os\n", "class Model:\n    def", "x3 = 3\n"]
    results = speccompile.load(bundle).generate(prompts, max_new_tokens=40, gamma=4, proposer="draft")
    return sum(r.stats.accepted_tokens for r in results) / sum(r.stats.draft_tokens for r in results)


@pytest.mark.slow
def test_distilled_draft_accepts_more_than_untrained(tmp_path, smooth_target, corpus):
    target = smooth_target
    untrained = distill(target, corpus, tmp_path / "untrained", DistillOptions(**{**OPTIONS, "steps": 1, "lr": 1e-9}))
    trained = distill(target, corpus, tmp_path / "trained", DistillOptions(steps=80, **OPTIONS))
    before, after = acceptance(target, untrained, tmp_path / "b0"), acceptance(target, trained, tmp_path / "b1")
    assert after >= before + 0.02, (before, after)
    report = json.loads((trained / "distill.json").read_text())
    assert report["options"]["steps"] == 80 and 0 <= report["agreement"] <= 1
    config = json.loads((trained / "config.json").read_text())
    assert config["model_type"] == "llama" and config["hidden_size"] == 32 and config["num_hidden_layers"] == 1


def test_distill_records_the_token_frequencies_a_draft_vocabulary_is_cut_by(tmp_path, checkpoints, corpus, tokenizer):
    draft = distill(checkpoints("llama"), corpus, tmp_path / "d", DistillOptions(steps=2, **OPTIONS))
    vocab = json.loads((draft / "config.json").read_text())["vocab_size"]
    assert read_frequencies(draft).tolist() == corpus_frequencies(corpus, tokenizer, vocab).tolist()
    bundle = speccompile.build(checkpoints("llama"), draft, tmp_path / "b", gammas=[2], max_seq=64, draft_vocab=32)
    assert json.loads((bundle / "manifest.json").read_text())["models"]["draft"]["scored_vocab"] == 32


def test_resume_continues_from_the_checkpoint(tmp_path, checkpoints, corpus, caplog):
    caplog.set_level(logging.INFO, logger="speccompile")
    out = tmp_path / "d"
    distill(checkpoints("gpt2"), corpus, out, DistillOptions(steps=10, **OPTIONS))
    distill(checkpoints("gpt2"), corpus, out, DistillOptions(steps=20, **OPTIONS))
    assert any("resuming from the checkpoint at step 10" in line for line in said(caplog))
    steps = [json.loads(line)["step"] for line in (out / "distill_log.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 21))


def interrupted_at_step_15(module, monkeypatch, run) -> None:
    """Run `run()` with the module's 15th batch raising KeyboardInterrupt, as an interruption would."""
    calls, real_batch = {"n": 0}, module._batch

    def interrupt_at_step_15(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 15:
            raise KeyboardInterrupt
        return real_batch(*args, **kwargs)

    monkeypatch.setattr(module, "_batch", interrupt_at_step_15)
    with pytest.raises(KeyboardInterrupt):
        run()
    monkeypatch.setattr(module, "_batch", real_batch)


def test_an_interrupted_run_resumes_from_its_last_checkpoint(tmp_path, checkpoints, corpus, monkeypatch, caplog):
    from speccompile.training import distill as module

    out = tmp_path / "d"
    interrupted_at_step_15(module, monkeypatch,
                           lambda: distill(checkpoints("gpt2"), corpus, out, DistillOptions(steps=20, **OPTIONS)))
    assert (out / "distill_state.pt").exists()  # the step-10 checkpoint survived the interruption
    caplog.set_level(logging.INFO, logger="speccompile")
    distill(checkpoints("gpt2"), corpus, out, DistillOptions(steps=20, **OPTIONS))
    assert any("resuming from the checkpoint at step 10" in line for line in said(caplog))
    steps = [json.loads(line)["step"] for line in (out / "distill_log.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 21))


def test_resume_with_a_different_shape_is_refused(tmp_path, checkpoints, corpus):
    out = tmp_path / "d"
    distill(checkpoints("gpt2"), corpus, out, DistillOptions(steps=2, **OPTIONS))
    with pytest.raises(SpecCompileError, match="same options or a new --out"):
        distill(checkpoints("gpt2"), corpus, out, DistillOptions(steps=4, **{**OPTIONS, "hidden": 64}))
    assert (out / "distill_state.pt").exists()


def test_corpus_without_text(tmp_path, checkpoints):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.py").write_text("   \n")
    with pytest.raises(SpecCompileError, match="contains no text"):
        distill(checkpoints("llama"), tmp_path / "empty", tmp_path / "d", DistillOptions(**OPTIONS))


def test_unsupported_target_family(tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(SpecCompileError, match="unsupported model_type 'bert'"):
        distill(tmp_path / "t", tmp_path, tmp_path / "d", DistillOptions(**OPTIONS))


def test_draft_larger_than_target_is_refused(tmp_path, checkpoints, corpus):
    with pytest.raises(SpecCompileError, match="not smaller than"):
        distill(checkpoints("llama"), corpus, tmp_path / "d", DistillOptions(**{**OPTIONS, "hidden": 256, "layers": 4}))
    assert not (tmp_path / "d").exists()


def test_init_continues_an_existing_draft(tmp_path, smooth_target, corpus, caplog):
    first = distill(smooth_target, corpus, tmp_path / "a", DistillOptions(**{**OPTIONS, "steps": 30}))
    caplog.set_level(logging.INFO, logger="speccompile")
    caplog.clear()
    second = distill(smooth_target, corpus, tmp_path / "b",
                     DistillOptions(**{**OPTIONS, "steps": 5, "init": str(first), "hidden": 16}))
    trained = json.loads((first / "distill.json").read_text())["agreement"]
    # the --init draft's size, not --hidden
    assert json.loads((second / "distill.json").read_text())["draft"]["hidden_size"] == 32
    [start] = [line for line in said(caplog) if line.startswith("initial draft")]
    assert trained > 0.1 and start.endswith(f"{trained:.3f}")  # the second run started where the first ended
