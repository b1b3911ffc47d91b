"""Logits of the exported graphs against the HF transformers forward (fp32, tiny random models)."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import transformers

from speccompile.runtime.bundle import open_bundle
from tests.conftest import FAMILIES

ATOL = 1e-4


def hf_last_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].numpy()


def run_forward(session, manifest, role, ids, past_len, token_count, cache):
    info = manifest["models"][role]
    feeds = {"input_ids": ids, "past_len": past_len, "token_count": token_count}
    for i in range(info["num_layers"]):
        for kind in ("key", "value"):
            feeds[f"past_{kind}.{i}"] = cache[f"{kind}.{i}"]
    names = [o.name for o in session.get_outputs()]
    out = dict(zip(names, session.run(None, feeds)))
    for key in cache:
        cache[key] = out[f"present_{key}"]
    return out


def empty_cache(manifest, role, batch):
    info = manifest["models"][role]
    shape = (batch, info["num_kv_heads"], manifest["max_seq"], info["head_dim"])
    return {f"{kind}.{i}": np.zeros(shape, np.float32) for i in range(info["num_layers"]) for kind in ("key", "value")}


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_and_decode_logits_match_hf(family, checkpoints, bundles):
    bundle = open_bundle(bundles(family, "random"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoints(family)).eval()
    session = ort.InferenceSession(str(bundle.graph_path("target_forward")))
    prompts = [[5, 17, 33, 2, 9, 100, 7], [8, 9, 10, 11]]
    ids = np.array([prompts[0], prompts[1] + [0, 0, 0]], np.int64)
    lengths = np.array([7, 4], np.int64)
    cache = empty_cache(bundle.manifest, "target", 2)
    out = run_forward(session, bundle.manifest, "target", ids, np.zeros(2, np.int64), lengths, cache)
    for row, prompt in enumerate(prompts):
        np.testing.assert_allclose(out["logits"][row], hf_last_logits(hf, prompt), atol=ATOL)
    # three decode steps on top of the cache, different positions per row
    for step_token in (42, 43, 44):
        out = run_forward(session, bundle.manifest, "target", np.array([[step_token], [step_token + 1]], np.int64),
                          lengths, np.ones(2, np.int64), cache)
        prompts = [prompts[0] + [step_token], prompts[1] + [step_token + 1]]
        lengths = lengths + 1
        for row, prompt in enumerate(prompts):
            np.testing.assert_allclose(out["logits"][row], hf_last_logits(hf, prompt), atol=ATOL)
            assert out["next_token"][row] == np.argmax(out["logits"][row])


def draft_logits(bundle_dir, prompt, optimized_model=None) -> np.ndarray:
    bundle = open_bundle(bundle_dir)
    options = ort.SessionOptions()
    if optimized_model:
        options.optimized_model_filepath = str(optimized_model)
    session = ort.InferenceSession(str(bundle.graph_path("draft_forward")), options)
    out = run_forward(session, bundle.manifest, "draft", np.array([prompt], np.int64), np.zeros(1, np.int64),
                      np.array([len(prompt)], np.int64), empty_cache(bundle.manifest, "draft", 1))
    return out["logits"][0]


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_draft_graph_matches_its_own_hf_model(family, checkpoints, bundles):
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoints(family, "draft")).eval()
    prompt = [1, 2, 3, 4, 5]
    np.testing.assert_allclose(draft_logits(bundles(family, "random", "float32"), prompt), hf_last_logits(hf, prompt), atol=ATOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_int8_draft_is_close_to_float32_and_runs_as_fused_int8_gemm(family, bundles, tmp_path):
    """int8 weight-only draft: logits within quantization error of the float32 draft, and ONNX
    Runtime fuses every DequantizeLinear -> MatMul into MatMulNBits (otherwise it would fold the
    weights back to float32 and the draft would gain nothing)."""
    prompt = [1, 2, 3, 4, 5]
    exact = draft_logits(bundles(family, "random", "float32"), prompt)
    optimized = tmp_path / "draft_optimized.onnx"
    quantized = draft_logits(bundles(family, "random", "int8"), prompt, optimized_model=optimized)
    error = np.abs(quantized - exact).max() / np.abs(exact).max()
    assert 0 < error < 0.05, f"int8 draft logits off by {error:.3%} of their range"
    ops = [node.op_type for node in onnx.load(str(optimized), load_external_data=False).graph.node]
    assert "MatMulNBits" in ops and "DequantizeLinear" not in ops, sorted(set(ops))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_draft_vocabulary_logits_are_the_hf_logits_of_the_kept_tokens(family, checkpoints, tmp_path):
    """--draft-vocab: the greedy draft graph scores exactly HF's logits at the kept ids, and its
    next_token is the token id (not the position) of their argmax."""
    from speccompile.compiler.build import build_bundle
    from tests.compiler.test_draft_vocab import with_frequencies

    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoints(family, "draft")).eval()
    prompt = [1, 2, 3, 4, 5]
    expected = hf_last_logits(hf, prompt)
    keep = list(np.argsort(expected)[::3][:40])  # every third token by score, so the argmax differs from the full head's
    draft = with_frequencies(tmp_path, checkpoints(family, "draft"), keep, len(expected))
    bundle_dir = build_bundle(checkpoints(family), draft, tmp_path / "b", gammas=[2], max_seq=64, max_batch=1,
                              draft_weights="float32", draft_vocab=41, log=lambda _: None)
    bundle = open_bundle(bundle_dir)
    session = ort.InferenceSession(str(bundle.graph_path("draft_forward")))
    out = run_forward(session, bundle.manifest, "draft", np.array([prompt], np.int64), np.zeros(1, np.int64),
                      np.array([len(prompt)], np.int64), empty_cache(bundle.manifest, "draft", 1))
    [ids] = [onnx.numpy_helper.to_array(t) for t in onnx.load(str(bundle.graph_path("draft_forward"))).graph.initializer
             if t.name == "vocab_ids"]
    np.testing.assert_allclose(out["logits"][0], expected[ids], atol=ATOL)
    assert out["next_token"][0] == ids[np.argmax(expected[ids])] != np.argmax(expected)
