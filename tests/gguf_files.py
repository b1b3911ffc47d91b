"""GGUF files for tests: tiny Hugging Face checkpoints converted the way llama.cpp's convert_hf_to_gguf.py
converts them, and hand-packed containers for the reader's hostile-input tests.

`write_gguf` follows the converter's conventions for each family, independently of the reader in
speccompile/compiler/gguf.py (it names tensors through gguf-py's own TensorNameMap): Llama's q and k
rows interleaved for llama.cpp's rotary (LlamaModel.permute), Llama 3's rope scaling as a rope_freqs
tensor, Gemma 3's norms stored as 1 + w and its embedding cut to the tokenizer, Phi-3's fused
projections, partial rotary and LongRoPE factor tensors, and the tokenizer as GPT-2-style BPE tokens,
token types and merges (TextModel.get_vocab_base, gguf.SpecialVocab).
"""

import json
import struct
from pathlib import Path

import numpy as np

FAMILIES = ("llama", "qwen2", "qwen3", "gemma3_text", "phi3")
GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3", "phi3": "phi3"}
END_OF_TURN = {"llama": "<|eot_id|>", "qwen2": "<|im_end|>", "qwen3": "<|im_end|>", "gemma3_text": "<end_of_turn>",
               "phi3": "<|end|>"}
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
PADDING = 8  # embedding rows beyond the tokenizer, as real checkpoints have


# ---------------------------------------------------------------------------------------------
# tiny checkpoints


def make_hf_checkpoint(path, family: str, seed: int = 0, hidden: int = 64) -> Path:
    """A tiny random `family` model and its tokenizer, saved as a user's checkpoint directory would be.
    Every parameter is random (norms and biases too), so that a misplaced tensor shows. `hidden` 256
    (Llama) makes every matrix's input a multiple of 256, which the K-quants need."""
    import torch
    import transformers

    from tests.tiny_models import make_tokenizer

    tokenizer = make_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [END_OF_TURN[family]]})
    config = _config(family, len(tokenizer) + PADDING, hidden)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            values = rng.normal(0, 0.2, parameter.shape)
            if family == "gemma3_text" and name.endswith("norm.weight"):
                values = np.round(values * 1024) / 1024  # so that the file's 1 + w is exact in float32
            parameter.copy_(torch.from_numpy(values.astype(np.float32)))
    path = Path(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _config(family: str, vocab: int, hidden: int = 64):
    """hidden 64, 4 heads of 32 (Qwen2 and Phi-3 have no head_dim setting: 16), 2 KV heads, and what
    each family's GGUF says differently: Llama 3's rope scaling and attention biases, Qwen3's YaRN,
    Gemma 3's window, pattern of 5 windowed layers then a global one and its scaled global rope,
    Phi-3's partial rotary and LongRoPE."""
    import transformers

    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                  num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=0,
                  eos_token_id=1, pad_token_id=2)
    if family == "llama":
        llama3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        return transformers.LlamaConfig(**{**common, "max_position_embeddings": 16384}, head_dim=hidden // 2,
                                        attention_bias=True, tie_word_embeddings=False, rope_parameters=llama3)
    if family == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=True,
                                        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if family == "qwen3":
        yarn = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 128}
        return transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True, rope_parameters=yarn)
    if family == "gemma3_text":
        ropes = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                 "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
        return transformers.Gemma3TextConfig(**{**common, "num_hidden_layers": 6}, head_dim=32,
                                             query_pre_attn_scalar=32, sliding_window=8, rope_parameters=ropes)
    assert family == "phi3", family
    pairs = 64 // 4 * 3 // 8  # 3/4 of each 16-wide head turns: 6 frequency pairs
    longrope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                "short_factor": [1.0 + 0.1 * j for j in range(pairs)], "long_factor": [2.0 + j for j in range(pairs)]}
    return transformers.Phi3Config(**common, original_max_position_embeddings=128, sliding_window=None,
                                   tie_word_embeddings=False, rope_parameters=longrope)


# ---------------------------------------------------------------------------------------------
# conversion


def write_gguf(hf_dir, out_path, qtype: str = "F32", chat_template: str | None = None, split_qkv: bool = False,
               mixed: dict[str, str] | None = None) -> Path:
    """Convert a tiny checkpoint of FAMILIES to GGUF. qtype "F32" keeps every tensor as is; "Q8_0",
    "Q4_0" (or another type gguf-py can quantize to) applies to the 2-d weights, norms and biases stay F32.
    `mixed`: another type for the tensors whose GGUF name contains a key (llama.cpp's Q4_K_M, say, keeps
    attn_v at Q8_0 in some layers beside Q5_0 q and k).
    split_qkv writes Phi-3's fused qkv_proj as attn_q, attn_k and attn_v, which llama.cpp also reads."""
    import gguf
    from safetensors.numpy import load_file

    hf_dir, out_path = Path(hf_dir), Path(out_path)
    config = json.loads((hf_dir / "config.json").read_text())
    family = config["model_type"]
    arch = GGUF_ARCH[family]
    writer = gguf.GGUFWriter(out_path, arch)
    writer.add_name(hf_dir.name)
    _add_hyper_parameters(writer, family, config)
    real_vocab = _add_vocabulary(writer, hf_dir, config["vocab_size"], chat_template)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config["num_hidden_layers"])
    for name, array in load_file(hf_dir / "model.safetensors").items():
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, f"no GGUF name for {name}"
        if split_qkv and ".attn_qkv." in gguf_name:
            q_rows = config["hidden_size"]
            kv_rows = config["num_key_value_heads"] * config["hidden_size"] // config["num_attention_heads"]
            for part, rows in zip("qkv", np.split(array, [q_rows, q_rows + kv_rows])):
                _add_tensor(writer, gguf_name.replace(".attn_qkv.", f".attn_{part}."), rows, qtype)
            continue
        kind = next((k for part, k in (mixed or {}).items() if part in gguf_name), qtype)
        _add_tensor(writer, gguf_name, _converted(family, config, name, array, real_vocab), kind)
    for name, array in _extra_tensors(family, config):
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def _rope(config: dict) -> dict:
    rope = config.get("rope_parameters") or {}
    return rope.get("full_attention", rope)  # Gemma 3's GGUF states the global layers' rope


def _add_hyper_parameters(writer, family: str, config: dict) -> None:
    """TextModel.set_gguf_parameters and each family's additions to it."""
    import gguf

    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    rope = _rope(config)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(rope["rope_theta"])
    if config.get("head_dim") is not None and family != "phi3":  # Phi3MiniModel writes its own set
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if family == "llama":
        writer.add_vocab_size(config["vocab_size"])
        writer.add_rope_dimension_count(config.get("head_dim") or hidden // heads)
    if family == "gemma3_text":
        writer.add_sliding_window(config["sliding_window"])
    if family == "phi3":
        writer.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * hidden) // heads)
        original = config.get("original_max_position_embeddings") or rope["original_max_position_embeddings"]
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_sliding_window(config.get("sliding_window") or 0)
        if rope.get("long_factor"):
            scale = config["max_position_embeddings"] / original
            writer.add_rope_scaling_attn_factors(np.sqrt(1 + np.log(scale) / np.log(original)) if scale > 1 else 1.0)


def _add_vocabulary(writer, hf_dir: Path, vocab_size: int, chat_template: str | None) -> int:
    """TextModel._set_vocab_gpt2: every id up to vocab_size, unused ones as [PAD{i}]; returns the
    converter's count of real tokens (tokenizer.json's vocab and added tokens, as Gemma3Model counts them)."""
    import gguf
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    by_id = {i: token for token, i in tokenizer.get_vocab().items()}
    added, decoder = tokenizer.get_added_vocab(), tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        token = by_id.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        tokens.append(token)
        if token not in added:
            types.append(gguf.TokenType.NORMAL)
        elif decoder[i].special or (token.startswith("<|") and token.endswith("|>")):
            types.append(gguf.TokenType.CONTROL)
        else:
            types.append(gguf.TokenType.USER_DEFINED)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(hf_dir, load_merges=True, n_vocab=len(tokens))
    special.add_to_gguf(writer, quiet=True)
    if chat_template is not None and special.chat_template is None:
        writer.add_chat_template(chat_template)
    tokenizer_json = json.loads((hf_dir / "tokenizer.json").read_text())
    return len(tokenizer_json["model"]["vocab"]) + len(tokenizer_json["added_tokens"])


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py: LlamaModel.permute (pairs each head's halves for llama.cpp's rotary)."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2) \
        .reshape(weights.shape)


def _converted(family: str, config: dict, name: str, array: np.ndarray, real_vocab: int) -> np.ndarray:
    if family == "llama" and (".q_proj." in name or ".k_proj." in name):
        return _permute(array, config["num_attention_heads" if ".q_proj." in name else "num_key_value_heads"])
    if family == "gemma3_text" and name == "model.embed_tokens.weight":
        return array[:real_vocab]  # Gemma3Model drops the rows beyond the tokenizer
    if family == "gemma3_text" and name.endswith("norm.weight"):
        return array + np.float32(1.0)  # Gemma3RMSNorm's 1 + w
    return array


def _extra_tensors(family: str, config: dict):
    """Rope settings llama.cpp wants as tensors (LlamaModel and Phi3MiniModel.generate_extra_tensors)."""
    rope = _rope(config)
    if family == "llama" and rope.get("rope_type") == "llama3":
        dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        freqs = 1.0 / (np.float32(rope["rope_theta"]) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
        old = rope["original_max_position_embeddings"]
        low, high, factor = rope["low_freq_factor"], rope["high_freq_factor"], rope["factor"]
        factors = []
        for freq in freqs:
            wavelen = 2 * np.pi / freq
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1.0 if wavelen < old / high else factor if wavelen > old / low
                           else 1 / ((1 - smooth) / factor + smooth))
        yield "rope_freqs.weight", np.array(factors, dtype=np.float32)
    if family == "phi3" and rope.get("long_factor"):
        yield "rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32)
        yield "rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32)


def _add_tensor(writer, name: str, array: np.ndarray, qtype: str) -> None:
    import gguf

    if qtype == "F32" or array.ndim != 2:
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
        return
    kind = gguf.GGMLQuantizationType[qtype]
    if qtype in K_QUANT_SPREAD:
        writer.add_tensor(name, _random_k_quant(array, qtype), raw_dtype=kind)
        return
    writer.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(array, dtype=np.float32), kind), raw_dtype=kind)


# gguf-py cannot quantize to K-quants. A K-quant tensor here has random integers, sub-block scales and
# minimums; its superblock scales (fp16 d at byte 0, dmin at 2; Q6_K's d at byte 208) are set so that its
# values spread about as the original's do: (byte, spread of the values per unit of it).
K_QUANT_SPREAD = {"Q4_K": ((0, 216.0), (2, 216.0 / 7.5)), "Q5_K": ((0, 439.0), (2, 439.0 / 15.5)),
                  "Q6_K": ((208, 1369.0),), "Q2_K": ((80, 12.0), (82, 8.0))}


def _random_k_quant(array: np.ndarray, qtype: str) -> np.ndarray:
    """Random blocks of `qtype` in the array's shape [rows, cols] (cols a multiple of 256), seeded by its
    values. Tests compare with the file's dequantized values, not the original's."""
    import gguf

    rows, cols = array.shape
    _, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    rng = np.random.default_rng(int(np.abs(array).sum() * 1000) % 2**32)
    raw = rng.integers(0, 256, (rows, cols // 256, nbytes), dtype=np.uint8)
    for at, per_unit in K_QUANT_SPREAD[qtype]:
        raw[:, :, at:at + 2] = np.array([array.std() / per_unit], np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


# ---------------------------------------------------------------------------------------------
# hand-packed containers (each part a byte string, so that a test can break any one of them)

U32, FLOAT32, STRING, ARRAY = 4, 6, 8, 9  # metadata value types


def packed_string(raw: bytes | str) -> bytes:
    raw = raw.encode() if isinstance(raw, str) else raw
    return struct.pack("<Q", len(raw)) + raw


def packed_kv(key: bytes | str, kind: int, payload: bytes) -> bytes:
    """One metadata entry: key, value type, and the value's bytes as given."""
    return packed_string(key) + struct.pack("<I", kind) + payload


def packed_tensor(name: bytes | str, ne: tuple, kind: int, offset: int) -> bytes:
    return packed_string(name) + struct.pack(f"<I{len(ne)}QIQ", len(ne), *ne, kind, offset)


def packed_gguf(kvs: list[bytes], infos: list[bytes], data: bytes, version: int = 3, counts: tuple | None = None,
                alignment: int = 32) -> bytes:
    """A whole file: header (counts default to the lists' lengths), metadata, tensor infos, padding, data."""
    tensors, entries = counts or (len(infos), len(kvs))
    head = b"GGUF" + struct.pack("<IQQ", version, tensors, entries) + b"".join(kvs) + b"".join(infos)
    return head + bytes(-len(head) % alignment) + data
