"""Opening a bundle: the stamp of the last full check spares re-hashing; any changed file is still refused."""

import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from speccompile import bundle as bundle_module
from speccompile.bundle import STAMP, open_bundle
from speccompile.cli import main
from speccompile.errors import SpecCompileError


@pytest.fixture
def bundle_copy(tmp_path, bundles):
    return shutil.copytree(bundles("llama", "random"), tmp_path / "bundle")


@pytest.fixture
def hashed(monkeypatch):
    """The files sha256_file reads, in order."""
    files = []
    original = bundle_module.sha256_file

    def counting(path):
        files.append(path.name)
        return original(path)

    monkeypatch.setattr(bundle_module, "sha256_file", counting)
    return files


@pytest.fixture
def not_racy(monkeypatch):
    """Files written just now count as settled (the tests' files are all seconds old at most)."""
    monkeypatch.setattr(bundle_module, "RACY_NS", 0)


def test_an_unchanged_bundle_opens_without_hashing(bundle_copy, hashed, not_racy):
    open_bundle(bundle_copy)  # a copy has new inodes: hashed once, then stamped
    assert "target.weights" in hashed
    hashed.clear()
    open_bundle(bundle_copy)
    assert hashed == ["manifest.json"]  # the manifest's hash, against the stamp's: a few kB


def test_a_freshly_built_bundle_is_stamped(tmp_path, checkpoints, hashed, not_racy):
    from speccompile.compiler.build import build_bundle

    out = build_bundle(checkpoints("llama"), checkpoints("llama", "draft"), tmp_path / "b", gammas=[2], max_seq=64,
                       max_batch=1, single_sequence=False)
    hashed.clear()
    open_bundle(out)
    assert hashed == ["manifest.json"]


def test_files_changed_just_before_their_stamp_are_hashed_again(bundle_copy, hashed):
    """A write in the same clock tick as the stamp could leave the ctime unchanged: such files are
    not vouched for until they are older than the stamp by RACY_NS."""
    open_bundle(bundle_copy)
    hashed.clear()
    open_bundle(bundle_copy)
    assert "target.weights" in hashed


@pytest.mark.parametrize("change", ["same size", "appended", "replaced"])
def test_a_changed_weight_file_is_refused_after_a_stamp(bundle_copy, change):
    open_bundle(bundle_copy)
    weights = bundle_copy / "target.weights"
    data = bytearray(weights.read_bytes())
    if change == "same size":
        data[64] ^= 0x01
        with open(weights, "r+b") as f:  # written in place: same inode, same size
            f.write(bytes(data))
    elif change == "appended":
        with open(weights, "ab") as f:
            f.write(b"\0")
    else:
        data[64] ^= 0x01
        (bundle_copy / "new").write_bytes(bytes(data))
        os.replace(bundle_copy / "new", weights)
    with pytest.raises(SpecCompileError, match="target.weights.*sha256"):
        open_bundle(bundle_copy)


def test_a_changed_manifest_is_checked_again(bundle_copy, hashed):
    open_bundle(bundle_copy)
    manifest = bundle_copy / "manifest.json"
    manifest.write_text(manifest.read_text())  # same bytes, rewritten: the stamp no longer vouches for it
    hashed.clear()
    open_bundle(bundle_copy)
    assert "target.weights" in hashed


def test_a_corrupt_stamp_means_a_full_check(bundle_copy, hashed):
    open_bundle(bundle_copy)
    (bundle_copy / STAMP).write_text("{not json")
    hashed.clear()
    open_bundle(bundle_copy)
    assert "target.weights" in hashed


def test_verify_command_hashes_even_a_stamped_bundle(bundle_copy, hashed):
    open_bundle(bundle_copy)
    hashed.clear()
    result = CliRunner().invoke(main, ["verify", str(bundle_copy)])
    assert result.exit_code == 0, result.output
    assert "match their sha256" in result.output
    assert "target.weights" in hashed and "draft.weights" in hashed


def test_verify_command_names_a_corrupt_file(bundle_copy):
    weights = bundle_copy / "draft.weights"
    data = bytearray(weights.read_bytes())
    data[10] ^= 0xFF
    weights.write_bytes(bytes(data))
    result = CliRunner().invoke(main, ["verify", str(bundle_copy)])
    assert result.exit_code == 1 and "draft.weights" in result.output and "sha256" in result.output


def test_inspect_reports_what_the_bundle_needs_in_memory(bundles):
    bundle = bundles("llama", "random")
    info = json.loads(CliRunner().invoke(main, ["inspect", str(bundle), "--json"]).stdout)
    manifest = open_bundle(bundle).manifest
    for role in ("target", "draft"):
        model, memory = manifest.models[role], info["memory"][role]
        assert memory["weights_bytes"] == (bundle / f"{role}.weights").stat().st_size
        per_sequence = 2 * model.num_layers * model.num_kv_heads * model.head_dim * manifest.max_seq * 4
        assert memory["kv_cache_bytes_per_sequence"] == per_sequence
        assert memory["kv_cache_bytes_at_max_batch"] == per_sequence * manifest.max_batch
        assert memory["weight_copies"] == "one per graph run"  # tiny weights: a session per graph
    assert info["memory"]["draft"]["matmul_weights"] == "int8"
    text = CliRunner().invoke(main, ["inspect", str(bundle)]).stdout
    assert "target memory: weights" in text and "KV cache" in text


def test_graph_names_are_derived_from_what_a_graph_is():
    from speccompile.bundle import GraphId

    assert GraphId("target", "forward").name == "target_forward"
    assert GraphId("draft", "sample").name == "draft_sample"
    assert GraphId.verification(4, sample=False).name == "target_verify_g4"
    assert GraphId.verification(6, sample=True).name == "target_verify_sample_g6"
    assert GraphId.verification(2, sample=True).outputs == ("accepted", "next_token", "new_len", "token_logprob",
                                                             "top_logprobs", "top_ids")
    assert GraphId.score().name == "target_score" and GraphId.score().positions_scored == "all"
    assert GraphId.step("target", sample=True).positions_scored == "last"
    with pytest.raises(AssertionError):
        GraphId("target", "verify")  # a verification has a γ
    with pytest.raises(AssertionError):
        GraphId("target", "forward", 4)


def test_an_eagle_head_s_graphs_are_its_own_kinds():
    from speccompile.bundle import GraphId, output_array

    assert (GraphId.eagle_catch_up().name, GraphId.eagle_step().name) == ("eagle_catch_up", "eagle_step")
    for graph in (GraphId.eagle_catch_up(), GraphId.eagle_step()):
        assert graph.outputs == ("next_token", "confidence", "hidden") and graph.positions_scored == "last"
        assert not graph.verifies and not graph.sampling and graph.gamma is None
    # the head's hidden state is one per sequence, the target's features one per position
    assert output_array("hidden", 3, 100, hidden=64) == ((3, 64), "float32")
    assert output_array("aux_hidden", 3, 100, positions=5, hidden=192) == ((3, 5, 192), "float32")
    for model, kind in (("target", "step"), ("draft", "catch_up"), ("eagle", "forward")):
        with pytest.raises(AssertionError):
            GraphId(model, kind)


def test_the_manifest_records_each_graph_as_its_id(bundles):
    from speccompile.bundle import GraphId

    manifest = open_bundle(bundles("llama", "random")).manifest
    for name, entry in manifest.to_json()["graphs"].items():  # as written on disk
        graph = GraphId(entry["model"], entry["kind"], entry["gamma"])
        assert graph.name == name and entry["file"] == f"{name}.onnx"
        assert manifest.graphs[name].id == graph


def test_a_bundle_of_the_previous_format_asks_for_a_rebuild(bundle_copy):
    """Format 5's graphs lack the grammar masks (format 4's, the logits processors, log-probabilities
    and the scoring graph; format 3's sampling graphs, the coupled rule's inputs; format 2's greedy
    steps, their confidence; format 1's verifications, draft_len): one error that says to rebuild,
    before any graph loads."""
    manifest = json.loads((bundle_copy / "manifest.json").read_text())
    for old in (1, 2, 3, 4, 5):
        (bundle_copy / "manifest.json").write_text(json.dumps({**manifest, "format_version": old}))
        refused = rf"format version {old} is not supported .*reads version 6\); rebuild"
        with pytest.raises(SpecCompileError, match=refused):
            open_bundle(bundle_copy)


@pytest.mark.parametrize("draft", ["random", "medusa"])
def test_the_manifest_reads_back_as_it_was_written(bundles, draft):
    """The typed manifest is the JSON on disk, field for field, and reading its JSON gives it back."""
    from speccompile.bundle import Manifest

    bundle = bundles("llama", draft)
    manifest = open_bundle(bundle).manifest
    assert Manifest.from_json(manifest.to_json()) == manifest
    assert manifest.to_json() == json.loads((bundle / "manifest.json").read_text())
    assert (manifest.medusa is not None) == (draft == "medusa") and not manifest.engines


def test_engines_read_back_as_they_were_written(bundles):
    import dataclasses

    from speccompile.bundle import EngineEntry, Manifest

    manifest = open_bundle(bundles("llama", "random")).manifest
    engine = EngineEntry("engines/target_forward.engine", "10.9.0", "NVIDIA H200", "9.0", 2, False, True)
    built = dataclasses.replace(manifest, engines={"target_forward": engine})
    assert built.to_json()["engines"] == {"target_forward": {
        "file": "engines/target_forward.engine", "tensorrt_version": "10.9.0", "gpu": "NVIDIA H200",
        "compute_capability": "9.0", "profiles": 2, "hardware_compatible": False, "version_compatible": True}}
    assert Manifest.from_json(built.to_json()) == built
    assert "engines/target_forward.engine" in built.referenced_files()


def test_the_manifest_is_read_as_json_in_the_bundle_module_alone():
    """Every other module reads the typed Manifest's attributes: a manifest dict indexed elsewhere
    would be a second reader of the format."""
    import re

    import speccompile

    package = Path(speccompile.__file__).parent
    readers = [f"{path.relative_to(package.parent)}:{n}" for path in sorted(package.rglob("*.py"))
               if path.name != "bundle.py" or path.parent != package
               for n, line in enumerate(path.read_text().splitlines(), 1) if re.search(r"manifest(\[|\.get\()", line)]
    assert readers == []
