"""GGUF files read as Hugging Face checkpoints (speccompile/compiler/gguf.py).

The oracles: the tiny HF checkpoint each GGUF was converted from (tests/gguf_files.py converts as
llama.cpp's convert_hf_to_gguf.py does), transformers running a model built from what we read,
gguf-py's own reader and dequantizers, and transformers' GGUF config and tokenizer loading.
"""

import json
import random
import shutil
import struct
import time
import tracemalloc

import gguf
import numpy as np
import pytest

from speccompile.compiler.gguf import KEPT_BLOCKS, READABLE, gguf_checkpoint, gguf_tensors, read_gguf
from speccompile.compiler.tensors import INT4
from speccompile.errors import SpecCompileError
from tests.gguf_files import (
    ARRAY,
    CHAT_TEMPLATE,
    END_OF_TURN,
    FAMILIES,
    FLOAT32,
    STRING,
    U32,
    make_hf_checkpoint,
    packed_gguf,
    packed_kv,
    packed_string,
    packed_tensor,
    write_gguf,
)

F32, Q8_0 = 0, 8
TEXTS = ["def parse_args(argv):\n    return argv[1:]\n", "the quick brown fox jumps over", "  two spaces\tand a tab",
         "héllo wörld 🚀", "one<|im_end|>two<end_of_turn>three<|end|>four</s>"]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    made = {}

    def get(family: str):
        if family not in made:
            made[family] = make_hf_checkpoint(tmp_path_factory.mktemp(family) / "ckpt", family)
        return made[family]

    return get


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory, hf_dirs):
    made = {}

    def get(family: str, qtype: str = "F32"):
        if (family, qtype) not in made:
            out = tmp_path_factory.mktemp(f"{family}-{qtype}") / f"model-{qtype}.gguf"
            made[family, qtype] = write_gguf(hf_dirs(family), out, qtype, chat_template=CHAT_TEMPLATE)
        return made[family, qtype]

    return get


def hf_weights(hf_dir) -> dict:
    from safetensors.numpy import load_file

    return load_file(hf_dir / "model.safetensors")


def as_float32(value):
    """Every float in a (nested) value rounded to float32, the precision a GGUF keeps."""
    if isinstance(value, float):
        return float(np.float32(value))
    if isinstance(value, dict):
        return {k: as_float32(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [as_float32(v) for v in value]
    return value


# ---------------------------------------------------------------------------------------------
# the container


def test_header_and_tensor_table_agree_with_gguf_py(ggufs):
    path = ggufs("llama", "Q8_0")
    ours, theirs = read_gguf(path), gguf.GGUFReader(path)
    assert ours.version == 3 and ours.architecture == "llama" and ours.path == path
    assert set(ours.metadata) == {k for k in theirs.fields if not k.startswith("GGUF.")}
    assert ours.metadata["llama.block_count"] == 2 and ours.metadata["llama.attention.layer_norm_rms_epsilon"] == 1e-6
    assert ours.metadata["tokenizer.ggml.tokens"][:3] == ["<s>", "</s>", "<pad>"]
    assert len(ours.tensors) == len(theirs.tensors)
    for tensor in theirs.tensors:
        info = ours.tensors[tensor.name]
        assert info.shape == tuple(reversed(tensor.shape.tolist()))  # numpy order
        assert (info.ggml_type_name, info.offset, info.nbytes) == \
            (tensor.tensor_type.name, tensor.data_offset, tensor.n_bytes)
    assert ours.tensors["blk.0.attn_q.weight"].shape == (4 * 32, 64)  # [out, in]
    assert ours.tensors["blk.0.attn_q.weight"].ggml_type_name == "Q8_0"
    assert ours.tensors["blk.0.attn_norm.weight"].ggml_type_name == "F32"


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_lazy_tensors_equal_gguf_py_dequantize(ggufs, qtype):
    path = ggufs("phi3", qtype)
    lazy = gguf_tensors(read_gguf(path))
    for tensor in gguf.GGUFReader(path).tensors:
        expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(lazy[tensor.name].shape)
        np.testing.assert_array_equal(lazy[tensor.name].load(), expected, err_msg=tensor.name)


def one_tensor_file(path, raw: np.ndarray, qtype):
    """A GGUF holding one tensor of `qtype`'s raw blocks [rows, bytes], read back as our lazy tensor."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("t", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (tensor,) = gguf_tensors(read_gguf(path)).values()
    return tensor


@pytest.mark.parametrize("kind", READABLE)
def test_every_readable_type_dequantizes_as_gguf_py(tmp_path, kind):
    qtype = gguf.GGMLQuantizationType[kind]
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(0).integers(0, 256, (3, 512 // block * type_size), dtype=np.uint8)
    tensor = one_tensor_file(tmp_path / "one.gguf", raw, qtype)
    assert tensor.shape == (3, 512) and tensor.dtype == np.float32
    with np.errstate(all="ignore"):  # random bits make infinities and NaNs, alike in both
        np.testing.assert_array_equal(tensor.load(), gguf.quants.dequantize(raw, qtype))


def per_value(blocks, part) -> np.ndarray:
    """A scale or offset [rows, blocks] spread over the values of its block [rows, blocks × block]."""
    return np.repeat(part.load(), blocks.block, axis=1)


def kept_values(blocks) -> np.ndarray:
    """scale × q + offset, in float32 as the graphs compute them."""
    values = per_value(blocks, blocks.scale) * blocks.q.load().astype(np.float32)
    return values if blocks.offset is None else values + per_value(blocks, blocks.offset)


# where each kept format's fp16 scales (and minimums) lie in its block: random bytes there could be inf/NaN
FP16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2),
               "Q5_K": (0, 2), "Q6_K": (208,)}


@pytest.mark.parametrize("kind", KEPT_BLOCKS)
def test_kept_blocks_give_the_values_gguf_py_dequantizes(tmp_path, kind):
    """Every kept format, on random blocks (every bit pattern of the integers, sub-scales and
    minimums): its integers fit the bits the graph stores them in, and scale × q + offset is gguf-py's
    dequantization (golden) to float32 rounding."""
    qtype, kept = gguf.GGMLQuantizationType[kind], KEPT_BLOCKS[kind]
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, (6, 512 // block, type_size), dtype=np.uint8)
    for at in FP16_FIELDS[kind]:
        raw[:, :, at:at + 2] = rng.uniform(-0.02, 0.02, (6, 512 // block, 1)).astype(np.float16).view(np.uint8)
    raw = raw.reshape(6, -1)
    tensor = one_tensor_file(tmp_path / "one.gguf", raw, qtype)
    blocks = tensor.blocks
    assert (blocks.axis, blocks.block, blocks.bits) == (1, kept.block, kept.bits)
    assert (blocks.offset is not None) == kept.has_minimum
    q = blocks.q.load()
    assert q.dtype == (INT4 if kept.bits == 4 else np.int8) and q.shape == (6, 512)
    assert -(1 << (kept.bits - 1)) <= q.astype(np.int16).min() and q.astype(np.int16).max() < 1 << (kept.bits - 1)
    expected = gguf.quants.dequantize(raw, qtype)
    np.testing.assert_allclose(kept_values(blocks), expected, rtol=1e-6, atol=1e-6 * np.abs(expected).max())
    np.testing.assert_array_equal(tensor.load(), expected)


def test_tensors_are_read_only_when_loaded(ggufs, tmp_path):
    path = shutil.copy(ggufs("qwen2"), tmp_path / "copy.gguf")
    checkpoint = gguf_checkpoint(path)
    with open(path, "r+b") as f:
        f.truncate(read_gguf(path).tensors["output_norm.weight"].offset)  # the data goes after the header was read
    with pytest.raises(SpecCompileError, match="cut short"):
        checkpoint.tensors["model.norm.weight"].load()


# ---------------------------------------------------------------------------------------------
# as a Hugging Face checkpoint


@pytest.mark.parametrize("family", FAMILIES)
def test_f32_tensors_equal_the_checkpoint_they_came_from(family, hf_dirs, ggufs):
    """Llama's q/k rows un-permuted (biases too), Gemma's norms back to w, Phi-3's fused projections."""
    checkpoint = gguf_checkpoint(ggufs(family))
    expected = hf_weights(hf_dirs(family))
    assert set(checkpoint.tensors) == set(expected)
    assert set(checkpoint.formats) == set(expected) and set(checkpoint.formats.values()) == {"F32"}
    for name, weight in expected.items():
        if name == "model.embed_tokens.weight":  # Gemma's GGUF drops the padding rows
            weight = weight[:checkpoint.config["vocab_size"]]
        got = checkpoint.tensors[name]
        assert got.blocks is None
        np.testing.assert_array_equal(got.load(), weight, err_msg=name)


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_model_built_from_the_gguf_matches_the_original(family, hf_dirs, ggufs):
    """The config and tensors together: the same logits as the original model, to the bit."""
    import torch
    import transformers

    checkpoint = gguf_checkpoint(ggufs(family))
    original = transformers.AutoModelForCausalLM.from_pretrained(hf_dirs(family)).eval()
    rebuilt = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**checkpoint.config))
    state = {name: torch.from_numpy(tensor.load()) for name, tensor in checkpoint.tensors.items()}
    missing, unexpected = rebuilt.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"} and rebuilt.config.tie_word_embeddings == bool(missing)
    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 11, 64, 128, 30, 31]])  # past Gemma's window of 8
    with torch.no_grad():
        expected, got = original(ids).logits, rebuilt.eval()(ids).logits
    torch.testing.assert_close(got, expected[..., :got.shape[-1]], rtol=0, atol=0)


CONFIG_ATTRIBUTES = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "rope_parameters",
                     "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "sliding_window",
                     "layer_types", "query_pre_attn_scalar", "attention_bias", "mlp_bias", "hidden_act",
                     "hidden_activation", "original_max_position_embeddings", "final_logit_softcapping")


@pytest.mark.parametrize("family", FAMILIES)
def test_config_states_every_hyper_parameter_of_the_original(family, hf_dirs, ggufs):
    import transformers

    checkpoint = gguf_checkpoint(ggufs(family))
    ours = transformers.AutoConfig.for_model(**checkpoint.config)
    theirs = transformers.AutoConfig.from_pretrained(hf_dirs(family))
    for name in CONFIG_ATTRIBUTES:
        assert as_float32(getattr(ours, name, None)) == as_float32(getattr(theirs, name, None)), name
    for config in (ours, theirs):
        config.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert ours.head_dim == theirs.head_dim
    assert ours.vocab_size == checkpoint.tensors["model.embed_tokens.weight"].shape[0]
    assert ours.vocab_size == (theirs.vocab_size if family != "gemma3_text" else 324)  # tokenizer.json's count
    assert checkpoint.config["architectures"] == theirs.architectures


@pytest.mark.parametrize("family", FAMILIES)
def test_config_agrees_with_transformers_gguf_loading(family, ggufs):
    """transformers' own reading of the same file, where it states a value (it omits rope scaling, Gemma's
    layer types and Phi-3's partial rotary, and counts tokens rather than embedding rows)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = ggufs(family)
    ours = gguf_checkpoint(path).config
    theirs = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    shared = (set(ours) & set(theirs)) - ({"vocab_size"} if family == "gemma3_text" else set())
    assert {"hidden_size", "num_hidden_layers", "num_attention_heads", "rms_norm_eps", "rope_theta"} <= shared
    assert {k: as_float32(ours[k]) for k in shared} == {k: as_float32(theirs[k]) for k in shared}


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_checkpoint_loads_like_the_original_checkpoint(family, hf_dirs, ggufs, tmp_path):
    """What the compiler reads: the config and tensors saved as a checkpoint give checkpoint.py the same model."""
    from safetensors.numpy import save_file

    from speccompile.compiler.checkpoint import load_checkpoint

    checkpoint = gguf_checkpoint(ggufs(family))
    (tmp_path / "config.json").write_text(json.dumps(checkpoint.config))
    save_file({name: tensor.load() for name, tensor in checkpoint.tensors.items()}, tmp_path / "model.safetensors")
    ours, theirs = load_checkpoint(tmp_path).hp, load_checkpoint(hf_dirs(family)).hp
    if family == "gemma3_text":
        theirs["vocab_size"] = ours["vocab_size"]
    assert as_float32(spelt_out(ours)) == as_float32(spelt_out(theirs))


def spelt_out(hp: dict) -> dict:
    """hp with its Rope objects spelt out, so that their parameters compare at float32."""
    def spelt(value):
        if hasattr(value, "rope_type"):
            return {"type": value.rope_type, "theta": value.theta, "max": value.max_positions, **value.params}
        return [spelt(v) for v in value] if isinstance(value, list) else value
    return {k: spelt(v) for k, v in hp.items()}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])  # those gguf-py quantizes to
def test_quantized_weights_keep_their_blocks(family, qtype, hf_dirs, ggufs):
    checkpoint = gguf_checkpoint(ggufs(family, qtype))
    original = hf_weights(hf_dirs(family))
    kept = KEPT_BLOCKS[qtype]
    for name, tensor in checkpoint.tensors.items():
        if tensor.ndim == 1:
            assert tensor.blocks is None and checkpoint.formats[name] == "F32"
            continue
        assert checkpoint.formats[name] == qtype
        blocks = tensor.blocks
        assert (blocks.axis, blocks.block, blocks.bits) == (1, kept.block, kept.bits)
        assert blocks.q.load().shape == tensor.shape and blocks.scale.shape == (tensor.shape[0], tensor.shape[1] // 32)
        values = tensor.load()
        np.testing.assert_allclose(kept_values(blocks), values, rtol=1e-6, atol=1e-7, err_msg=name)
        weight = original[name][:tensor.shape[0]]
        # within a step of the original (Q4_0 clips one end of its range; d's fp16 rounding adds < 1%)
        assert np.all(np.abs(values - weight) <= 1.01 * np.abs(per_value(blocks, blocks.scale))), name


def test_phi3_file_with_split_qkv_is_fused_back(hf_dirs, tmp_path):
    path = write_gguf(hf_dirs("phi3"), tmp_path / "split.gguf", "Q8_0", split_qkv=True)
    assert "blk.0.attn_q.weight" in read_gguf(path).tensors
    checkpoint = gguf_checkpoint(path)
    fused = checkpoint.tensors["model.layers.0.self_attn.qkv_proj.weight"]
    assert "model.layers.0.self_attn.q_proj.weight" not in checkpoint.tensors
    assert checkpoint.formats["model.layers.0.self_attn.qkv_proj.weight"] == "Q8_0"
    assert fused.blocks is not None and fused.blocks.q.shape == fused.shape == (64 + 2 * 32, 64)
    whole = gguf_checkpoint(write_gguf(hf_dirs("phi3"), tmp_path / "fused.gguf", "Q8_0"))
    np.testing.assert_array_equal(fused.load(), whole.tensors["model.layers.0.self_attn.qkv_proj.weight"].load())


# ---------------------------------------------------------------------------------------------
# tokenizer


@pytest.mark.parametrize("family", FAMILIES)
def test_tokenizer_encodes_as_the_original(family, hf_dirs, ggufs, tmp_path):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    path = ggufs(family)
    checkpoint = gguf_checkpoint(path)
    saved = AutoTokenizer.from_pretrained(checkpoint.save_tokenizer(tmp_path / "tokenizer"))
    # the checkpoint's tokenizer.json as written (AutoTokenizer would swap in Qwen2's own pre-tokenizer for qwen2)
    original = Tokenizer.from_file(str(hf_dirs(family) / "tokenizer.json"))
    transformers_gguf = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TEXTS:
        expected = original.encode(text, add_special_tokens=False).ids
        assert saved.encode(text, add_special_tokens=False) == expected, text
        assert transformers_gguf.encode(text, add_special_tokens=False) == expected, text
        assert saved.decode(expected) == original.decode(expected, skip_special_tokens=False)
    assert checkpoint.chat_template == CHAT_TEMPLATE == saved.chat_template
    assert (saved.bos_token, saved.eos_token, saved.pad_token) == ("<s>", "</s>", "<pad>")
    assert checkpoint.eos_token_ids == [1, original.token_to_id(END_OF_TURN[family])]


# ---------------------------------------------------------------------------------------------
# what is refused


def llama_kvs(**overrides) -> list[bytes]:
    """The metadata gguf_checkpoint needs of a llama file, packed; an override of None leaves a key out."""
    values = {"general.architecture": (STRING, packed_string("llama")), "llama.block_count": (U32, 1),
              "llama.embedding_length": (U32, 32), "llama.feed_forward_length": (U32, 64),
              "llama.attention.head_count": (U32, 2), "llama.context_length": (U32, 64),
              "llama.attention.layer_norm_rms_epsilon": (FLOAT32, struct.pack("<f", 1e-5))}
    values.update(overrides)
    kvs = []
    for key, entry in values.items():
        if entry is not None:
            kind, value = entry
            kvs.append(packed_kv(key, kind, struct.pack("<I", value) if isinstance(value, int) else value))
    return kvs


def base_parts() -> dict:
    """A small valid file: `a`, 8 floats at 0, and `b`, a Q8_0 [2, 32] (two blocks of 34 bytes) at 32."""
    return {"kvs": [packed_kv("general.architecture", STRING, packed_string("llama")),
                    packed_kv("general.alignment", U32, struct.pack("<I", 32))],
            "infos": [packed_tensor("a", (8,), F32, 0), packed_tensor("b", (32, 2), Q8_0, 32)],
            "data": bytes(32 + 68)}


def variant(**changes) -> bytes:
    parts = base_parts()
    parts.update(changes)
    return packed_gguf(**parts)


def tensor(name="b", ne=(32, 2), kind=Q8_0, offset=32) -> list[bytes]:
    return [packed_tensor("a", (8,), F32, 0), packed_tensor(name, ne, kind, offset)]


def kv(key, kind, payload) -> list[bytes]:
    return [packed_kv("general.architecture", STRING, packed_string("llama")), packed_kv(key, kind, payload)]


HOSTILE = {
    "bad magic": (b"GGML" + variant()[4:], "starts with b'GGML'"),
    "version 1": (variant(version=1), "version 1;"),
    "big-endian": (variant(version=3 << 24), "big-endian"),
    "tensor count": (variant(counts=(1 << 40, 2)), "1099511627776 tensor infos"),
    "metadata count": (variant(counts=(2, 1 << 40)), "1099511627776 metadata entries"),
    "4 GB string": (variant(kvs=[packed_string("general.architecture") + struct.pack("<IQ", STRING, 4 << 30)]),
                    "needs 4294967296 bytes"),
    "huge number array": (variant(kvs=kv("x", ARRAY, struct.pack("<IQ", U32, 1 << 60))), f"needs {4 << 60} bytes"),
    "huge string array": (variant(kvs=kv("x", ARRAY, struct.pack("<IQ", STRING, 1 << 60))), f"needs {8 << 60} bytes"),
    "unknown value type": (variant(kvs=kv("x", 13, b"")), "unknown type 13"),
    "unknown array type": (variant(kvs=kv("x", ARRAY, struct.pack("<IQ", 13, 1))), "array of unknown type 13"),
    "nested arrays": (variant(kvs=kv("x", ARRAY, struct.pack("<IQ", ARRAY, 1) * 5 + struct.pack("<IQ", U32, 0))),
                      "deeper than 4"),
    "bad UTF-8 key": (variant(kvs=kv(b"\xff\xfe", U32, bytes(4))), "not valid UTF-8"),
    "bad UTF-8 value": (variant(kvs=kv("general.name", STRING, packed_string(b"\xc3\x28"))), "not valid UTF-8"),
    "bad UTF-8 tensor name": (variant(infos=tensor(name=b"\x80")), "not valid UTF-8"),
    "duplicate key": (variant(kvs=kv("general.architecture", STRING, packed_string("llama"))), "appears twice"),
    "duplicate tensor": (variant(infos=tensor(name="a")), "tensor 'a' appears twice"),
    "no architecture": (variant(kvs=[]), "no general.architecture"),
    "architecture not a string": (variant(kvs=[packed_kv("general.architecture", U32, bytes(4))]),
                                  "no general.architecture"),
    "alignment 0": (variant(kvs=kv("general.alignment", U32, struct.pack("<I", 0))), "not a power of two"),
    "alignment 3": (variant(kvs=kv("general.alignment", U32, struct.pack("<I", 3))), "not a power of two"),
    "no dimensions": (variant(infos=tensor(ne=())), "has 0 dimensions"),
    "five dimensions": (variant(infos=tensor(ne=(32, 1, 1, 1, 2))), "has 5 dimensions"),
    "dimension 0": (variant(infos=tensor(ne=(32, 0))), "has dimensions [32, 0]"),
    "element count overflow": (variant(infos=tensor(ne=(1 << 32, 1 << 32), kind=F32)), "has dimensions"),
    "huge dimension": (variant(infos=tensor(ne=(1 << 60,), kind=F32)), "runs past the end"),
    "unknown ggml type": (variant(infos=tensor(kind=99)), "unknown ggml type 99"),
    "removed ggml type": (variant(infos=tensor(kind=4)), "unknown ggml type 4"),  # Q4_2, long gone
    "partial block": (variant(infos=tensor(ne=(16, 4))), "not whole Q8_0 blocks of 32"),
    "misaligned": (variant(infos=tensor(offset=40)), "not a multiple of the alignment 32"),
    "past the end": (variant(infos=tensor(offset=64)), "runs past the end"),
    "overlap": (variant(infos=tensor(offset=0)), "overlap"),
    "data cut short": (variant()[:-1], "runs past the end"),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_file_is_refused_in_one_line(case, tmp_path):
    content, problem = HOSTILE[case]
    path = tmp_path / "hostile.gguf"
    path.write_bytes(content)
    start = time.perf_counter()
    with pytest.raises(SpecCompileError) as refused:
        read_gguf(path)
    message = str(refused.value)
    assert message.startswith(f"{path}: ") and "\n" not in message and problem in message, message
    assert time.perf_counter() - start < 0.5


def test_the_base_of_the_hostile_files_is_valid(tmp_path):
    (tmp_path / "ok.gguf").write_bytes(variant())
    file = read_gguf(tmp_path / "ok.gguf")
    assert [(t.shape, t.ggml_type_name, t.nbytes) for t in file.tensors.values()] == [((8,), "F32", 32),
                                                                                       ((2, 32), "Q8_0", 68)]


def test_a_4gb_string_is_not_allocated(tmp_path):
    path = tmp_path / "claims.gguf"
    path.write_bytes(HOSTILE["4 GB string"][0] + bytes(1 << 16))
    tracemalloc.start()
    try:
        with pytest.raises(SpecCompileError):
            read_gguf(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_every_truncation_is_refused(tmp_path):
    content = variant()
    path = tmp_path / "cut.gguf"
    for length in range(len(content)):
        path.write_bytes(content[:length])
        with pytest.raises(SpecCompileError):
            read_gguf(path)


@pytest.mark.parametrize("family", ["gemma3_text", "phi3"])
def test_corrupted_headers_are_refused_or_read_never_crash(family, ggufs, tmp_path):
    """Random bytes changed in a real file's header: read as a checkpoint or refused, never another exception."""
    original = ggufs(family).read_bytes()
    header_end = min(t.offset for t in read_gguf(ggufs(family)).tensors.values())
    rng, path = random.Random(0), tmp_path / "corrupt.gguf"
    for _ in range(200):
        content = bytearray(original)
        for _ in range(rng.randint(1, 4)):
            content[rng.randrange(header_end)] = rng.randrange(256)
        path.write_bytes(content)
        try:
            gguf_checkpoint(path)
        except SpecCompileError as e:
            assert "\n" not in str(e)


def test_unsupported_architecture_is_named(tmp_path):
    path = tmp_path / "mamba.gguf"
    path.write_bytes(variant(kvs=[packed_kv("general.architecture", STRING, packed_string("mamba"))]))
    with pytest.raises(SpecCompileError) as refused:
        gguf_checkpoint(path)
    assert str(refused.value) == (f"{path}: GGUF architecture 'mamba' is not supported "
                                  "(supported: gemma3, llama, phi3, qwen2, qwen3)")


def test_tensor_without_a_hf_counterpart_is_refused(tmp_path):
    """A Mixtral-style expert tensor in a llama file: refused rather than dropped."""
    path = tmp_path / "moe.gguf"
    infos = [packed_tensor("token_embd.weight", (32, 10), F32, 0),
             packed_tensor("blk.0.ffn_gate_exps.weight", (32, 64, 2), F32, 1280)]
    path.write_bytes(packed_gguf(llama_kvs(), infos, bytes(1280 + 32 * 64 * 2 * 4)))
    with pytest.raises(SpecCompileError, match="tensor 'blk.0.ffn_gate_exps.weight' has no counterpart"):
        gguf_checkpoint(path)


def test_rope_freqs_that_are_not_llama3_scaling_are_refused(tmp_path):
    """Llama 3's scaling comes back from rope_freqs (test_config_states_every_hyper_parameter_of_the_original);
    factors it cannot have made are not taken for it."""
    path = tmp_path / "freqs.gguf"
    infos = [packed_tensor("token_embd.weight", (32, 10), F32, 0), packed_tensor("rope_freqs.weight", (8,), F32, 1280)]
    factors = struct.pack("<8f", 1, 1, 2, 2, 3, 3, 4, 4)
    path.write_bytes(packed_gguf(llama_kvs(), infos, bytes(1280) + factors))
    with pytest.raises(SpecCompileError, match="rope_freqs.weight is not Llama 3's rope scaling"):
        gguf_checkpoint(path)


@pytest.mark.parametrize("kvs, problem", [
    (llama_kvs(**{"llama.block_count": None}), "GGUF metadata has no 'llama.block_count'"),
    (llama_kvs(**{"llama.block_count": (STRING, packed_string("2"))}), "'llama.block_count' is '2', not int"),
    (llama_kvs(**{"tokenizer.ggml.eos_token_id": (U32, 7)}), "'tokenizer.ggml.eos_token_id' is 7, not a token"),
])
def test_metadata_the_config_needs_is_checked(kvs, problem, tmp_path):
    path = tmp_path / "meta.gguf"
    path.write_bytes(packed_gguf(kvs, [packed_tensor("token_embd.weight", (32, 10), F32, 0)], bytes(1280)))
    with pytest.raises(SpecCompileError, match=problem):
        gguf_checkpoint(path)
