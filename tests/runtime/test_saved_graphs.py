"""Saved optimized session graphs (runtime/saved_graphs.py): made by the first load on a machine, in the
user's cache (the bundle unchanged), reading their weights from the bundle's files (no copy), used by
the next load, identical tokens, never used once the bundle or the saved files change, made whole by
one of two processes at once, and the least recently used removed beyond the cache's limit."""

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
from speccompile.runtime import onnxruntime_engine, saved_graphs

PROMPTS = [[5, 17, 33, 2, 9], [8, 9, 10]]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bundle(bundles, tmp_path, monkeypatch):
    monkeypatch.setattr(onnxruntime_engine, "ONE_SESSION_MIN_BYTES", 0)  # tiny models run on session graphs too
    monkeypatch.setattr(saved_graphs, "saved_graphs_root", lambda: tmp_path / "cache")  # this test's own
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
    saved = saved_graphs.saved_dir(first.bundle)
    assert sorted(os.listdir(saved)) == ["draft_session", "target_session"]
    assert sorted(os.listdir(saved / "target_session")) == ["model.onnx", "stamp.json"]
    assert bundle_files(bundle) == built  # the bundle is as it was built
    for graph in ("target_session", "draft_session"):
        assert_reads_the_bundles_weights(saved / graph / "model.onnx", bundle / f"{graph}.onnx")
    second, tokens = load_and_generate(bundle)
    assert second.target.session_source == second.draft.session_source == "saved"
    assert tokens == expected


def test_a_touched_saved_file_or_a_rebuilt_bundle_is_made_again(bundle):
    first, expected = load_and_generate(bundle)
    saved = saved_graphs.saved_dir(first.bundle) / "target_session" / "model.onnx"
    with open(saved, "r+b") as f:  # same size, other bytes: only the stamp can tell
        f.seek(saved.stat().st_size // 2)
        f.write(b"\0" * 8)
    again, tokens = load_and_generate(bundle)
    assert again.target.session_source == "saving" and again.draft.session_source == "saved"
    assert tokens == expected
    stamp = saved_graphs.saved_dir(first.bundle) / "draft_session" / "stamp.json"
    recorded = json.loads(stamp.read_text())
    stamp.write_text(json.dumps({**recorded, "source_sha256": "0" * 64}))  # made from another build
    assert speccompile.load(bundle).draft.session_source == "saving"


def assert_reads_the_bundles_weights(saved: Path, source: Path):
    """Every tensor of the saved graph that is not in the graph itself reads the bundle's weights
    where the bundle's own graph reads the tensor of that name; the optimizer's own tensors are in
    the graph."""
    import onnx

    from speccompile.bundle import graph_initializers
    from speccompile.runtime.saved_graphs import _external

    def external(path):
        return {t.name: _external(t) for t in graph_initializers(onnx.load(str(path), load_external_data=False).graph)
                if t.data_location == onnx.TensorProto.EXTERNAL}

    reads, bundle_reads = external(saved), external(source)
    assert reads and all(entry == bundle_reads[name] for name, entry in reads.items())


def test_the_legacy_pre_packed_copies_are_removed(bundle):
    """An older layout of the cache kept pre-packed copies of the weights beside it (gigabytes)."""
    legacy = saved_graphs.saved_graphs_root().parent / saved_graphs.LEGACY_DIRECTORY
    (legacy / "0123" / "abcd" / "target_session").mkdir(parents=True)
    (legacy / "0123" / "abcd" / "target_session" / "model.onnx.data").write_bytes(b"\0" * 1024)
    assert load_and_generate(bundle)[0].target.session_source == "saving"
    assert not legacy.exists()


def test_a_graph_the_optimizer_adds_too_much_to_runs_as_made(bundle, monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(saved_graphs, "MADE_TENSORS_MAX_BYTES", -1)  # any tensor it makes is too much
        first, expected = load_and_generate(bundle)
    assert first.target.session_source == "plain"
    assert not (saved_graphs.saved_dir(first.bundle) / "target_session").exists()
    assert load_and_generate(bundle)[1] == expected


def test_a_cache_it_cannot_write_to_or_a_limit_of_zero_runs_without_saving(bundle, monkeypatch, tmp_path):
    (tmp_path / "a file").write_text("")
    monkeypatch.setattr(saved_graphs, "saved_graphs_root", lambda: tmp_path / "a file" / "cache")  # root writes anyway
    runtime, _ = load_and_generate(bundle)
    assert runtime.target.session_source == runtime.draft.session_source == "plain"
    monkeypatch.setattr(saved_graphs, "saved_graphs_root", lambda: tmp_path / "cache")
    monkeypatch.setenv(saved_graphs.LIMIT_ENV, "0")
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
    assert saved_graphs.saved_dir(open_bundle(other, verify=False)) != saved_graphs.saved_dir(built)
    assert saved_graphs.saved_dir(open_bundle(shutil.copytree(bundle, tmp_path / "copy"))) == \
        saved_graphs.saved_dir(built)  # a copy of the same bundle shares them


def test_two_processes_saving_at_once_leave_one_whole_copy(bundle, tmp_path):
    """Each makes its copy in a directory of its own and renames it into place: whichever rename comes
    second, what is there is whole and valid, and both processes decode the same tokens."""
    script = (f"import sys, json; sys.path.insert(0, {str(ROOT)!r})\n"
              "from speccompile.runtime import onnxruntime_engine, saved_graphs\n"
              "from pathlib import Path\n"
              "onnxruntime_engine.ONE_SESSION_MIN_BYTES = 0\n"
              f"saved_graphs.saved_graphs_root = lambda: Path({str(tmp_path / 'cache')!r})\n"
              "from tests.runtime.test_saved_graphs import load_and_generate\n"
              f"runtime, tokens = load_and_generate({str(bundle)!r})\n"
              "print(json.dumps([runtime.target.session_source, tokens]))\n")
    runs = [subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)
            for _ in range(2)]
    results = [json.loads(run.communicate(timeout=300)[0].splitlines()[-1]) for run in runs]
    assert results[0][1] == results[1][1]
    saved = saved_graphs.saved_dir(speccompile.load(bundle).bundle)
    assert sorted(p.name for p in saved.iterdir()) == ["draft_session", "target_session"]  # no leftovers
    third, tokens = load_and_generate(bundle)
    assert third.target.session_source == third.draft.session_source == "saved" and tokens == results[0][1]


def test_the_least_recently_used_saved_graphs_go_beyond_the_limit(bundle, tmp_path, monkeypatch):
    first, _ = load_and_generate(bundle)
    saved = saved_graphs.saved_dir(first.bundle)
    sizes = {name: sum(f.stat().st_size for f in (saved / name).iterdir()) for name in os.listdir(saved)}
    old = time.time() - 3600
    os.utime(saved / "draft_session", (old, old))  # used an hour ago; the target's just now
    monkeypatch.setenv(saved_graphs.LIMIT_ENV, str((sizes["target_session"] + 1) / 1e9))
    saved_graphs._evict(keep=saved / "target_session")
    assert os.listdir(saved) == ["target_session"]


def test_a_limit_that_is_not_a_number_is_refused_in_one_line(bundle, monkeypatch):
    monkeypatch.setenv(saved_graphs.LIMIT_ENV, "lots")
    with pytest.raises(SpecCompileError, match=f"^{saved_graphs.LIMIT_ENV} must be a number of GB"):
        speccompile.load(bundle)
