"""The bundle: manifest contents, integrity data, graph checks, atomic writes, vocabulary gate."""

import json
import logging

import numpy as np
import onnx
import pytest

from speccompile.bundle import FORMAT_VERSION, TOP_LOGPROBS, TensorSpec, open_bundle, sha256_file
from speccompile.compiler import build as build_module
from speccompile.compiler.build import build_bundle
from speccompile.compiler.trt_rules import tensorrt_violations
from speccompile.errors import SpecCompileError
from tests.tiny_models import make_checkpoint


def test_manifest_describes_every_graph_and_file(bundles):
    bundle = open_bundle(bundles("qwen2", "random"))
    m = bundle.manifest.to_json()  # as written on disk
    assert m["format_version"] == FORMAT_VERSION == 6
    assert m["gammas"] == [1, 4] and m["max_seq"] == 96 and m["max_batch"] == 4
    assert set(m["graphs"]) == {
        "target_forward", "draft_forward", "target_verify_g1", "target_verify_g4",
        "target_sample", "draft_sample", "target_verify_sample_g1", "target_verify_sample_g4", "target_score",
    }
    assert m["models"]["target"]["config"]["model_type"] == "qwen2"
    for name, sha in m["files"].items():
        assert sha256_file(bundle.path / name) == sha
    assert {"target.weights", "draft.weights", "tokenizer/tokenizer.json"} <= set(m["files"])
    verify = m["graphs"]["target_verify_g4"]
    assert [i["name"] for i in verify["inputs"][:2]] == ["input_ids", "past_len"]
    assert verify["inputs"][0]["shape"] == ["batch", 5]
    outputs = {o["name"]: o for o in verify["outputs"]}
    assert outputs["accepted"] == {"name": "accepted", "dtype": "int64", "shape": ["batch"]}
    assert outputs["top_ids"] == {"name": "top_ids", "dtype": "int64", "shape": ["batch", 5, TOP_LOGPROBS]}
    assert outputs["present_key.0"]["shape"] == ["batch", 2, 96, 16]
    assert verify["op_counts"]["SpecAccept"] == 1 and verify["op_counts"]["TensorScatter"] == 4


def test_every_verification_graph_takes_a_draft_len_per_row(bundles):
    """Rows of one verification may carry fewer than γ real drafts: every graph that verifies (each
    kind's, its batch-1 variant, the target's session graph) takes draft_len int64 [batch]."""
    bundle = open_bundle(bundles("llama", "random"))
    files = [bundle.model("target").session.file]
    for name, entry in bundle.manifest.graphs.items():
        takes = TensorSpec("draft_len", "int64", ("batch",)) in entry.inputs
        assert takes == (entry.id.gamma is not None), name
        if takes:
            files += [entry.file] + ([entry.single_sequence.file] if entry.single_sequence else [])
    assert len(files) > 1 + 4  # the variants are there too
    for file in files:
        graph = onnx.load(str(bundle.path / file), load_external_data=False).graph
        [value] = [v for v in graph.input if v.name == "draft_len"]
        assert value.type.tensor_type.elem_type == onnx.TensorProto.INT64, file


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_portable_graphs_pass_onnx_checker_and_tensorrt_rules(bundles, family):
    """--backend onnx: every graph of each kind in standard ops (the int8 draft's DequantizeLinear
    -> MatMul), within TensorRT's parser rules."""
    bundle = open_bundle(bundles(family, "random", backend="onnx"))
    for name in bundle.manifest.graphs:
        path = bundle.graph_path(name)
        onnx.checker.check_model(str(path), full_check=True)
        model = onnx.load(str(path), load_external_data=False)
        assert tensorrt_violations(model) == []
        assert model.opset_import[0].version == 24
        assert not {node.domain for node in model.graph.node} - {"", "speccompile"}, name


def test_draft_matmuls_are_int8_weight_only_and_the_target_stays_float32(bundles):
    bundle = open_bundle(bundles("llama", "random", backend="onnx"))
    models = bundle.manifest.models
    assert models["draft"].matmul_weights == "int8" and models["target"].matmul_weights == "float32"
    for name, role in (("draft_forward", "draft"), ("target_verify_g4", "target")):
        graph = onnx.load(str(bundle.graph_path(name)), load_external_data=False).graph
        int8 = {t.name for t in graph.initializer if t.data_type == onnx.TensorProto.INT8}
        # an int8 model's embedding is int8 blocks too, gathered rather than dequantized
        assert ("embed_q" in int8) == (role == "draft")
        int8.discard("embed_q")
        dequantized = {n.input[0] for n in graph.node if n.op_type == "DequantizeLinear"}
        matmuls = sum(n.op_type == "MatMul" for n in graph.node)
        # per layer: qkv, o, gate_up, down; plus the LM head
        expected = 4 * models[role].num_layers + 1 if role == "draft" else 0
        assert len(int8) == len(dequantized & int8) == expected, (name, sorted(int8))
        assert matmuls == 4 * models[role].num_layers + 1


def test_float32_draft_on_request(bundles):
    bundle = open_bundle(bundles("llama", "random", "float32"))
    assert bundle.model("draft").matmul_weights == "float32"
    graph = onnx.load(str(bundle.graph_path("draft_forward")), load_external_data=False).graph
    assert not any(n.op_type == "DequantizeLinear" for n in graph.node)


def test_verification_graph_returns_a_few_numbers_per_position_never_the_logits(bundles):
    """Integers per sequence, and per position its log-probabilities: never [B, γ+1, V] to the host."""
    bundle = open_bundle(bundles("llama", "random"))
    outputs = bundle.graph("target_verify_g4").outputs
    shapes = {o.name: list(o.shape) for o in outputs if not o.name.startswith("present_")}
    assert shapes == {"accepted": ["batch"], "next_token": ["batch"], "new_len": ["batch"],
                      "token_logprob": ["batch", 5], "top_logprobs": ["batch", 5, TOP_LOGPROBS],
                      "top_ids": ["batch", 5, TOP_LOGPROBS]}


def test_weights_are_stored_once_per_model(bundles):
    bundle = open_bundle(bundles("llama", "random"))
    for graph in bundle.path.glob("*.onnx"):  # every graph, variant and session model refers to the weights file
        model = onnx.load(str(graph), load_external_data=False)
        inline = [t.name for t in model.graph.initializer
                  if t.data_location != onnx.TensorProto.EXTERNAL and t.ByteSize() > 1024]
        assert not inline, f"{graph.name} embeds {inline}"
    sizes = {p.name: p.stat().st_size for p in bundle.path.iterdir()}
    assert sizes["target.weights"] > 4 * bundle.model("target").num_params * 0.99


def test_a_failure_late_in_the_build_leaves_nothing(tmp_path, checkpoints, monkeypatch):
    def reject(model, name):
        raise SpecCompileError(f"graph {name} rejected")

    monkeypatch.setattr(build_module, "check_tensorrt_compatible", reject)
    with pytest.raises(SpecCompileError, match="rejected"):
        build_bundle(checkpoints("llama"), checkpoints("llama"), tmp_path / "out", max_seq=64, backend="onnx")
    assert list(tmp_path.iterdir()) == []


def test_force_replaces_an_existing_bundle(tmp_path, checkpoints):
    out = tmp_path / "b"
    build_bundle(checkpoints("gpt2"), checkpoints("gpt2"), out, gammas=[2], max_seq=64)
    build_bundle(checkpoints("gpt2"), checkpoints("gpt2"), out, gammas=[3], max_seq=64, force=True)
    assert json.loads((out / "manifest.json").read_text())["gammas"] == [3]
    assert [p.name for p in tmp_path.iterdir()] == ["b"]


def test_embedding_padding_difference_is_accepted(tmp_path, tokenizer, checkpoints):
    """Like Qwen2.5 0.5B/7B: same tokenizer, different embedding rows; logits cut to the smaller."""
    import speccompile

    padded = make_checkpoint(tmp_path / "padded", "llama", seed=5, size="draft", tokenizer=tokenizer,
                             vocab_size=len(tokenizer) + 40)
    out = build_bundle(checkpoints("llama"), padded, tmp_path / "b", gammas=[3], max_seq=64)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["vocab_size"] == len(tokenizer) + 8  # the target's (smaller) matrix
    runtime = speccompile.load(out)
    spec = runtime.generate([[3, 4, 5]], max_new_tokens=12)[0].token_ids
    assert spec == runtime.generate([[3, 4, 5]], max_new_tokens=12, mode="autoregressive")[0].token_ids


def test_embedding_smaller_than_tokenizer_is_refused(tmp_path, tokenizer, checkpoints):
    small = make_checkpoint(tmp_path / "small", "llama", size="draft", tokenizer=tokenizer,
                            vocab_size=len(tokenizer) - 10)
    with pytest.raises(SpecCompileError, match="embeds only"):
        build_bundle(checkpoints("llama"), small, tmp_path / "b")


def test_single_sequence_variants_for_the_models_the_fused_kernel_takes(bundles):
    """ONNX Runtime's GroupQueryAttention needs head_dim % 16 == 0: the tiny target (16) gets batch-1
    variants of all its graphs, the tiny random draft (8) none. TensorRT reads only the standard graphs."""
    bundle = open_bundle(bundles("llama", "random"))
    graphs = bundle.manifest.graphs
    for name, entry in graphs.items():
        variant = entry.single_sequence
        if entry.id.model == "draft":
            assert variant is None, name
            continue
        assert variant.file == f"{name}_b1.onnx" and variant.batch == 1, name
        assert bundle.manifest.files[variant.file] == sha256_file(bundle.path / variant.file)
        model = onnx.load(str(bundle.path / variant.file), load_external_data=False)
        assert {o.name for o in model.graph.output} == {o.name for o in entry.outputs}  # the same interface
        assert not [t for t in model.graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL and t.dims and
                    np.prod(t.dims) > 1024], "weights are shared with the standard graph, not copied"


def test_no_single_sequence_variants_on_request(tmp_path, checkpoints):
    bundle = open_bundle(build_bundle(checkpoints("llama"), checkpoints("llama"), tmp_path / "b", gammas=[2],
                                      max_seq=64, single_sequence=False))
    assert not any(entry.single_sequence for entry in bundle.manifest.graphs.values())
    assert not list(bundle.path.glob("*_b1.onnx"))


def test_a_draft_larger_than_the_target_builds_with_a_warning(tmp_path, checkpoints, caplog):
    """Still exact (the target decides every token), so a warning, not an error: it is most often
    --target and --draft swapped."""
    build_bundle(checkpoints("llama", "draft"), checkpoints("llama"), tmp_path / "b", gammas=[2], max_seq=32,
                 single_sequence=False)
    [warning] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "is larger than the target" in warning and "swapped" in warning
    caplog.clear()
    build_bundle(checkpoints("llama"), checkpoints("llama", "draft"), tmp_path / "c", gammas=[2], max_seq=32,
                 single_sequence=False)
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_a_draft_vocab_corpus_without_draft_vocab_is_refused_before_any_work(tmp_path, checkpoints, monkeypatch):
    monkeypatch.setattr(build_module, "load_checkpoint", lambda path: pytest.fail("loaded a checkpoint"))
    with pytest.raises(SpecCompileError, match="--draft-vocab K \\(or --eagle-vocab K\\)"):
        build_bundle(checkpoints("llama"), checkpoints("llama", "draft"), tmp_path / "b",
                     draft_vocab_corpus="corpus.txt")
    assert list(tmp_path.iterdir()) == []
