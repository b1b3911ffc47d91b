"""RoPE scaling as HF transformers does it: our frequencies and tables against transformers' own, and
tiny checkpoints with each scaling against HF logits and greedy generation, at positions past the
scaling's original context. Plus the --max-seq limits each scaling implies."""

import json
import shutil

import numpy as np
import onnxruntime as ort
import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

import speccompile
from speccompile.bundle import open_bundle
from speccompile.compiler.architectures import LLAMA
from speccompile.compiler.build import build_bundle
from speccompile.compiler.checkpoint import (
    _hyper_parameters,
    check_max_seq,
    load_checkpoint,
)
from speccompile.compiler.rope import Rope, inverse_frequencies
from speccompile.compiler.transformer import rope_tables
from speccompile.errors import SpecCompileError
from tests.compiler.test_transformer_parity import (
    ATOL,
    empty_cache,
    hf_last_logits,
    run_file,
    run_forward,
)
from tests.runtime.test_generate import hf_greedy
from tests.tiny_models import make_checkpoint

THETA = 5000.0
HEAD_DIM = 16  # the tiny targets': hidden 64, 4 heads
MAX_SEQ = 64

# Parameters chosen so that each scaling changes the tables inside MAX_SEQ positions. llama3: with an
# original context of 32 and frequency factors 1 and 4, head_dim 16 at theta 5000 has wavelengths
# below 8 (kept), between 8 and 32 (smoothed) and above 32 (divided by the factor). yarn: factor 4
# makes the attention factor 1.139, and the ramp spans dimensions 0..2 for an original context of 32.
SCALED = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
}
# max_position_embeddings per scaling: dynamic's is MAX_SEQ, so the tests run right up to the last
# position where HF's dynamic NTK is still plain RoPE; yarn's is original × factor, as real configs state it.
MAX_POSITIONS = {"linear": 512, "dynamic": MAX_SEQ, "llama3": 512, "yarn": 128}
# Other branches of HF's maths, for the frequency tests only.
VARIANTS = {
    "default": {"rope_type": "default"},
    **SCALED,
    "yarn mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "mscale": 0.707,
                    "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2, "truncate": False},
    "yarn attention_factor": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256,
                              "attention_factor": 0.9},
    "llama3 long": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 2.0, "high_freq_factor": 16.0,
                    "original_max_position_embeddings": 64},
    # Phi-3's: within the original context, the short factors (the tables' MAX_SEQ is the original's 64)
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": MAX_SEQ,
                 "short_factor": [1.0, 1.0, 1.1, 1.2, 1.5, 2.0, 3.0, 4.0],
                 "long_factor": [1.0, 2.0, 3.0, 5.0, 8.0, 13.0, 21.0, 34.0]},
    "longrope attention_factor": {"rope_type": "longrope", "original_max_position_embeddings": 256,
                                  "attention_factor": 1.5, "short_factor": [1.0] * 8, "long_factor": [4.0] * 8},
}


def hf_config(params: dict, max_positions: int = 512) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=max_positions,
                                    rope_parameters={**params, "rope_theta": THETA})


def our_rope(tmp_path, params: dict, max_positions: int = 512) -> Rope:
    """The Rope that load_checkpoint reads from a config.json with these parameters."""
    return rope_of_config(tmp_path, {"rope_parameters": {**params, "rope_theta": THETA}}, max_positions)


def rope_of_config(tmp_path, rope_keys: dict, max_positions: int = 512) -> Rope:
    config = {"model_type": "llama", "vocab_size": 16, "hidden_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 4, "intermediate_size": 128, "rms_norm_eps": 1e-6,
              "max_position_embeddings": max_positions, **rope_keys}
    return _hyper_parameters(tmp_path, config, LLAMA)["rope"]


def hf_frequencies(config) -> tuple[np.ndarray, float]:
    rope_type = config.rope_parameters["rope_type"]
    init = ROPE_INIT_FUNCTIONS.get(rope_type, LlamaRotaryEmbedding.compute_default_rope_parameters)
    inv_freq, attention = init(config)
    return inv_freq.numpy(), attention


# ---------------------------------------------------------------------------------------------
# frequencies and tables against transformers


@pytest.mark.parametrize("variant", VARIANTS)
def test_inverse_frequencies_and_attention_factor_are_transformers(variant, tmp_path):
    expected, attention = hf_frequencies(hf_config(VARIANTS[variant]))
    ours, our_attention = inverse_frequencies(our_rope(tmp_path, VARIANTS[variant]), HEAD_DIM)
    # float32 pow in numpy and torch can differ by one ulp, by CPU (each picks its own SIMD path)
    np.testing.assert_array_max_ulp(ours, expected, maxulp=1)
    assert our_attention == pytest.approx(attention, rel=1e-12)


@pytest.mark.parametrize("variant", VARIANTS)
def test_tables_are_transformers_rotary_embedding(variant, tmp_path):
    """cos and sin as LlamaRotaryEmbedding returns them (attention factor included), and, but for
    dynamic NTK below its limit, different from plain RoPE's: the scaling is not ignored."""
    params = VARIANTS[variant]
    cos, sin = rope_tables(our_rope(tmp_path, params), HEAD_DIM, MAX_SEQ)
    with torch.no_grad():
        hf_cos, hf_sin = LlamaRotaryEmbedding(hf_config(params))(torch.zeros(1), torch.arange(MAX_SEQ)[None])
    np.testing.assert_allclose(cos, hf_cos[0, :, :HEAD_DIM // 2].numpy(), atol=2e-7, rtol=0)
    np.testing.assert_allclose(sin, hf_sin[0, :, :HEAD_DIM // 2].numpy(), atol=2e-7, rtol=0)
    plain_cos, _ = rope_tables(our_rope(tmp_path, VARIANTS["default"]), HEAD_DIM, MAX_SEQ)
    assert np.array_equal(cos, plain_cos) == (params["rope_type"] in ("default", "dynamic"))


def test_longrope_takes_its_long_factors_when_the_cache_outgrows_the_original_context(tmp_path):
    """A build longer than original_max_position_embeddings uses the long factors: HF's frequencies
    for a call that reaches past the original length."""
    params = VARIANTS["longrope"]
    rope = our_rope(tmp_path, params)
    long, attention = ROPE_INIT_FUNCTIONS["longrope"](hf_config(params), seq_len=MAX_SEQ + 1)
    for max_seq, expected in ((MAX_SEQ, hf_frequencies(hf_config(params))[0]), (MAX_SEQ + 1, long.numpy())):
        ours, our_attention = inverse_frequencies(rope, HEAD_DIM, max_seq)
        np.testing.assert_array_max_ulp(ours, expected, maxulp=1)
        assert our_attention == pytest.approx(attention, rel=1e-12) and attention > 1


def test_phi3_long_context_generation_matches_hf_past_the_original_length(tmp_path, tokenizer):
    """A Phi-3 whose original context (32) is shorter than the build's cache (64) and the prompt (40):
    HF takes the long factors from the prefill on, and so do the bundle's tables (partial rotary too)."""
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": [1.0] * 24, "long_factor": [1.0 + j for j in range(24)]}
    ckpt = make_checkpoint(tmp_path / "ckpt", "phi3", tokenizer=tokenizer, rope_parameters=rope,
                           original_max_position_embeddings=32)
    bundle = build_bundle(ckpt, ckpt, tmp_path / "bundle", gammas=[2], max_seq=MAX_SEQ, max_batch=2,
                          draft_weights="float32")
    assert load_checkpoint(ckpt).hp["rotary_dim"] == 48
    expected = hf_greedy(ckpt, PROMPT, 16)
    runtime = speccompile.load(bundle)
    assert runtime.generate([PROMPT], max_new_tokens=16, gamma=2)[0].token_ids == expected
    assert [r.token_ids for r in runtime.generate([PROMPT, PROMPT], max_new_tokens=16, gamma=2)] == [expected] * 2


def test_dynamic_ntk_is_plain_rope_up_to_max_position_embeddings_and_not_beyond():
    """Why --max-seq stops at max_position_embeddings for dynamic NTK: HF switches to other frequencies
    as soon as a call reaches past it, and which ones depends on that call's length."""
    config = hf_config(SCALED["dynamic"], max_positions=MAX_SEQ)
    plain, _ = hf_frequencies(hf_config(VARIANTS["default"]))
    at_limit, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, seq_len=MAX_SEQ)
    beyond = [ROPE_INIT_FUNCTIONS["dynamic"](config, seq_len=MAX_SEQ + n)[0].numpy() for n in (1, 2)]
    np.testing.assert_array_equal(at_limit.numpy(), plain)
    assert not np.allclose(beyond[0], plain) and not np.allclose(beyond[0], beyond[1])


def test_older_style_rope_scaling_with_legacy_type_and_top_level_theta(tmp_path):
    """rope_scaling + top-level rope_theta (transformers < 5) reads as rope_parameters does; yarn's
    original context defaults to max_position_embeddings, theta to 10000, as in HF."""
    old = rope_of_config(tmp_path, {"rope_theta": THETA, "rope_scaling": {"type": "yarn", "factor": 4.0}}, 128)
    new = rope_of_config(tmp_path, {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": THETA}}, 128)
    assert old == new == Rope("yarn", THETA, 128, {"factor": 4.0, "original_max_position_embeddings": 128})
    plain = rope_of_config(tmp_path, {}, 128)
    assert plain == Rope("default", 10000.0, 128, {})


def test_unknown_rope_type_is_refused_naming_the_supported_ones(tmp_path):
    with pytest.raises(SpecCompileError, match="rope scaling 'mrope' is not supported "
                                               r"\(supported: default, linear, dynamic, llama3, yarn, longrope\)"):
        rope_of_config(tmp_path, {"rope_scaling": {"rope_type": "mrope", "mrope_section": [2, 3, 3]}})
    with pytest.raises(SpecCompileError, match="'longrope' needs long_factor"):
        rope_of_config(tmp_path, {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8}})
    with pytest.raises(SpecCompileError, match="'llama3' needs low_freq_factor, high_freq_factor"):
        rope_of_config(tmp_path, {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}})


# ---------------------------------------------------------------------------------------------
# tiny scaled checkpoints against HF


@pytest.fixture(scope="module")
def scaled(tmp_path_factory, tokenizer):
    """scaled(rope_type, family) -> (checkpoint, bundle whose draft is the target itself)."""
    made = {}

    def get(rope_type: str, family: str = "llama"):
        if (rope_type, family) not in made:
            tmp = tmp_path_factory.mktemp(f"rope-{rope_type}-{family}")
            rope = {**SCALED[rope_type], "rope_theta": THETA}
            ckpt = make_checkpoint(tmp / "ckpt", family, tokenizer=tokenizer, rope_parameters=rope,
                                   max_position_embeddings=MAX_POSITIONS[rope_type])
            bundle = build_bundle(ckpt, ckpt, tmp / "bundle", gammas=[2], max_seq=MAX_SEQ, max_batch=2,
                                  draft_weights="float32")
            made[rope_type, family] = ckpt, bundle
        return made[rope_type, family]

    return get


CASES = [("linear", "llama"), ("dynamic", "llama"), ("llama3", "llama"), ("yarn", "llama"), ("yarn", "qwen2")]
PROMPT = [(7 * i + 3) % 300 + 3 for i in range(40)]  # 40 tokens: decoding starts past the original 32


@pytest.mark.parametrize("rope_type, family", CASES)
def test_logits_match_hf_past_the_original_context(rope_type, family, scaled):
    """Batched graph (ONNX RotaryEmbedding): a prefill of two prompts, then decode steps at positions
    40.. and 35..; the batch-1 graph (GroupQueryAttention's rotary): prefill and steps up to MAX_SEQ."""
    ckpt, bundle_dir = scaled(rope_type, family)
    bundle = open_bundle(bundle_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt).eval()
    prompts = [PROMPT, PROMPT[5:]]
    ids = np.array([prompts[0], prompts[1] + [0] * 5], np.int64)
    lengths = np.array([40, 35], np.int64)
    cache = empty_cache(bundle.manifest, "target", 2)
    session = ort.InferenceSession(str(bundle.graph_path("target_forward")))
    out = run_forward(session, bundle.manifest, "target", ids, np.zeros(2, np.int64), lengths, cache)
    for _ in range(4):  # decode steps
        for row, prompt in enumerate(prompts):
            np.testing.assert_allclose(out["logits"][row], hf_last_logits(hf, prompt), atol=ATOL)
        tokens = out["next_token"]
        prompts = [p + [int(t)] for p, t in zip(prompts, tokens)]
        out = run_forward(session, bundle.manifest, "target", tokens[:, None], lengths, np.ones(2, np.int64), cache)
        lengths = lengths + 1
    single = bundle.graph("target_forward").single_sequence.file
    cache, seen = empty_cache(bundle.manifest, "target", 1), []
    for tokens in [PROMPT[:-3], PROMPT[-3:], *[[t] for t in range(10, 10 + MAX_SEQ - len(PROMPT))]]:
        feeds = {"input_ids": np.array([tokens], np.int64), "past_len": np.array([len(seen)], np.int64),
                 "token_count": np.array([len(tokens)], np.int64)}
        out, cache = run_file(bundle, single, feeds, cache)
        seen = seen + tokens
        np.testing.assert_allclose(out["logits"][0], hf_last_logits(hf, seen), atol=ATOL)
    assert len(seen) == MAX_SEQ


@pytest.mark.parametrize("rope_type, family", CASES)
def test_greedy_generation_matches_hf_generate(rope_type, family, scaled):
    """Speculative (draft = target) greedy decoding up to position 61 of 64, batched and alone."""
    ckpt, bundle = scaled(rope_type, family)
    prompts, new_tokens = [PROMPT[:30], PROMPT[8:28]], MAX_SEQ - 30 - 2  # γ=2 needs two free positions
    expected = [hf_greedy(ckpt, prompt, new_tokens) for prompt in prompts]
    runtime = speccompile.load(bundle)
    assert [r.token_ids for r in runtime.generate(prompts, max_new_tokens=new_tokens, gamma=2)] == expected
    assert runtime.generate([prompts[0]], max_new_tokens=new_tokens, gamma=2)[0].token_ids == expected[0]


# ---------------------------------------------------------------------------------------------
# --max-seq limits


@pytest.mark.parametrize("rope_type, limit", [("linear", 2048), ("dynamic", MAX_SEQ), ("llama3", 512), ("yarn", 128)])
def test_max_seq_beyond_the_scaled_span_is_refused_naming_the_limit(rope_type, limit, scaled):
    """linear: max_position_embeddings (512) × factor; dynamic: max_position_embeddings, where static
    tables stop being exact; llama3: max_position_embeddings as stated; yarn: original (32) × factor
    (less than the config's 128)."""
    spec = load_checkpoint(scaled(rope_type)[0])
    check_max_seq(spec, limit)
    with pytest.raises(SpecCompileError, match=f"--max-seq {limit + 1} exceeds the model's {limit} positions"):
        check_max_seq(spec, limit + 1)


def test_max_seq_beyond_plain_rope_positions_is_refused_by_build(tmp_path, checkpoints):
    ckpt = checkpoints("llama")  # max_position_embeddings 512
    limit = r"--max-seq 513 exceeds the model's 512 positions \(max_position_embeddings\)"
    with pytest.raises(SpecCompileError, match=limit):
        build_bundle(ckpt, ckpt, tmp_path / "b", max_seq=513)
    assert not (tmp_path / "b").exists()


def test_dynamic_ntk_refusal_says_why(scaled):
    spec = load_checkpoint(scaled("dynamic")[0])
    with pytest.raises(SpecCompileError, match="dynamic NTK changes its frequencies"):
        check_max_seq(spec, MAX_SEQ + 1)


def test_a_checkpoint_in_the_older_config_style_loads_the_same_rope(tmp_path, scaled):
    """A checkpoint written by transformers < 5 (rope_scaling + rope_theta) loads to the same Rope."""
    src, _ = scaled("llama3")
    dst = shutil.copytree(src, tmp_path / "old")
    config = json.loads((dst / "config.json").read_text())
    params = config.pop("rope_parameters")
    config["rope_theta"] = params.pop("rope_theta")
    config["rope_scaling"] = {"type": params.pop("rope_type"), **params}
    (dst / "config.json").write_text(json.dumps(config))
    assert load_checkpoint(dst).hp["rope"] == load_checkpoint(src).hp["rope"]


def test_max_seq_beyond_learned_positions_is_still_refused(checkpoints):
    spec = load_checkpoint(checkpoints("gpt2"))  # n_positions 256
    refused = r"--max-seq 257 exceeds the model's 256 positions \(learned positions\)"
    with pytest.raises(SpecCompileError, match=refused):
        check_max_seq(spec, 257)
