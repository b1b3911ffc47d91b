"""The embedded-default path: no bundle given -> the demo bundle, built once into the cache."""

import json
import logging
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

import speccompile
import speccompile.demo as demo
from speccompile.cli import main
from speccompile.compiler.draft_vocab import read_frequencies, write_frequencies
from tests.tiny_models import VOCAB

TINY_DRAFT_VOCAB = 64


@pytest.fixture
def tiny_demo(tmp_path, monkeypatch, checkpoints):
    """Point the demo at a tiny pair (its draft with token frequencies, as the shipped one has; no
    EAGLE-3 head: the shipped one fits the shipped target only) and the cache at a fresh directory."""
    draft = shutil.copytree(checkpoints("llama", "draft"), tmp_path / "draft")
    write_frequencies(draft, np.arange(VOCAB)[::-1], "test")  # lower ids are more frequent
    monkeypatch.setattr(demo, "DEMO_TARGET", checkpoints("llama"))
    monkeypatch.setattr(demo, "DEMO_DRAFT", draft)
    monkeypatch.setattr(demo, "DEMO_EAGLE", tmp_path / "no-head")
    monkeypatch.setattr(demo, "DEMO_MAX_SEQ", 128)
    monkeypatch.setattr(demo, "DEMO_DRAFT_VOCAB", TINY_DRAFT_VOCAB)
    monkeypatch.setenv("SPECCOMPILE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_demo_bundle_is_built_once_and_reused(tiny_demo, caplog):
    caplog.set_level(logging.INFO, logger="speccompile")
    first = demo.demo_bundle()
    assert first.parent == tiny_demo and first.name.startswith("demo-")
    assert any("building the demo bundle" in record.getMessage() for record in caplog.records)
    caplog.clear()
    assert demo.demo_bundle() == first
    assert caplog.records == []  # cached: no second build
    manifest = json.loads((first / "manifest.json").read_text())
    assert manifest["gammas"] == demo.DEMO_GAMMAS
    assert manifest["models"]["draft"]["scored_vocab"] == TINY_DRAFT_VOCAB


def test_shipped_draft_has_the_frequencies_its_vocabulary_is_cut_by():
    counts = read_frequencies(demo.DEMO_DRAFT)
    assert counts is not None and len(counts) == 8192 and counts.sum() > 8_000_000
    assert 0 < demo.DEMO_DRAFT_VOCAB < len(counts)


def test_shipped_eagle_head_fits_the_shipped_target_and_keys_the_demo_bundle(monkeypatch, tmp_path):
    """The head the demo bundle carries beside the draft: one layer for this target, reading layers it
    has, its vocabulary cut by the frequencies shipped beside it; a changed head is a new bundle;
    head=False, or another target, the pair alone."""
    from speccompile.eagle_head import aux_layer_ids, check_fits, load_eagle3_head

    head = load_eagle3_head(demo.DEMO_EAGLE)
    config = json.loads((demo.DEMO_TARGET / "config.json").read_text())
    check_fits(head, config)
    assert aux_layer_ids(head, config["num_hidden_layers"]) == (1, 3, 5)
    assert 0 < demo.DEMO_EAGLE_VOCAB < head.config.draft_vocab_size
    assert read_frequencies(demo.DEMO_EAGLE).sum() > 8_000_000
    monkeypatch.setenv("SPECCOMPILE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(demo, "_built", lambda bundle, *args, **options: (bundle, options))
    path, options = demo.demo_bundle()
    assert options["eagle_dir"] == demo.DEMO_EAGLE and options["eagle_vocab"] == demo.DEMO_EAGLE_VOCAB
    alone, without = demo.demo_bundle(head=False)
    assert "eagle_dir" not in without and alone != path
    monkeypatch.setattr(demo, "DEMO_EAGLE", shutil.copytree(demo.DEMO_EAGLE, tmp_path / "eagle"))
    assert demo.demo_bundle()[0] == path
    (tmp_path / "eagle" / "config.json").write_text((tmp_path / "eagle" / "config.json").read_text() + " ")
    assert demo.demo_bundle()[0] not in (path, alone) and demo.demo_bundle(head=False)[0] == alone
    other = shutil.copytree(demo.DEMO_TARGET, tmp_path / "target")
    assert "eagle_dir" not in demo.demo_bundle(other)[1]


def test_cache_key_follows_the_pair_contents(tmp_path, checkpoints):
    target = shutil.copytree(checkpoints("llama"), tmp_path / "t")
    draft = checkpoints("llama", "draft")
    key = demo.demo_key(target, draft)
    assert demo.demo_key(target, draft) == key
    (target / "config.json").write_text((target / "config.json").read_text() + " ")
    assert demo.demo_key(target, draft) != key


def test_load_without_argument_uses_the_demo(tiny_demo):
    runtime = speccompile.load()
    assert runtime.bundle.path.parent == tiny_demo
    [result] = runtime.generate(["def parse_args(argv):"], max_new_tokens=5)
    assert 1 <= len(result.token_ids) <= 5


def test_cli_generate_without_bundle_uses_the_demo(tiny_demo):
    result = CliRunner().invoke(main, ["generate", "--prompt", "import os", "--max-new-tokens", "4", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)[0]["prompt"] == "import os"


def test_missing_demo_pair_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(demo, "DEMO_TARGET", tmp_path / "none")
    result = CliRunner().invoke(main, ["generate", "--prompt", "x"])
    assert result.exit_code == 1 and "no embedded demo pair" in result.output


def test_cache_key_follows_the_bundle_format(monkeypatch, checkpoints):
    """A cached demo bundle of an older format is never reused: opening it would only ask for a rebuild."""
    target, draft = checkpoints("llama"), checkpoints("llama", "draft")
    key = demo.demo_key(target, draft)
    monkeypatch.setattr(demo, "FORMAT_VERSION", demo.FORMAT_VERSION + 1)
    assert demo.demo_key(target, draft) != key
