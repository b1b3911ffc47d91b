"""Logits of the exported graphs against the HF transformers forward (fp32, tiny random models)."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import transformers

from speccompile.bundle import open_bundle
from tests.conftest import FAMILIES

ATOL = 1e-4


def hf_last_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].numpy()


def softmax_max(logits: np.ndarray) -> float:
    """The greedy token's probability, in float64 (the reference for the graphs' confidence)."""
    z = np.exp(logits.astype(np.float64) - logits.max())
    return float(z.max() / z.sum())


SWITCHES = ("process", "penalties", "counts", "seen", "logit_bias", "banned", "ban_until", "constrain", "forbidden",
            "want_logprobs")


def switched_off(session, feeds: dict) -> dict:
    """The feeds, with the logits processors and log-probabilities off (zeros) where not given."""
    batch = len(feeds["input_ids"])
    types = {"tensor(bool)": bool, "tensor(float)": np.float32, "tensor(int64)": np.int64, "tensor(uint8)": np.uint8}
    for value in session.get_inputs():
        if value.name in SWITCHES and value.name not in feeds:
            shape = [batch if dim == "batch" else dim if isinstance(dim, int) else 1 for dim in value.shape]
            feeds[value.name] = np.zeros(shape, types[value.type])
    return feeds


def run_with_cache(session, feeds: dict, cache: dict) -> dict:
    """Run with cache {"key.0": array, ...} as the past_* inputs; the present_* outputs replace it.
    Processors and log-probabilities are off unless the feeds switch them on."""
    feeds = switched_off(session, {**feeds, **{f"past_{key}": value for key, value in cache.items()}})
    out = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    for key in cache:
        cache[key] = out[f"present_{key}"]
    return out


def run_forward(session, manifest, role, ids, past_len, token_count, cache):
    return run_with_cache(session, {"input_ids": ids, "past_len": past_len, "token_count": token_count}, cache)


def empty_cache(manifest, role, batch):
    info = manifest.models[role]
    shape = (batch, info.num_kv_heads, manifest.max_seq, info.head_dim)
    return {f"{kind}.{i}": np.zeros(shape, np.float32) for i in range(info.num_layers) for kind in ("key", "value")}


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
            assert out["confidence"][row] == pytest.approx(softmax_max(hf_last_logits(hf, prompt)), abs=1e-5)


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
    ours = draft_logits(bundles(family, "random", "float32"), prompt)
    np.testing.assert_allclose(ours, hf_last_logits(hf, prompt), atol=ATOL)


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
    # every third token by score, so the argmax differs from the full head's
    keep = list(np.argsort(expected)[::3][:40])
    draft = with_frequencies(tmp_path, checkpoints(family, "draft"), keep, len(expected))
    bundle_dir = build_bundle(checkpoints(family), draft, tmp_path / "b", gammas=[2], max_seq=64, max_batch=1,
                              draft_weights="float32", draft_vocab=41)
    bundle = open_bundle(bundle_dir)
    session = ort.InferenceSession(str(bundle.graph_path("draft_forward")))
    out = run_forward(session, bundle.manifest, "draft", np.array([prompt], np.int64), np.zeros(1, np.int64),
                      np.array([len(prompt)], np.int64), empty_cache(bundle.manifest, "draft", 1))
    [ids] = [onnx.numpy_helper.to_array(t) for t in onnx.load(str(bundle.graph_path("draft_forward"))).graph.initializer
             if t.name == "vocab_ids"]
    np.testing.assert_allclose(out["logits"][0], expected[ids], atol=ATOL)
    assert out["next_token"][0] == ids[np.argmax(expected[ids])] != np.argmax(expected)
    # confidence over the scored tokens only: what the draft can know of its own choice
    assert out["confidence"][0] == pytest.approx(softmax_max(expected[ids]), abs=1e-5)


def run_file(bundle, file, feeds_without_cache, cache):
    cache = dict(cache)
    out = run_with_cache(ort.InferenceSession(str(bundle.path / file)), feeds_without_cache, cache)
    return out, cache


@pytest.mark.parametrize("family", FAMILIES)
def test_single_sequence_variant_matches_hf_through_prefill_catch_up_and_decode(family, checkpoints, bundles):
    """The batch-1 graphs (ONNX Runtime's fused GroupQueryAttention) give HF's logits at every kind
    of step the runtime takes: prefill, a 2-token catch-up over a re-read position, 1-token steps."""
    bundle = open_bundle(bundles(family, "random"))
    variant = bundle.graph("target_forward").single_sequence
    assert variant.op_counts.get("GroupQueryAttention") == bundle.model("target").num_layers
    assert "Attention" not in variant.op_counts and "Slice" not in variant.op_counts
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoints(family)).eval()
    cache = empty_cache(bundle.manifest, "target", 1)
    prompt = [5, 17, 33, 2, 9, 100, 7]
    steps = [(prompt, 0), ([7, 42], len(prompt) - 1), ([43], len(prompt) + 1), ([44, 45], len(prompt) + 2)]
    seen = []
    for tokens, past in steps:
        seen = seen[:past] + tokens
        feeds = {"input_ids": np.array([tokens], np.int64), "past_len": np.array([past], np.int64),
                 "token_count": np.array([len(tokens)], np.int64)}
        out, cache = run_file(bundle, variant.file, feeds, cache)
        np.testing.assert_allclose(out["logits"][0], hf_last_logits(hf, seen), atol=ATOL)


@pytest.mark.parametrize("sample", [False, True])
def test_single_sequence_verification_agrees_with_the_standard_graph(bundles, sample):
    bundle = open_bundle(bundles("llama", "random"))
    name = "target_verify_sample_g4" if sample else "target_verify_g4"
    rng = np.random.default_rng(0)
    cache = empty_cache(bundle.manifest, "target", 1)
    prefill = {"input_ids": np.array([[5, 17, 33, 2, 9]], np.int64), "past_len": np.zeros(1, np.int64),
               "token_count": np.array([5], np.int64)}
    _, cache = run_file(bundle, "target_forward.onnx", prefill, cache)
    vocab = bundle.vocab_size
    for trial in range(5):
        feeds = {"input_ids": rng.integers(0, vocab, (1, 5)), "past_len": np.array([5], np.int64),
                 "draft_len": np.array([4 - trial % 3], np.int64)}  # 4, 3, 2 real drafts
        if sample:
            probs = rng.random((1, 4, vocab)).astype(np.float32)
            feeds.update(draft_probs=probs / probs.sum(-1, keepdims=True), temperature=np.ones(1, np.float32),
                         top_k=np.zeros(1, np.int64), top_p=np.ones(1, np.float32),
                         u_accept=rng.random((1, 4)).astype(np.float32), u_sample=rng.random(1).astype(np.float32),
                         coupled=np.array([trial % 2 == 1]), verify_noise=rng.random((1, 5, vocab)).astype(np.float32))
        if trial == 0:  # d_1 = the target's own choice after `last`, so an accepted draft is exercised too
            context = {"input_ids": np.array([[5, 17, 33, 2, 9, feeds["input_ids"][0, 0]]], np.int64),
                       "past_len": np.zeros(1, np.int64), "token_count": np.array([6], np.int64)}
            greedy, _ = run_file(bundle, "target_forward.onnx", context, empty_cache(bundle.manifest, "target", 1))
            feeds["input_ids"][0, 1] = greedy["next_token"][0]
        standard, _ = run_file(bundle, f"{name}.onnx", feeds, {k: v.copy() for k, v in cache.items()})
        single = bundle.graph(name).single_sequence.file
        fused, _ = run_file(bundle, single, feeds, {k: v.copy() for k, v in cache.items()})
        for key in ("accepted", "next_token", "new_len"):
            assert fused[key].tolist() == standard[key].tolist(), (trial, key)
        if trial == 0 and not sample:
            assert standard["accepted"][0] >= 1
