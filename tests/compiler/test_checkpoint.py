"""Reading HF checkpoints into the canonical layout: dtypes, shards, name prefixes, tied heads."""

import json

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import save_file

from speccompile.compiler.architectures import ARCHITECTURES
from speccompile.compiler.checkpoint import load_checkpoint
from speccompile.errors import SpecCompileError
from tests.conftest import FAMILIES


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_checkpoints_load_as_fp32(tmp_path, checkpoints, dtype):
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoints("llama"), dtype=dtype)
    model.save_pretrained(tmp_path / "half")
    full, half = load_checkpoint(checkpoints("llama")), load_checkpoint(tmp_path / "half")
    for name, weight in full.weights.items():
        assert half.weights[name].dtype == np.float32
        np.testing.assert_allclose(half.weights[name], weight, rtol=1e-2, atol=1e-2)


def test_sharded_checkpoint(tmp_path, checkpoints):
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoints("qwen2"))
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    sharded, single = load_checkpoint(tmp_path / "sharded"), load_checkpoint(checkpoints("qwen2"))
    assert sharded.weights.keys() == single.weights.keys()
    for name in single.weights:
        np.testing.assert_array_equal(sharded.weights[name], single.weights[name])


def test_gpt2_names_without_transformer_prefix(tmp_path, checkpoints):
    src = checkpoints("gpt2")
    (tmp_path / "bare").mkdir()
    model = transformers.AutoModelForCausalLM.from_pretrained(src)
    state = {k.removeprefix("transformer."): v.contiguous() for k, v in model.state_dict().items()
             if k != "lm_head.weight"}
    save_file(state, tmp_path / "bare" / "model.safetensors")
    (tmp_path / "bare" / "config.json").write_text((src / "config.json").read_text())
    bare, prefixed = load_checkpoint(tmp_path / "bare"), load_checkpoint(src)
    for name in prefixed.weights:
        np.testing.assert_array_equal(bare.weights[name], prefixed.weights[name])


@pytest.mark.parametrize("family", FAMILIES)
def test_every_layer_weight_is_mapped(family, checkpoints):
    spec = load_checkpoint(checkpoints(family))
    hp = spec.hp
    for i in range(hp["num_layers"]):
        for part in ("q_w", "k_w", "v_w", "o_w", "up_w", "down_w", "attn_norm_w", "mlp_norm_w"):
            assert f"layers.{i}.{part}" in spec.weights
    assert spec.weights["lm_head"].shape == (hp["hidden_size"], hp["vocab_size"])
    assert ("layers.0.q_b" in spec.weights) == (family in ("qwen2", "gpt2"))


def test_every_registered_architecture_has_a_tiny_model_test():
    model_types = {"gemma3": "gemma3_text"}  # the family's name in tests -> its HF model_type
    assert set(ARCHITECTURES) == {model_types.get(family, family) for family in FAMILIES}


def test_missing_untied_lm_head_is_an_error(tmp_path, checkpoints):
    src = checkpoints("llama")
    (tmp_path / "c").mkdir()
    model = transformers.AutoModelForCausalLM.from_pretrained(src)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, tmp_path / "c" / "model.safetensors")
    (tmp_path / "c" / "config.json").write_text((src / "config.json").read_text())
    with pytest.raises(SpecCompileError, match="lm_head"):
        load_checkpoint(tmp_path / "c")


def test_unsupported_rope_scaling_is_refused_clearly(tmp_path, checkpoints):
    """Supported scalings are tested in test_rope_scaling.py; any other is one line naming them."""
    src = checkpoints("llama")
    import shutil

    dst = shutil.copytree(src, tmp_path / "c")
    config = json.loads((dst / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "mrope", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecCompileError, match=r"rope scaling 'mrope' is not supported \(supported: default, "):
        load_checkpoint(dst)


def test_gemma3_config_as_the_hub_stores_it_reads_as_transformers_5_writes_it(tmp_path, checkpoints):
    """The Hub's Gemma 3 configs give rope_theta, rope_local_base_freq, rope_scaling and a
    sliding_window_pattern; transformers 5 writes rope_parameters per layer type and layer_types.
    Both read to the same layers, and transformers itself reads the older one to the same model."""
    import shutil

    src = checkpoints("gemma3")
    dst = shutil.copytree(src, tmp_path / "hub")
    config = json.loads((dst / "config.json").read_text())
    ropes = config.pop("rope_parameters")
    config.pop("layer_types")
    config.update(rope_theta=ropes["full_attention"]["rope_theta"],
                  rope_local_base_freq=ropes["sliding_attention"]["rope_theta"],
                  rope_scaling={"rope_type": "linear", "factor": ropes["full_attention"]["factor"]},
                  sliding_window_pattern=2)  # layer 0 sliding, layer 1 global
    (dst / "config.json").write_text(json.dumps(config))
    ours, theirs = load_checkpoint(dst).hp, load_checkpoint(src).hp
    for key in ("layer_ropes", "layer_windows", "rope", "rotary_dim", "attn_scale"):
        assert ours[key] == theirs[key], key
    assert ours["layer_windows"] == [8, None]
    assert ours["layer_ropes"][0].theta == 10000.0 and ours["layer_ropes"][1].rope_type == "linear"
    assert transformers.AutoConfig.from_pretrained(dst).layer_types == ["sliding_attention", "full_attention"]


@pytest.mark.parametrize("key, value", [("final_logit_softcapping", 30.0), ("attn_logit_softcapping", 50.0),
                                        ("use_bidirectional_attention", True)])
def test_gemma_switches_the_graphs_do_not_implement_are_refused(key, value, tmp_path, checkpoints):
    import shutil

    dst = shutil.copytree(checkpoints("gemma3"), tmp_path / "c")
    config = json.loads((dst / "config.json").read_text())
    config[key] = value
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecCompileError, match=f"{key} is not supported"):
        load_checkpoint(dst)


def test_phi3_config_as_the_hub_stores_it_reads_as_transformers_5_writes_it(tmp_path, checkpoints):
    """Phi-3/Phi-4-mini on the Hub: rope_scaling {"type": "longrope", ...}, and rope_theta,
    partial_rotary_factor and original_max_position_embeddings at the top level."""
    import shutil

    src = checkpoints("phi3")
    dst = shutil.copytree(src, tmp_path / "hub")
    config = json.loads((dst / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config.update(rope_theta=rope.pop("rope_theta"), partial_rotary_factor=rope.pop("partial_rotary_factor"),
                  rope_scaling={"type": rope.pop("rope_type"), "long_factor": rope["long_factor"],
                                "short_factor": rope["short_factor"]})
    (dst / "config.json").write_text(json.dumps(config))
    ours, theirs = load_checkpoint(dst).hp, load_checkpoint(src).hp
    for key in ("layer_ropes", "rope", "rotary_dim", "layer_windows"):
        assert ours[key] == theirs[key], key
    assert ours["rotary_dim"] == 48 and ours["rope"].rope_type == "longrope"


def test_a_low_bit_model_keeps_its_embedding_in_int8_blocks_and_a_float_one_in_float32(checkpoints):
    """store_embedding_at: int8, int4 and w8a8 models store the token table as Q8_0's layout (int8
    blocks of 32 along the hidden size, one float32 scale each: scale = max |x| / 127, q = round(x /
    scale)), which loads as q × scale, within half a scale of the table; float models keep the table."""
    float_spec = load_checkpoint(checkpoints("llama"))
    table = np.asarray(float_spec.weights["embed"])
    float_spec.store_embedding_at("float16")
    assert float_spec.weights["embed"].blocks is None
    for precision in ("int8", "int4", "w8a8"):
        spec = load_checkpoint(checkpoints("llama"))
        spec.store_embedding_at(precision)
        blocks = spec.weights["embed"].blocks
        assert (blocks.axis, blocks.block, blocks.bits) == (1, 32, 8)
        q, scale = np.asarray(blocks.q), np.asarray(blocks.scale)
        grouped = table.reshape(table.shape[0], -1, 32)
        peak = np.abs(grouped).max(axis=2)
        np.testing.assert_allclose(scale, np.where(peak > 0, peak / 127, 1.0), rtol=1e-6)  # a zero block: scale 1
        np.testing.assert_array_equal(q.reshape(grouped.shape), np.rint(grouped / scale[:, :, None]))
        loaded = np.asarray(spec.weights["embed"])
        np.testing.assert_array_equal(loaded, (q.reshape(grouped.shape) * scale[:, :, None]).reshape(table.shape))
        assert np.abs(loaded - table).max() <= scale.max() / 2 + 1e-7
