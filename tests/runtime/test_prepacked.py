"""Saved pre-packed session graphs (runtime/prepacked.py): made by the first load on a machine, used
by the next, identical tokens, and never used once the bundle or the saved files change."""

import json
import os
import shutil

import pytest

import speccompile
from speccompile.runtime import onnxruntime_engine, prepacked

PROMPTS = [[5, 17, 33, 2, 9], [8, 9, 10]]


@pytest.fixture
def bundle(bundles, tmp_path, monkeypatch):
    monkeypatch.setattr(onnxruntime_engine, "ONE_SESSION_MIN_BYTES", 0)  # tiny models run on session graphs too
    return shutil.copytree(bundles("llama", "random"), tmp_path / "b")


def load_and_generate(path):
    runtime = speccompile.load(path)
    tokens = [r.token_ids for r in runtime.generate(PROMPTS, max_new_tokens=12, gamma=4)]
    greedy_one = runtime.generate(PROMPTS[:1], max_new_tokens=12, temperature=0.9, seed=3)[0].token_ids
    return runtime, tokens + [greedy_one]


def test_the_first_load_saves_the_next_loads_it_with_the_same_tokens(bundle):
    first, expected = load_and_generate(bundle)
    assert first.target.session_source == first.draft.session_source == "saving"
    saved = prepacked.prepacked_dir(first.bundle)
    assert {"target_session.onnx", "target_session.onnx.data", "draft_session.onnx"} <= set(os.listdir(saved))
    second, tokens = load_and_generate(bundle)
    assert second.target.session_source == second.draft.session_source == "saved"
    assert tokens == expected


def test_a_touched_saved_file_or_a_rebuilt_bundle_is_made_again(bundle):
    first, expected = load_and_generate(bundle)
    data = prepacked.prepacked_dir(first.bundle) / "target_session.onnx.data"
    with open(data, "r+b") as f:  # same size, other bytes: only the stamp can tell
        f.write(b"\0" * 8)
    again, tokens = load_and_generate(bundle)
    assert again.target.session_source == "saving" and again.draft.session_source == "saved"
    assert tokens == expected
    stamp = prepacked.prepacked_dir(first.bundle) / "draft_session.onnx.stamp.json"
    recorded = json.loads(stamp.read_text())
    stamp.write_text(json.dumps({**recorded, "source_sha256": "0" * 64}))  # made from another build
    assert speccompile.load(bundle).draft.session_source == "saving"


def test_a_bundle_it_cannot_write_to_runs_without_saving(bundle, monkeypatch):
    monkeypatch.setattr(prepacked, "_writable", lambda directory: False)  # a read-only bundle (root writes anyway)
    runtime, _ = load_and_generate(bundle)
    assert runtime.target.session_source == runtime.draft.session_source == "plain"
