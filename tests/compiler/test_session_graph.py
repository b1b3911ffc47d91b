"""The session graph (compiler/session_graph.py): every call of the loop, in one graph, same results.

Oracle: the graph of each kind (themselves checked against HF in test_transformer_parity.py), run
on the same inputs and the same cache, with the session graph's `kind` and `fused` inputs set as the
runtime sets them.
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import speccompile
from speccompile.bundle import GraphId, open_bundle
from speccompile.compiler.trt_rules import tensorrt_violations
from speccompile.errors import SpecCompileError
from tests.compiler.test_transformer_parity import empty_cache, run_with_cache
from tests.conftest import FAMILIES

SAMPLING = ("temperature", "top_k", "top_p")


def session(bundle, role):
    return ort.InferenceSession(str(bundle.path / bundle.model(role).session.file))


def run_session(sess, bundle, role, kind, fused, feeds, cache):
    kinds = bundle.model(role).session.kinds
    if "token_count" not in feeds:
        feeds = {**feeds, "token_count": np.full(len(feeds["past_len"]), feeds["input_ids"].shape[1], np.int64)}
    return run_with_cache(sess, {**feeds, "kind": np.array(kinds[kind], np.int64), "fused": np.array(fused)}, cache)


def graph_session(bundle, name, fused):
    """The graph of one kind, as the runtime runs it without a session graph."""
    entry = bundle.graph(name)
    return ort.InferenceSession(str(bundle.path / (entry.single_sequence.file if fused else entry.file)))


def copied(cache: dict) -> dict:
    return {k: v.copy() for k, v in cache.items()}


def prefilled(bundle, sess, batch, fused):
    """A cache after a right-padded prefill of `batch` prompts of different lengths."""
    prompts = [[5, 17, 33, 2, 9], [8, 9, 10], [11, 12, 13, 14]][:batch]
    ids = np.array([p + [0] * (5 - len(p)) for p in prompts], np.int64)
    lengths = np.array([len(p) for p in prompts], np.int64)
    cache = empty_cache(bundle.manifest, "target", batch)
    run_session(sess, bundle, "target", "forward", fused,
                {"input_ids": ids, "past_len": np.zeros(batch, np.int64), "token_count": lengths}, cache)
    return cache, lengths


def sampling_feeds(rng, batch, gamma, vocab):
    probs = rng.random((batch, gamma, vocab)).astype(np.float32)
    return {"draft_probs": probs / probs.sum(-1, keepdims=True), "temperature": np.full(batch, 0.9, np.float32),
            "top_k": np.zeros(batch, np.int64), "top_p": np.full(batch, 0.95, np.float32),
            "u_accept": rng.random((batch, gamma)).astype(np.float32), "u_sample": rng.random(batch).astype(np.float32),
            "coupled": np.arange(batch) % 2 == 1,  # the coupled rule in odd rows
            "verify_noise": rng.random((batch, gamma + 1, vocab)).astype(np.float32)}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("batch", [1, 2])
def test_session_graph_agrees_with_the_graph_of_every_kind(family, batch, bundles):
    bundle = open_bundle(bundles(family, "random"))
    sess = session(bundle, "target")
    vocab = bundle.vocab_size
    fused = batch == 1 and bundle.graph("target_forward").single_sequence is not None
    cache, lengths = prefilled(bundle, sess, batch, fused)
    rng = np.random.default_rng(0)
    for gamma in bundle.gammas:
        for sample in (False, True):
            graph = GraphId.verification(gamma, sample)
            feeds = {"input_ids": rng.integers(0, vocab, (batch, gamma + 1)), "past_len": lengths,
                     "draft_len": rng.integers(0, gamma + 1, batch)}
            if sample:
                feeds |= sampling_feeds(rng, batch, gamma, vocab)
            theirs, ours = copied(cache), copied(cache)
            expected = run_with_cache(graph_session(bundle, graph.name, fused), dict(feeds), theirs)
            got = run_session(sess, bundle, "target", graph.kind, fused, feeds, ours)
            for key in ("accepted", "next_token", "new_len"):
                assert got[key].tolist() == expected[key].tolist(), (graph.name, key)
            for key in cache:  # the same cache entries written
                np.testing.assert_allclose(ours[key], theirs[key], atol=1e-5)
    steps = {"input_ids": rng.integers(0, vocab, (batch, 1)), "past_len": lengths,
             "token_count": np.ones(batch, np.int64)}
    controls = {k: v for k, v in sampling_feeds(rng, batch, 1, vocab).items() if k in SAMPLING}
    sampled = {**controls, "uniform": rng.random(batch).astype(np.float32), "coupled": np.arange(batch) % 2 == 1,
               "noise": rng.random((batch, vocab)).astype(np.float32)}
    for kind, extra in (("forward", {}), ("sample", sampled)):
        feeds = {**steps, **extra}
        expected = run_with_cache(graph_session(bundle, f"target_{kind}", fused), dict(feeds), copied(cache))
        got = run_session(sess, bundle, "target", kind, fused, feeds, copied(cache))
        assert got["next_token"].tolist() == expected["next_token"].tolist(), kind
        if kind == "forward":
            np.testing.assert_allclose(got["confidence"], expected["confidence"], atol=1e-6)
        if kind == "sample":
            np.testing.assert_allclose(got["probs"], expected["probs"], atol=1e-6)


def test_a_verification_without_draft_len_proposes_nothing(bundles):
    """draft_len has the session graph's zero default, like every input only some kinds read: a
    verification that left it out would emit one target token per row (slow, but never wrong)."""
    bundle = open_bundle(bundles("llama", "random"))
    sess = session(bundle, "target")
    cache, lengths = prefilled(bundle, sess, 2, fused=False)
    ids = np.array([[9, 1, 2, 3, 4], [10, 5, 6, 7, 8]], np.int64)
    feeds = {"input_ids": ids, "past_len": lengths}
    left_out = run_session(sess, bundle, "target", "verify", False, feeds, copied(cache))
    zero = run_session(sess, bundle, "target", "verify", False, {**feeds, "draft_len": np.zeros(2, np.int64)},
                       copied(cache))
    for key in ("accepted", "next_token", "new_len"):
        assert left_out[key].tolist() == zero[key].tolist(), key
    assert left_out["accepted"].tolist() == [0, 0] and left_out["new_len"].tolist() == (lengths + 1).tolist()


def test_a_cut_vocabulary_draft_scores_its_subset_greedily_and_the_whole_head_when_sampling(tmp_path, checkpoints):
    from speccompile.compiler.build import build_bundle

    counts = np.arange(320, dtype=np.int64)[::-1]  # token 0 most frequent
    draft = tmp_path / "draft"
    shutil.copytree(checkpoints("llama"), draft)
    (draft / "token_frequencies.json").write_text(json.dumps({"counts": counts.tolist()}))
    bundle = open_bundle(build_bundle(checkpoints("llama"), draft, tmp_path / "b", gammas=[2], max_seq=64, max_batch=2,
                                      draft_weights="float32", draft_vocab=64))
    sess = session(bundle, "draft")
    ids = np.array([[5, 17, 33, 2, 9]], np.int64)
    feeds = {"input_ids": ids, "past_len": np.zeros(1, np.int64), "token_count": np.array([5], np.int64)}
    for fused in (False, True):
        expected = run_with_cache(ort.InferenceSession(str(bundle.graph_path("draft_forward"))), dict(feeds),
                                  empty_cache(bundle.manifest, "draft", 1))
        got = run_session(sess, bundle, "draft", "forward", fused, feeds, empty_cache(bundle.manifest, "draft", 1))
        assert got["next_token"].tolist() == expected["next_token"].tolist()
    sampled = {**feeds, "temperature": np.ones(1, np.float32), "top_k": np.zeros(1, np.int64),
               "top_p": np.ones(1, np.float32), "uniform": np.array([0.3], np.float32)}
    got = run_session(sess, bundle, "draft", "sample", False, sampled, empty_cache(bundle.manifest, "draft", 1))
    assert got["probs"].shape == (1, bundle.vocab_size)  # the whole head, not the subset


def _subgraph_ops(graph: onnx.GraphProto, inside: bool = False) -> list[tuple[str, bool]]:
    ops = []
    for node in graph.node:
        ops.append((node.op_type, inside))
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                ops += _subgraph_ops(attribute.g, True)
    return ops


@pytest.mark.parametrize("draft_weights", ["int8", "float32"])
def test_every_weight_is_read_in_the_main_graph(bundles, draft_weights):
    """ONNX Runtime pre-packs only what the main graph reads: no projection inside an If branch."""
    bundle = open_bundle(bundles("llama", "random", draft_weights))
    for role in ("target", "draft"):
        model = onnx.load(str(bundle.path / bundle.model(role).session.file), load_external_data=False)
        ops = _subgraph_ops(model.graph)
        inside = {op for op, nested in ops if nested}
        assert not inside & {"MatMul", "MatMulNBits", "DequantizeLinear", "Gemm"}, (role, inside)
        matmuls = [op for op, nested in ops if not nested and op in ("MatMul", "MatMulNBits")]
        assert len(matmuls) >= 2 * bundle.model(role).num_layers
        if bundle.model(role).matmul_weights == "int8":  # ONNX Runtime's kernel, not the pattern it fuses
            assert set(matmuls) == {"MatMulNBits"} and "DequantizeLinear" not in {op for op, _ in ops}
        assert "If" in {op for op, _ in ops}


def assert_both_sessions_speculate_as_the_target_decodes(path) -> None:
    """Per-graph sessions and the one session graph give the same tokens, and speculative decoding
    at γ 1 and 4 gives exactly the target's own greedy output."""
    prompts = [[5, 17, 33, 2, 9], [8, 9, 10]]
    per_graph, one = speccompile.load(path, one_session=False), speccompile.load(path, one_session=True)
    plain = [r.token_ids for r in per_graph.generate(prompts, max_new_tokens=16, mode="autoregressive")]
    for runtime in (per_graph, one):
        for gamma in (1, 4):
            assert [r.token_ids for r in runtime.generate(prompts, max_new_tokens=16, gamma=gamma)] == plain


def _external_weights(path) -> dict[str, tuple[str, str]]:
    """initializer name -> (offset, length) in the weights file, of a graph's external weights."""
    model = onnx.load(str(path), load_external_data=False)
    return {t.name: (fields.get("offset", "0"), fields["length"]) for t in model.graph.initializer
            if (fields := {e.key: e.value for e in t.external_data})}


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_low_bit_models_store_their_weights_once_and_speculate_exactly(checkpoints, tmp_path, weights):
    """--target-weights/--draft-weights int4 or int8 (ONNX Runtime bundle): session graphs and the
    graphs of each kind run every projection on MatMulNBits of that many bits over the same bytes of
    the weights file (no second, DequantizeLinear copy), and the file holds nothing else; both give
    the same tokens, and speculative decoding gives exactly the low-bit target's own greedy output."""
    from speccompile.compiler.build import build_bundle

    path = build_bundle(checkpoints("llama"), checkpoints("llama", "draft"), tmp_path / "b", gammas=[1, 4],
                        max_seq=96, max_batch=2, target_weights=weights, draft_weights=weights)
    bundle = open_bundle(path)
    for role in ("target", "draft"):
        assert bundle.model(role).matmul_weights == weights
        model = onnx.load(str(bundle.path / bundle.model(role).session.file), load_external_data=False)
        nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
        assert len(nbits) >= 2 * bundle.model(role).num_layers + 1  # the projections and the LM head
        assert {a.i for n in nbits for a in n.attribute if a.name == "bits"} == {int(weights[3:])}
        session = _external_weights(bundle.path / bundle.model(role).session.file)
        graphs = [entry for entry in bundle.manifest.graphs.values() if entry.id.model == role]
        for file in [entry.file for entry in graphs] + [entry.single_sequence.file for entry in graphs
                                                        if entry.single_sequence]:
            ops = {n.op_type for n in onnx.load(str(bundle.path / file), load_external_data=False).graph.node}
            assert "MatMulNBits" in ops and "DequantizeLinear" not in ops, (file, ops)
            read = _external_weights(bundle.path / file)
            assert read.items() <= session.items(), (file, sorted(set(read) - set(session)))
        stored = sum(int(length) for _, length in session.values())
        assert (bundle.path / bundle.model(role).weights_file).stat().st_size < stored + 64 * len(session)
        hidden = bundle.model(role).hidden_size  # the embedding in int8 blocks of 32, no float32 table
        assert "embed" not in session and int(session["embed_q"][1]) == bundle.vocab_size * hidden
    assert_both_sessions_speculate_as_the_target_decodes(path)


def test_portable_low_bit_graphs_keep_standard_ops_and_compute_the_same(checkpoints, tmp_path):
    """--backend onnx: the graphs of each kind carry int4 and int8 weights as the standard (blocked)
    DequantizeLinear -> MatMul that TensorRT parses and ONNX Runtime fuses into the session graphs'
    MatMulNBits: a second copy of the weights, and the same tokens either way."""
    from speccompile.compiler.build import build_bundle

    path = build_bundle(checkpoints("llama"), checkpoints("llama", "draft"), tmp_path / "b", gammas=[1, 4],
                        max_seq=96, max_batch=2, target_weights="int4", draft_weights="int8", backend="onnx")
    bundle = open_bundle(path)
    for role, dtype in (("target", onnx.TensorProto.INT4), ("draft", onnx.TensorProto.INT8)):
        portable = onnx.load(str(bundle.graph_path(f"{role}_forward")), load_external_data=False)
        assert "MatMulNBits" not in {n.op_type for n in portable.graph.node}
        assert {t.name for t in portable.graph.initializer if t.data_type == dtype}
        assert tensorrt_violations(portable) == []
    assert_both_sessions_speculate_as_the_target_decodes(path)


def test_w8a8_models_store_their_weights_once_and_speculate_exactly(checkpoints, tmp_path):
    """--target-weights w8a8 (the draft following it): per-kind and session graphs run every
    projection on MatMulInteger over the same uint8 weights, stored once; both give the same tokens,
    and speculative decoding gives exactly the w8a8 target's own greedy output. TensorRT engines are
    refused in one line, before any checkpoint is read."""
    from speccompile.compiler.build import build_bundle

    with pytest.raises(SpecCompileError, match="w8a8 graphs run on ONNX Runtime only"):
        build_bundle(checkpoints("llama"), None, tmp_path / "trt", backend="tensorrt", target_weights="w8a8")
    path = build_bundle(checkpoints("llama"), checkpoints("llama", "draft"), tmp_path / "b", gammas=[1, 4],
                        max_seq=96, max_batch=2, target_weights="w8a8")
    bundle = open_bundle(path)
    for role in ("target", "draft"):
        assert bundle.model(role).matmul_weights == "w8a8"
        weights = {}
        for file in (bundle.model(role).session.file, f"{role}_forward.onnx"):
            model = onnx.load(str(bundle.path / file), load_external_data=False)
            ops = {n.op_type for n in model.graph.node}
            assert "MatMulInteger" in ops and not ops & {"MatMulNBits", "DequantizeLinear", "MatMul"}, ops
            weights[file] = {t.name: {e.key: e.value for e in t.external_data}.get("offset", "0")
                             for t in model.graph.initializer if t.name.endswith("_u8")}
        session_weights, portable_weights = weights.values()
        assert session_weights == portable_weights and len(session_weights) >= 2 * bundle.model(role).num_layers
    assert_both_sessions_speculate_as_the_target_decodes(path)


MEMORY_SCRIPT = r"""
import json, sys, numpy as np, psutil
import speccompile
process = psutil.Process()
runtime = speccompile.load(sys.argv[1], one_session=sys.argv[2] == "one")
prompt = [5, 17, 33, 2, 9]
runtime.generate([prompt], max_new_tokens=4, gamma=2)
base = process.memory_info().rss  # both models loaded, one graph variant of each run
for gamma in (2, 4):
    for temperature in (0.0, 0.8):
        for batch in (1, 2):
            runtime.generate([prompt] * batch, max_new_tokens=4, gamma=gamma, temperature=temperature, seed=0)
print(json.dumps({"growth": process.memory_info().rss - base,
                  "sessions": runtime.target.session_count,
                  "graphs": len(runtime.target.loaded_files)}))
"""


@pytest.mark.slow
def test_one_copy_of_the_weights_however_many_graphs_a_process_runs(tmp_path):
    """A 68 MB target run at two γ, greedy and sampled, batch 1 and 2 (ten graph variants) on one
    session: the variants after the first add no copy of the weights. With a session per graph,
    each added one (several hundred MB here)."""
    from speccompile.compiler.build import build_bundle
    from tests.compiler.test_streaming_build import _checkpoint

    target = _checkpoint(tmp_path / "target")
    bundle = build_bundle(target, target, tmp_path / "b", gammas=[2, 4], max_seq=64, max_batch=2,
                          draft_weights="int8")
    weights = (bundle / "target.weights").stat().st_size
    draft = (bundle / "draft.weights").stat().st_size
    result = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(bundle), "one"], capture_output=True, text=True,
                            check=False, env={**os.environ, "SPECCOMPILE_SHARED_THREADS": "0"})
    assert result.returncode == 0, result.stderr[-2000:]
    measured = json.loads(result.stdout.splitlines()[-1])
    assert measured["graphs"] >= 6 and measured["sessions"] == 1, measured
    assert measured["growth"] < 0.5 * weights, f"{measured['growth'] / 1e6:.0f} MB more after the first graph; " \
        f"the target's weights are {weights / 1e6:.0f} MB, the draft's {draft / 1e6:.0f} MB"


# -- the runtime's choice ------------------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 2])
def test_one_session_samples_what_sessions_per_graph_sample(bundles, batch):
    per_graph = speccompile.load(bundles("llama", "random"), one_session=False)
    one = speccompile.load(bundles("llama", "random"), one_session=True)
    prompts = [[5, 17, 33, 2, 9], [8, 9, 10]][:batch]
    for seed in range(5):
        for gamma in (1, 4):
            kwargs = {"max_new_tokens": 12, "gamma": gamma, "temperature": 0.9, "top_p": 0.95, "seed": seed}
            expected = [r.token_ids for r in per_graph.generate(prompts, **kwargs)]
            assert [r.token_ids for r in one.generate(prompts, **kwargs)] == expected, (seed, gamma)
    assert one.target.session_count == 1 < len(one.target.loaded_files)


def test_one_session_verifies_every_gamma_up_to_the_largest_compiled(bundles):
    """A session graph's verification takes γ from its input's width: a bundle compiled at γ 1 and 4
    speculates at 2 and 3 too, exactly as the target decodes, greedy and sampled (the coupled rule's
    output is the target's sampled output for the seed, whatever γ), and γ auto chooses among all
    four; a session per graph verifies
    at the compiled γ only, and refuses another in one line."""
    per_graph = speccompile.load(bundles("llama", "random"), one_session=False)
    one = speccompile.load(bundles("llama", "random"), one_session=True)
    assert per_graph.gammas == [1, 4] and one.gammas == [1, 2, 3, 4]
    prompts = [[5, 17, 33, 2, 9], [8, 9, 10]]
    greedy = [r.token_ids for r in per_graph.generate(prompts, max_new_tokens=16, mode="autoregressive")]
    sampling = {"max_new_tokens": 12, "temperature": 0.9, "seed": 3}
    sampled = [r.token_ids for r in per_graph.generate(prompts, mode="autoregressive", **sampling)]
    for gamma in (2, 3):
        assert [r.token_ids for r in one.generate(prompts, max_new_tokens=16, gamma=gamma)] == greedy, gamma
        assert [r.token_ids for r in one.generate(prompts, gamma=gamma, **sampling)] == sampled, gamma
    assert one.target.session_count == 1
    # its calibration timed the compiled γ; the policy prices the others between them
    assert one.policies.timed_gammas == [1, 4] and one.policies.calibration.gammas == [1, 2, 3, 4]
    with pytest.raises(SpecCompileError, match=r"γ=2 is not one this bundle verifies at \(1, 4, or"):
        per_graph.generate(prompts, max_new_tokens=4, gamma=2)


def test_one_session_per_model_from_a_weight_size_up(bundles, monkeypatch):
    from speccompile.runtime import onnxruntime_engine

    small = speccompile.load(bundles("llama", "random"))
    assert not small.target.one_session  # tiny weights: a session per graph is faster
    monkeypatch.setattr(onnxruntime_engine, "ONE_SESSION_MIN_BYTES", 0)
    large = speccompile.load(bundles("llama", "random"))
    assert large.target.one_session and large.draft.one_session
    assert not speccompile.load(bundles("llama", "random"), one_session=False).target.one_session


def test_a_draft_runs_on_one_session_graph_beside_a_target_that_does(bundles, monkeypatch):
    """Whatever the draft's own size: its sampled and batched calls open no session (and pack no copy
    of its weights) inside a user's first sampled or batched request."""
    from speccompile.runtime import onnxruntime_engine

    path = bundles("llama", "random")
    manifest = json.loads((path / "manifest.json").read_text())
    target_bytes, draft_bytes = ((path / manifest["models"][role]["weights_file"]).stat().st_size
                                 for role in ("target", "draft"))
    assert draft_bytes < target_bytes
    monkeypatch.setattr(onnxruntime_engine, "ONE_SESSION_MIN_BYTES", target_bytes)
    runtime = speccompile.load(path)
    assert runtime.target.one_session and runtime.draft.one_session
    runtime.generate(["def f(x):", "class A:"], max_new_tokens=6, gamma=2, proposer="draft", temperature=0.8, seed=1)
    assert runtime.draft.session_count == 1 and runtime.target.session_count == 1
    monkeypatch.setattr(onnxruntime_engine, "ONE_SESSION_MIN_BYTES", target_bytes + 1)
    assert not speccompile.load(path).draft.one_session


def test_one_session_needs_a_bundle_with_session_graphs(bundles, tmp_path):
    bundle = shutil.copytree(bundles("llama", "random"), tmp_path / "b")
    manifest = json.loads((bundle / "manifest.json").read_text())
    for model in manifest["models"].values():
        del model["session"]
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    runtime = speccompile.load(bundle)  # older bundles still run, a session per graph
    assert not runtime.target.one_session
    with pytest.raises(SpecCompileError, match="no session graphs"):
        speccompile.load(bundle, one_session=True)
