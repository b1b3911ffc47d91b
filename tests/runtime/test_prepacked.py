"""Saved pre-packed session graphs (runtime/prepacked.py): made by the first load on a machine, in the
user's cache (the bundle unchanged), used by the next, identical tokens, never used once the bundle or
the saved files change, made whole by one of two processes at once, and the least recently used
removed beyond the cache's limit."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import speccompile
from speccompile.errors import SpecCompileError
from speccompile.runtime import onnxruntime_engine, prepacked

PROMPTS = [[5, 17, 33, 2, 9], [8, 9, 10]]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bundle(bundles, tmp_path, monkeypatch):
    monkeypatch.setattr(onnxruntime_engine, "ONE_SESSION_MIN_BYTES", 0)  # tiny models run on session graphs too
    monkeypatch.setattr(prepacked, "prepacked_root", lambda: tmp_path / "cache")  # this test's own
    return shutil.copytree(bundles("llama", "random"), tmp_path / "b")


def load_and_generate(path):
    runtime = speccompile.load(path)
    tokens = [r.token_ids for r in runtime.generate(PROMPTS, max_new_tokens=12, gamma=4)]
    greedy_one = runtime.generate(PROMPTS[:1], max_new_tokens=12, temperature=0.9, seed=3)[0].token_ids
    return runtime, tokens + [greedy_one]


def bundle_files(path) -> dict[str, int]:
    """Every file of the bundle and its size, but the calibration a load records (a few hundred bytes)."""
    return {str(f.relative_to(path)): f.stat().st_size for f in path.rglob("*")
            if f.is_file() and f.parent.name != "profiles"}


def test_the_first_load_saves_the_next_loads_it_with_the_same_tokens(bundle):
    built = bundle_files(bundle)
    first, expected = load_and_generate(bundle)
    assert first.target.session_source == first.draft.session_source == "saving"
    saved = prepacked.prepacked_dir(first.bundle)
    assert sorted(os.listdir(saved)) == ["draft_session", "target_session"]
    assert sorted(os.listdir(saved / "target_session")) == ["model.onnx", "model.onnx.data", "stamp.json"]
    assert bundle_files(bundle) == built  # the bundle is as it was built
    second, tokens = load_and_generate(bundle)
    assert second.target.session_source == second.draft.session_source == "saved"
    assert tokens == expected


def test_a_touched_saved_file_or_a_rebuilt_bundle_is_made_again(bundle):
    first, expected = load_and_generate(bundle)
    data = prepacked.prepacked_dir(first.bundle) / "target_session" / "model.onnx.data"
    with open(data, "r+b") as f:  # same size, other bytes: only the stamp can tell
        f.write(b"\0" * 8)
    again, tokens = load_and_generate(bundle)
    assert again.target.session_source == "saving" and again.draft.session_source == "saved"
    assert tokens == expected
    stamp = prepacked.prepacked_dir(first.bundle) / "draft_session" / "stamp.json"
    recorded = json.loads(stamp.read_text())
    stamp.write_text(json.dumps({**recorded, "source_sha256": "0" * 64}))  # made from another build
    assert speccompile.load(bundle).draft.session_source == "saving"


def test_a_cache_it_cannot_write_to_or_a_limit_of_zero_runs_without_saving(bundle, monkeypatch, tmp_path):
    (tmp_path / "a file").write_text("")
    monkeypatch.setattr(prepacked, "prepacked_root", lambda: tmp_path / "a file" / "cache")  # root writes anyway
    runtime, _ = load_and_generate(bundle)
    assert runtime.target.session_source == runtime.draft.session_source == "plain"
    monkeypatch.setattr(prepacked, "prepacked_root", lambda: tmp_path / "cache")
    monkeypatch.setenv(prepacked.LIMIT_ENV, "0")
    runtime, _ = load_and_generate(bundle)
    assert runtime.target.session_source == runtime.draft.session_source == "plain"
    assert not (tmp_path / "cache").exists()


def test_a_rebuilt_bundle_with_the_same_graphs_gets_its_own_saved_graphs(bundle, tmp_path):
    """Same graph files, other weights: keyed by every file's hash, not the graph's alone."""
    from speccompile.bundle import open_bundle

    other = shutil.copytree(bundle, tmp_path / "other")
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["files"]["target.weights"] = "0" * 64  # what a rebuild with other weights would record
    (other / "manifest.json").write_text(json.dumps(manifest))
    built = open_bundle(bundle)
    assert prepacked.prepacked_dir(open_bundle(other, verify=False)) != prepacked.prepacked_dir(built)
    assert prepacked.prepacked_dir(open_bundle(shutil.copytree(bundle, tmp_path / "copy"))) == \
        prepacked.prepacked_dir(built)  # a copy of the same bundle shares them


def test_two_processes_saving_at_once_leave_one_whole_copy(bundle, tmp_path):
    """Each makes its copy in a directory of its own and renames it into place: whichever rename comes
    second, what is there is whole and valid, and both processes decode the same tokens."""
    script = (f"import sys, json; sys.path.insert(0, {str(ROOT)!r})\n"
              "from speccompile.runtime import onnxruntime_engine, prepacked\n"
              "from pathlib import Path\n"
              "onnxruntime_engine.ONE_SESSION_MIN_BYTES = 0\n"
              f"prepacked.prepacked_root = lambda: Path({str(tmp_path / 'cache')!r})\n"
              "from tests.runtime.test_prepacked import load_and_generate\n"
              f"runtime, tokens = load_and_generate({str(bundle)!r})\n"
              "print(json.dumps([runtime.target.session_source, tokens]))\n")
    runs = [subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)
            for _ in range(2)]
    results = [json.loads(run.communicate(timeout=300)[0].splitlines()[-1]) for run in runs]
    assert results[0][1] == results[1][1]
    saved = prepacked.prepacked_dir(speccompile.load(bundle).bundle)
    assert sorted(p.name for p in saved.iterdir()) == ["draft_session", "target_session"]  # no leftovers
    third, tokens = load_and_generate(bundle)
    assert third.target.session_source == third.draft.session_source == "saved" and tokens == results[0][1]


def test_the_least_recently_used_saved_graphs_go_beyond_the_limit(bundle, tmp_path, monkeypatch):
    first, _ = load_and_generate(bundle)
    saved = prepacked.prepacked_dir(first.bundle)
    sizes = {name: sum(f.stat().st_size for f in (saved / name).iterdir()) for name in os.listdir(saved)}
    old = time.time() - 3600
    os.utime(saved / "draft_session", (old, old))  # used an hour ago; the target's just now
    monkeypatch.setenv(prepacked.LIMIT_ENV, str((sizes["target_session"] + 1) / 1e9))
    prepacked._evict(keep=saved / "target_session")
    assert os.listdir(saved) == ["target_session"]


def test_a_limit_that_is_not_a_number_is_refused_in_one_line(bundle, monkeypatch):
    monkeypatch.setenv(prepacked.LIMIT_ENV, "lots")
    with pytest.raises(SpecCompileError, match=f"^{prepacked.LIMIT_ENV} must be a number of GB"):
        speccompile.load(bundle)
