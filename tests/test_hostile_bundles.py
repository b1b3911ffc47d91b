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
