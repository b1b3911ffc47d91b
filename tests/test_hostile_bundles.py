"""A bundle made by someone else is untrusted input: every file it makes speccompile read is listed in
its manifest, inside its directory, of sane size, and its graphs' external data and ops are checked
before a session opens them. Each hostile bundle is refused with one clear line, before any file
outside it is opened: the file it points at is a named pipe, which blocks whoever opens it."""

import json
import os
import shutil
import threading

import onnx
import pytest

from speccompile import bundle as bundle_module
from speccompile.bundle import MANIFEST, STAMP, open_bundle, sha256_file
from speccompile.errors import SpecCompileError


@pytest.fixture
def copy(tmp_path, bundles):
    """(a copy of a bundle, a named pipe outside it that must never be opened)."""
    made = shutil.copytree(bundles("llama", "random"), tmp_path / "bundle")
    (made / STAMP).unlink()
    trap = tmp_path / "secret"
    os.mkfifo(trap)
    return made, trap


def rewrite(bundle, change) -> None:
    """Edit the manifest as its maker can: `change(manifest)`, then the hashes of the files it lists."""
    manifest = json.loads((bundle / MANIFEST).read_text())
    change(manifest)
    manifest["files"] = {name: sha256_file(bundle / name) if (bundle / name).is_file() else sha
                         for name, sha in manifest["files"].items()}
    (bundle / MANIFEST).write_text(json.dumps(manifest))


def refused_without_opening(bundle, trap, message: str) -> None:
    """open_bundle refuses with `message` and returns; a blocked open of the trap would hang it."""
    outcome = {}

    def attempt():
        try:
            open_bundle(bundle)
            outcome["error"] = None
        except SpecCompileError as e:
            outcome["error"] = str(e)

    thread = threading.Thread(target=attempt, daemon=True)
    thread.start()
    thread.join(60)
    if thread.is_alive():  # it opened the pipe: release it, then fail
        os.close(os.open(trap, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("the bundle made speccompile open a file outside it")
    assert outcome["error"] is not None and message in outcome["error"], outcome
    assert "\n" not in outcome["error"]


def test_a_listed_file_outside_the_bundle_is_refused(copy):
    bundle, trap = copy
    rewrite(bundle, lambda m: m["files"].update({"../secret": "0" * 64}))
    refused_without_opening(bundle, trap, "a path outside its directory")
    rewrite(bundle, lambda m: (m["files"].pop("../secret"), m["files"].update({str(trap): "0" * 64})))
    refused_without_opening(bundle, trap, "a path outside its directory")


def test_a_link_out_of_the_bundle_is_refused(copy):
    bundle, trap = copy
    tokenizer = bundle / "tokenizer" / "tokenizer.json"
    tokenizer.unlink()
    tokenizer.symlink_to(trap)
    refused_without_opening(bundle, trap, "links outside its directory")


def test_a_graph_reading_data_from_outside_the_bundle_is_refused(copy):
    bundle, trap = copy
    graph = bundle / "target_forward.onnx"
    model = onnx.load(str(graph), load_external_data=False)
    external = next(t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL)
    next(e for e in external.external_data if e.key == "location").value = "../secret"
    onnx.save_model(model, str(graph))
    rewrite(bundle, lambda m: None)
    refused_without_opening(bundle, trap, "which the bundle does not list")


def test_a_graph_with_an_op_speccompile_does_not_emit_is_refused(copy):
    bundle, trap = copy
    graph = bundle / "target_forward.onnx"
    model = onnx.load(str(graph), load_external_data=False)
    model.graph.node.append(onnx.helper.make_node("ReadFile", ["input_ids"], ["leak"], domain="com.example"))
    model.opset_import.append(onnx.helper.make_opsetid("com.example", 1))
    onnx.save_model(model, str(graph))
    rewrite(bundle, lambda m: None)
    refused_without_opening(bundle, trap, "an op speccompile does not emit (com.example.ReadFile)")


def test_a_file_the_bundle_reads_but_does_not_list_is_refused(copy):
    bundle, trap = copy
    rewrite(bundle, lambda m: m["graphs"]["target_forward"].update(file="unlisted.onnx"))
    refused_without_opening(bundle, trap, "reads unlisted.onnx, which its manifest does not list")


def test_an_oversized_tokenizer_is_refused(copy, monkeypatch):
    bundle, trap = copy
    monkeypatch.setattr(bundle_module, "TOKENIZER_MAX_BYTES", 1024)
    refused_without_opening(bundle, trap, "over the 1,024 a tokenizer may be")


def test_an_unlisted_file_beside_the_tokenizer_is_refused(copy):
    bundle, trap = copy
    (bundle / "tokenizer" / "chat_template.jinja").symlink_to(trap)
    refused_without_opening(bundle, trap, "holds chat_template.jinja, which the manifest does not list")


def test_a_stamp_that_is_a_pipe_is_never_read(copy):
    bundle, trap = copy
    os.mkfifo(bundle / STAMP)
    assert open_bundle(bundle)  # hashed and checked, as without a stamp


def _graph(m, name="target_forward") -> dict:
    return m["graphs"][name]


# (what the maker writes, what the refusal says): a manifest that does not describe a bundle speccompile
# writes is refused in one line that says where, before any of its files is read
GARBLED = {
    "unknown kind": (lambda m: _graph(m).update(kind="forward_all"), "is no graph speccompile makes"),
    "chain verification without γ": (lambda m: _graph(m, "target_verify_g4").update(gamma=None),
                                     "is no graph speccompile makes"),
    "γ as text": (lambda m: _graph(m, "target_verify_g4").update(gamma="4"), "gamma is not an integer or null"),
    "name not the graph's": (lambda m: m["graphs"].update({"bad\nname": m["graphs"].pop("target_forward")}),
                             r"graph 'bad\nname' records itself as target_forward"),
    "draft graph without a draft": (lambda m: m["models"].pop("draft"), "is the draft's, a model it does not hold"),
    "no target": (lambda m: m["models"].update(helper=m["models"].pop("target")), "its models are not a target"),
    "shape not a list": (lambda m: _graph(m)["inputs"][0].update(shape="batch"),
                         "graphs['target_forward'].inputs[0].shape is not a list"),
    "dimension of neither kind": (lambda m: _graph(m)["inputs"][0]["shape"].append(1.5),
                                  "is not an integer or a string"),
    "count as text": (lambda m: _graph(m).update(nodes="69"), "graphs['target_forward'].nodes is not an integer"),
    "a flag for a size": (lambda m: m.update(max_seq=True), "manifest.max_seq is not an integer"),
    "missing field": (lambda m: m.pop("max_batch"), "manifest has no 'max_batch'"),
    "graphs as a list": (lambda m: m.update(graphs=list(m["graphs"].values())), "manifest.graphs is not an object"),
    "eos ids as text": (lambda m: m["tokenizer"].update(eos_token_ids=["1"]), "tokenizer.eos_token_ids[0] is not"),
    "default γ not compiled": (lambda m: m.update(default_gamma=7), "lack its default γ 7"),
    "session of unknown kinds": (lambda m: m["models"]["target"]["session"]["kinds"].update(read_file=9),
                                 "names a graph kind speccompile does not make"),
    "an EAGLE-3 head's kind on the target": (lambda m: _graph(m).update(kind="step"), "is no graph speccompile makes"),
    "a session running a head's kind": (lambda m: m["models"]["target"]["session"]["kinds"].update(catch_up=7),
                                        "names a graph kind speccompile does not make"),
    "a head without the target's features": (lambda m: m["models"].update(eagle=m["models"]["draft"]),
                                             "records no eagle_aux_layers"),
    "engine without its GPU": (lambda m: m.update(engines={"target_forward": {"file": "target_forward.onnx"}}),
                               "has no 'tensorrt_version'"),
}


@pytest.mark.parametrize("garbled", GARBLED)
def test_a_garbled_manifest_is_refused_in_one_line(copy, garbled):
    bundle, trap = copy
    change, message = GARBLED[garbled]
    rewrite(bundle, change)
    refused_without_opening(bundle, trap, message)
    with pytest.raises(SpecCompileError, match="does not describe a bundle speccompile wrote"):
        open_bundle(bundle)
