"""Read a GGUF file (llama.cpp's format) as a Hugging Face checkpoint: config, lazy weights, tokenizer.

A GGUF is untrusted input, so its container is parsed here rather than by gguf-py's GGUFReader, which
trusts the lengths it reads. Every count and length is checked against the bytes left in the file
before anything is read or allocated for it, and every problem is one SpecCompileError line naming
the file. The layout (little-endian; versions 2 and 3 are the same):

    "GGUF", u32 version, u64 tensor count, u64 metadata count
    metadata:     (string key, u32 value type, value) ...
    tensor infos: (string name, u32 n_dims, u64 ne[n_dims], u32 ggml type, u64 offset) ...
    padding to general.alignment (32 unless stated), then the tensor data; offsets count from there

A string is a u64 byte length and that many UTF-8 bytes; an array a u32 element type, a u64 count and
the elements. ggml lists dimensions fastest-moving first (`ne`), so a [out, in] weight has ne = [in, out].

On top of the container: `gguf_tensors` gives each tensor as a float32 LazyTensor (matrices in the
block formats of KEPT_BLOCKS keep their integers, scales and minimums too, see tensors.Blocks), and
`gguf_checkpoint` undoes llama.cpp's conversion (convert_hf_to_gguf.py) to give the config.json,
tensors and tokenizer transformers would have for the model, which is what checkpoint.py reads.
"""

import functools
import math
import mmap
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from speccompile.compiler.tensors import (
    BFLOAT16,
    INT4,
    Blocks,
    LazyTensor,
    SharedResult,
    concatenated,
    rows_permuted,
    shifted,
)
from speccompile.errors import SpecCompileError

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # version 1 counted in 32 bits; nothing in use still writes it
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ELEMENTS = (1 << 63) - 1  # ggml counts elements in int64
MAX_NESTING = 4  # arrays of arrays: the format allows them, no model writes them deeper than this

# metadata value types: u8 i8 u16 i16 u32 i32 f32 bool (8: string, 9: array) u64 i64 f64
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_FLOAT32, _STRING, _ARRAY = 6, 8, 9
# The fewest bytes an entry can take: a metadata entry is an empty key (8), its type (4) and a 1-byte
# value; a tensor info an empty name (8), n_dims (4), one dimension (8), its type (4) and offset (8).
_MIN_ENTRY, _MIN_TENSOR = 13, 32

# What a LazyTensor can be read from: plain floats directly, blocks through gguf-py's dequantize.
_FLOATS = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": BFLOAT16}
_QUANTIZED = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
              "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS")
READABLE = (*_FLOATS, *_QUANTIZED)


def is_gguf(path: Path) -> bool:
    """Whether a file starts as a GGUF does (what `build --target` tells a GGUF from a directory by)."""
    with open(path, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


def _gguf():
    """gguf-py (llama.cpp's own package), for ggml's type table and its dequantizers."""
    try:
        import gguf
    except ImportError:
        raise SpecCompileError("reading GGUF files needs the gguf package: pip install gguf") from None
    return gguf


# ---------------------------------------------------------------------------------------------
# the container


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # numpy order (ne reversed): a linear weight is [out_features, in_features]
    ggml_type_name: str  # "F32", "Q8_0", "Q4_K", ...
    offset: int  # of its first byte, from the start of the file
    nbytes: int


@dataclass(frozen=True, eq=False)
class GGUFFile:
    path: Path
    version: int
    metadata: dict  # key -> int, float, bool, str or list (of those, or of lists)
    tensors: dict[str, GGUFTensor]

    @property
    def architecture(self) -> str:
        return self.metadata["general.architecture"]


def read_gguf(path) -> GGUFFile:
    """The header, metadata and tensor table of a GGUF file, checked; no tensor data is read."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            if path.stat().st_size < len(MAGIC) + 20:
                raise SpecCompileError(f"{path}: not a valid GGUF file (truncated: {path.stat().st_size} bytes)")
            # Mapped, not read: only the header's pages are touched, however large the tensor data.
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                return _parse(_Cursor(path, data))
    except OSError as e:
        raise SpecCompileError(f"{path}: cannot read GGUF file ({e.strerror or e})") from None


class _Cursor:
    """Reads a mapped file front to back; every read is checked against the bytes left first."""

    def __init__(self, path: Path, data):
        self.path, self.data, self.pos = path, data, 0

    def fail(self, problem: str) -> SpecCompileError:
        return SpecCompileError(f"{self.path}: not a valid GGUF file ({problem})")

    def need(self, count: int, what: str) -> None:
        left = len(self.data) - self.pos
        if count > left:
            raise self.fail(f"{what} needs {count} bytes at offset {self.pos}, the file has {left} left")

    def take(self, count: int, what: str) -> bytes:
        self.need(count, what)
        self.pos += count
        return self.data[self.pos - count:self.pos]

    def unpack(self, fmt: str, what: str):
        values = struct.unpack("<" + fmt, self.take(struct.calcsize("<" + fmt), what))
        return values[0] if len(values) == 1 else values

    def string(self, what: str) -> str:
        raw = self.take(self.unpack("Q", what), what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} at offset {self.pos - len(raw)} is not valid UTF-8") from None


def _parse(cur: _Cursor) -> GGUFFile:
    magic = cur.take(len(MAGIC), "magic")
    if magic != MAGIC:
        raise cur.fail(f"it starts with {magic!r}, not {MAGIC!r}")
    version, tensor_count, kv_count = cur.unpack("IQQ", "header")
    if version not in VERSIONS:
        swapped = " (a big-endian file?)" if version > 0xFFFF else ""
        raise cur.fail(f"version {version}{swapped}; versions {' and '.join(map(str, VERSIONS))} are read")
    # A count the rest of the file cannot hold is refused here, before a list is built for it.
    cur.need(kv_count * _MIN_ENTRY + tensor_count * _MIN_TENSOR,
             f"{kv_count} metadata entries and {tensor_count} tensor infos")
    metadata = _metadata(cur, kv_count)
    if not isinstance(metadata.get("general.architecture"), str):
        raise cur.fail("its metadata has no general.architecture")
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
        raise cur.fail(f"general.alignment {alignment!r} is not a power of two")
    infos = [_tensor_info(cur) for _ in range(tensor_count)]
    data_start = -(-cur.pos // alignment) * alignment
    tensors = {}
    for name, ne, type_id, offset in infos:
        if name in tensors:
            raise cur.fail(f"tensor {name!r} appears twice")
        tensors[name] = _tensor(cur, name, ne, type_id, offset, data_start, alignment)
    _check_disjoint(cur, tensors.values())
    return GGUFFile(cur.path, version, metadata, tensors)


def _metadata(cur: _Cursor, count: int) -> dict:
    metadata = {}
    for _ in range(count):
        key = cur.string("a metadata key")
        if key in metadata:
            raise cur.fail(f"metadata key {key!r} appears twice")
        metadata[key] = _value(cur, cur.unpack("I", f"the type of {key!r}"), key, depth=0)
    return metadata


def _value(cur: _Cursor, kind: int, key: str, depth: int):
    what = f"the value of {key!r}"
    if kind in _SCALARS:
        value = cur.unpack(_SCALARS[kind], what)
        # a float32 as its shortest decimal, as the config it came from spelt it (1e-06, not 9.99999997e-07)
        return float(str(np.float32(value))) if kind == _FLOAT32 else value
    if kind == _STRING:
        return cur.string(what)
    if kind != _ARRAY:
        raise cur.fail(f"{what} has unknown type {kind}")
    if depth == MAX_NESTING:
        raise cur.fail(f"{what} nests arrays deeper than {MAX_NESTING}")
    item, count = cur.unpack("IQ", what)
    if item in _SCALARS:
        width = struct.calcsize(_SCALARS[item])
        values = struct.unpack(f"<{count}{_SCALARS[item]}", cur.take(count * width, what))
        return list(values)
    if item not in (_STRING, _ARRAY):
        raise cur.fail(f"{what} is an array of unknown type {item}")
    cur.need(count * (8 if item == _STRING else 12), what)  # each element starts with its own length
    return [_value(cur, item, key, depth + 1) for _ in range(count)]


def _tensor_info(cur: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = cur.string("a tensor name")
    n_dims = cur.unpack("I", f"the dimension count of tensor {name!r}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise cur.fail(f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS} are allowed)")
    ne = struct.unpack(f"<{n_dims}Q", cur.take(8 * n_dims, f"the dimensions of tensor {name!r}"))
    type_id, offset = cur.unpack("IQ", f"the type and offset of tensor {name!r}")
    return name, ne, type_id, offset


def _tensor(cur: _Cursor, name: str, ne: tuple, type_id: int, offset: int, data_start: int,
            alignment: int) -> GGUFTensor:
    gguf = _gguf()
    try:
        kind = gguf.GGMLQuantizationType(type_id)
        block, type_size = gguf.GGML_QUANT_SIZES[kind]
    except (ValueError, KeyError):
        raise cur.fail(f"tensor {name!r} has unknown ggml type {type_id}") from None
    elements = math.prod(ne)
    if min(ne) < 1 or elements > MAX_ELEMENTS:
        raise cur.fail(f"tensor {name!r} has dimensions {list(ne)}")
    if ne[0] % block:
        raise cur.fail(f"tensor {name!r}: rows of {ne[0]} are not whole {kind.name} blocks of {block}")
    nbytes = elements // block * type_size
    if offset % alignment:
        raise cur.fail(f"tensor {name!r} starts at offset {offset}, not a multiple of the alignment {alignment}")
    if data_start + offset + nbytes > len(cur.data):
        raise cur.fail(f"tensor {name!r} ({nbytes} bytes at offset {data_start + offset}) runs past the end "
                       f"of the file ({len(cur.data)} bytes)")
    return GGUFTensor(name, tuple(reversed(ne)), kind.name, data_start + offset, nbytes)


def _check_disjoint(cur: _Cursor, tensors) -> None:
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors)
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < end:
            raise cur.fail(f"tensors {first!r} and {second!r} overlap")


# ---------------------------------------------------------------------------------------------
# tensors as lazy float32 arrays


def gguf_tensors(file: GGUFFile) -> dict[str, LazyTensor]:
    """Every tensor of the file as a float32 LazyTensor in numpy shape; nothing is read until loaded."""
    return {name: lazy_tensor(file.path, info) for name, info in file.tensors.items()}


def lazy_tensor(path: Path, info: GGUFTensor) -> LazyTensor:
    """One tensor, dequantized to float32 when loaded. A matrix in one of KEPT_BLOCKS' formats also
    keeps its blocks ([out, in], along in), so that a graph computes with the file's own numbers
    instead of quantizing them a second time."""
    if info.ggml_type_name not in READABLE:
        raise SpecCompileError(f"{path}: tensor {info.name!r} is stored as {info.ggml_type_name}, which cannot be "
                               f"read (readable: {', '.join(READABLE)})")
    blocks = None
    kept = KEPT_BLOCKS.get(info.ggml_type_name)
    if kept is not None and len(info.shape) == 2:
        blocks = _kept_blocks(path, info, kept)
    return LazyTensor(info.shape, np.dtype(np.float32), functools.partial(_dequantized, path, info), blocks)


def _read(path: Path, info: GGUFTensor) -> np.ndarray:
    """The tensor's bytes, by one positioned read into a fresh (writable) buffer."""
    raw = bytearray(info.nbytes)
    with open(path, "rb") as f:
        f.seek(info.offset)
        got = f.readinto(raw)
    if got != info.nbytes:
        raise SpecCompileError(f"{path}: tensor {info.name!r} is cut short (the file changed after it was read?)")
    return np.frombuffer(raw, np.uint8)


def _dequantized(path: Path, info: GGUFTensor) -> np.ndarray:
    raw = _read(path, info)
    if info.ggml_type_name in _FLOATS:
        values = raw.view(_FLOATS[info.ggml_type_name])
    else:  # rows of whole blocks, which is how gguf-py's dequantizers take them
        gguf = _gguf()
        values = gguf.quants.dequantize(raw.reshape(-1, raw.size // math.prod(info.shape[:-1])),
                                        gguf.GGMLQuantizationType[info.ggml_type_name])
    return values.reshape(info.shape).astype(np.float32, copy=False)


# ---------------------------------------------------------------------------------------------
# block formats a graph keeps: value = scale × q + offset, per block along a row


@dataclass(frozen=True)
class BlockFormat:
    """How one ggml block type is kept: its stored blocks of `nbytes` (32 values, or a K-quant's 256)
    hold values in blocks of `block` with a scale each (and a minimum each, for the asymmetric types),
    whose integers fit `bits`-bit signed ints (ONNX Runtime's MatMulNBits takes 4 and 8). `unpack`
    turns stored blocks [n, nbytes] into (q int8 [n, values] centred on 0, scale [n, values / block],
    offset or None)."""

    nbytes: int
    block: int
    bits: int
    has_minimum: bool
    unpack: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray | None]]


def _f16(raw: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at byte `at` of each block, as float32 [n, 1] (exact)."""
    return np.ascontiguousarray(raw[:, at:at + 2]).view("<f2").astype(np.float32)


def _nibbles(raw: np.ndarray, width: int) -> np.ndarray:
    """Runs of `width` bytes [n, runs * width] -> [n, runs * 2 * width]: each run's low nibbles are its
    first `width` values, its high nibbles the next `width` (the layout of every 4-bit ggml type)."""
    runs = raw.reshape(raw.shape[0], -1, 1, width) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (runs & 0x0F).reshape(raw.shape[0], -1)


def _fifth_bits(raw: np.ndarray, at: int) -> np.ndarray:
    """Q5_0/Q5_1: the 32 values' fifth bits, a little-endian u32 at byte `at`, as 0/16 [n, 32]."""
    return np.unpackbits(raw[:, at:at + 4], axis=-1, bitorder="little") << 4


def _q8_0(raw):  # d, 32 int8: d × q
    return np.ascontiguousarray(raw[:, 2:]).view(np.int8), _f16(raw, 0), None


def _q4_0(raw):  # d, 32 nibbles: d × (q - 8)
    return _nibbles(raw[:, 2:], 16).astype(np.int8) - 8, _f16(raw, 0), None


def _q4_1(raw):  # d, m, 32 nibbles: d × q + m
    d, m = _f16(raw, 0), _f16(raw, 2)
    return _nibbles(raw[:, 4:], 16).astype(np.int8) - 8, d, m + 8 * d


def _q5_0(raw):  # d, fifth bits, 32 nibbles: d × (q - 16)
    return (_nibbles(raw[:, 6:], 16) | _fifth_bits(raw, 2)).astype(np.int8) - 16, _f16(raw, 0), None


def _q5_1(raw):  # d, m, fifth bits, 32 nibbles: d × q + m
    d, m = _f16(raw, 0), _f16(raw, 2)
    return (_nibbles(raw[:, 8:], 16) | _fifth_bits(raw, 4)).astype(np.int8) - 16, d, m + 16 * d


def _k_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: d, dmin, then 12 bytes of eight 6-bit scales and eight 6-bit minimums (sub-blocks
    0-3 in the low 6 bits of bytes 0-3 and 4-7; 4-7 in the nibbles of bytes 8-11 and the top 2 bits
    of bytes 0-7). Returns each sub-block's scale d × sc and minimum dmin × m, [n, 8] each."""
    low, high, rest = raw[:, 4:8], raw[:, 8:12], raw[:, 12:16]
    sc = np.concatenate([low & 0x3F, (rest & 0x0F) | ((low >> 2) & 0x30)], axis=-1)
    m = np.concatenate([high & 0x3F, (rest >> 4) | ((high >> 2) & 0x30)], axis=-1)
    return _f16(raw, 0) * sc, _f16(raw, 2) * m


def _q4_k(raw):  # 8 sub-blocks of 32: scale × q - minimum
    scale, minimum = _k_scales(raw)
    return _nibbles(raw[:, 16:], 32).astype(np.int8) - 8, scale, 8 * scale - minimum


def _q5_k(raw):  # as Q4_K, with 32 bytes of fifth bits: bit j of byte i is value i of sub-block j
    scale, minimum = _k_scales(raw)
    high = (raw[:, 16:48, None] >> np.arange(8, dtype=np.uint8)) & 1  # [n, 32, 8]
    fifth = np.swapaxes(high, 1, 2).reshape(raw.shape[0], -1) << 4
    return (_nibbles(raw[:, 48:], 32) | fifth).astype(np.int8) - 16, scale, 16 * scale - minimum


def _q6_k(raw):  # 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, d: d × sc × (q - 32)
    n = raw.shape[0]
    high = (raw[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
    q = _nibbles(raw[:, :128], 64) | (high.reshape(n, -1) << 4)
    scale = _f16(raw, 208) * np.ascontiguousarray(raw[:, 192:208]).view(np.int8)
    return q.astype(np.int8) - 32, scale, None


# The formats a graph keeps as they are; the rest (2-3-bit K-quants, the IQ codebooks) are dequantized
# and quantized at the build's precision. 5- and 6-bit integers are kept in 8 bits: exact, at 8 bits a
# value where llama.cpp keeps 5.5-6.6.
KEPT_BLOCKS = {
    "Q8_0": BlockFormat(34, 32, 8, False, _q8_0),
    "Q4_0": BlockFormat(18, 32, 4, False, _q4_0),
    "Q4_1": BlockFormat(20, 32, 4, True, _q4_1),
    "Q5_0": BlockFormat(22, 32, 8, False, _q5_0),
    "Q5_1": BlockFormat(24, 32, 8, True, _q5_1),
    "Q4_K": BlockFormat(144, 32, 4, True, _q4_k),
    "Q5_K": BlockFormat(176, 32, 8, True, _q5_k),
    "Q6_K": BlockFormat(210, 16, 8, False, _q6_k),
}


def _kept_blocks(path: Path, info: GGUFTensor, kept: BlockFormat) -> Blocks:
    """q, scale and offset of a [rows, cols] matrix, from one read and unpack of its bytes."""
    rows, cols = info.shape
    per_row = (rows, cols // kept.block)

    def unpacked():
        q, scale, offset = kept.unpack(_read(path, info).reshape(-1, kept.nbytes))
        q = q.reshape(info.shape)
        return (q.astype(INT4) if kept.bits == 4 else q, scale.reshape(per_row),
                None if offset is None else offset.reshape(per_row))

    parts = SharedResult(unpacked, parts=3 if kept.has_minimum else 2)
    q = LazyTensor(info.shape, INT4 if kept.bits == 4 else np.dtype(np.int8), lambda: parts.take(0))
    scale = LazyTensor(per_row, np.dtype(np.float32), lambda: parts.take(1))
    offset = LazyTensor(per_row, np.dtype(np.float32), lambda: parts.take(2)) if kept.has_minimum else None
    return Blocks(q, scale, axis=1, block=kept.block, offset=offset)


# ---------------------------------------------------------------------------------------------
# families: how llama.cpp names and stores each one


_LAYER = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Tensors llama.cpp computes from the config; their contents go back into it (_rope_scaling, _phi3).
_INTO_CONFIG = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}


@dataclass(frozen=True)
class Family:
    model_type: str  # HF's
    architecture: str  # HF's model class, config.json's "architectures"
    layer: dict[str, str]  # GGUF tensor in blk.N -> HF module in model.layers.N
    # llama.cpp's LLAMA rope rotates adjacent pairs, HF's the two halves of each head, so the converter
    # (convert_hf_to_gguf.py: LlamaModel.permute) interleaves the rows of q and k; undone here
    permuted_qk: bool = False
    # Gemma's RMSNorm scales by 1 + w; the converter stores 1 + w so that llama.cpp's plain RMSNorm fits
    # (Gemma3Model.modify_tensors, undone by transformers' Gemma2TensorProcessor): w is 1 less
    norms_plus_one: bool = False
    activation: tuple[str, str] = ("hidden_act", "silu")  # config key and value
    rope_theta: float = 10000.0  # when the file does not say (HF's default for the family)


FAMILIES = {
    "llama": Family("llama", "LlamaForCausalLM", _LAYER, permuted_qk=True),
    "qwen2": Family("qwen2", "Qwen2ForCausalLM", _LAYER),
    "qwen3": Family("qwen3", "Qwen3ForCausalLM", {**_LAYER, **_QK_NORMS}),
    "gemma3": Family("gemma3_text", "Gemma3ForCausalLM", {
        **_LAYER, **_QK_NORMS, "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
        norms_plus_one=True, activation=("hidden_activation", "gelu_pytorch_tanh"), rope_theta=1_000_000.0),
    # Phi-3 keeps HF's fused projections; some files split q, k and v (fused again in _fuse_phi3_qkv)
    "phi3": Family("phi3", "Phi3ForCausalLM", {
        **{k: v for k, v in _LAYER.items() if k != "ffn_gate"}, "attn_qkv": "self_attn.qkv_proj",
        "ffn_up": "mlp.gate_up_proj"}),
}

# Tokens that end a chat turn, where a vocabulary has them as special tokens (generation stops there too).
CHAT_END_TOKENS = ("<end_of_turn>", "<|im_end|>", "<|end|>", "<|eot_id|>", "<|eom_id|>")


@dataclass(frozen=True, eq=False)
class GGUFCheckpoint:
    """A GGUF file as the Hugging Face checkpoint it was converted from."""

    path: Path
    file: GGUFFile
    config: dict  # what config.json would say (rope in transformers 4's rope_theta / rope_scaling keys)
    tensors: dict[str, LazyTensor]  # HF name -> float32, HF layout (kept blocks where the file had them)
    formats: dict[str, str]  # HF name -> the GGUF type it was stored as ("Q8_0", "F32", ...)
    chat_template: str | None
    eos_token_ids: list[int]  # the file's EOS, EOT and EOM, and its chat-turn end tokens

    def save_tokenizer(self, directory) -> Path:
        """Write a Hugging Face fast tokenizer for the file's vocabulary (tokenizer.json,
        tokenizer_config.json, chat template) into `directory`, through transformers' GGUF conversion."""
        from transformers import PreTrainedTokenizerFast
        from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

        try:  # transformers reads the file again, now that it is known to be well formed
            architecture, vocabulary, settings = get_gguf_tokenizer(str(self.path))
            backend, extra = convert_gguf_tokenizer(architecture, vocabulary)
        except Exception as e:  # on a well-formed file, a failure here is its vocabulary's (tokenizers raises
            # bare Exceptions: "Token `x` out of vocabulary")
            problem = " ".join(str(e).split())
            raise SpecCompileError(f"{self.path}: cannot build a tokenizer from its vocabulary ({problem})") from None
        backend, dropped = _only_file_tokens(backend, vocabulary["tokens"], self.file.metadata)
        special = {k: v for k, v in {**settings, **extra}.items() if not (isinstance(v, str) and v in dropped)}
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **special)
        directory = Path(directory)
        tokenizer.save_pretrained(directory)
        return directory


UNUSED_TOKEN = 5  # llama.cpp's LLAMA_TOKEN_TYPE_UNUSED: a placeholder ("[PAD123]") no text encodes to


def _only_file_tokens(backend, tokens: list[str], metadata: dict):
    """The converted tokenizer without the special tokens transformers' converters add that the file
    does not have (its GPT-2 converter adds '<|endoftext|>' past the vocabulary), and without the
    converter's placeholders for unused ids (which can lie past the embedding's rows: llama.cpp's
    Gemma 3 converter cuts the embedding to the real tokens but pads the token list). Returns
    (tokenizer, dropped token contents)."""
    import json

    from tokenizers import Tokenizer

    # llama.cpp's converter fills ids its tokenizer lacks (embedding padding) with "[PAD<id>]"
    # placeholders; the Hugging Face tokenizer of the same model has none of them, so they would also
    # set a GGUF draft's vocabulary apart from its HF target's
    types = metadata.get("tokenizer.ggml.token_type") or []
    placeholders = {token for i, token in enumerate(tokens)
                    if token == f"[PAD{i}]" and i < len(types) and types[i] == UNUSED_TOKEN}
    known = set(tokens) - placeholders
    data = json.loads(backend.to_str())
    dropped = {t["content"] for t in data.get("added_tokens", []) if t["content"] not in known}
    vocab = data["model"].get("vocab")
    if isinstance(vocab, dict) and placeholders:  # BPE and WordPiece: placeholders have no merges
        dropped |= placeholders & set(vocab)
        data["model"]["vocab"] = {token: i for token, i in vocab.items() if token not in placeholders}
    if not dropped:
        return backend, dropped
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] in known]
    return Tokenizer.from_str(json.dumps(data)), dropped


def gguf_checkpoint(path) -> GGUFCheckpoint:
    """A GGUF of a supported family as HF config, tensors and tokenizer; only the header is read
    (and the few small tensors that hold rope settings)."""
    file = read_gguf(path)
    family = FAMILIES.get(file.architecture)
    if family is None:
        raise SpecCompileError(f"{file.path}: GGUF architecture {file.architecture!r} is not supported "
                               f"(supported: {', '.join(sorted(FAMILIES))})")
    config = _config(file, family)
    tensors, formats = _hf_tensors(file, family, config)
    template = file.metadata.get("tokenizer.chat_template")
    return GGUFCheckpoint(file.path, file, config, tensors, formats, template if isinstance(template, str) else None,
                          _eos_token_ids(file))


# ---------------------------------------------------------------------------------------------
# tensors under HF names


_BLOCK_TENSOR = re.compile(r"blk\.(0|[1-9][0-9]*)\.([a-z0-9_]+)\.(weight|bias)")


def _hf_name(family: Family, name: str, num_layers: int) -> str | None:
    stem, _, suffix = name.rpartition(".")
    if stem in _GLOBAL and suffix in ("weight", "bias"):
        return f"{_GLOBAL[stem]}.{suffix}"
    match = _BLOCK_TENSOR.fullmatch(name)
    if match and int(match[1]) < num_layers and match[2] in family.layer:
        return f"model.layers.{match[1]}.{family.layer[match[2]]}.{match[3]}"
    return None


def _hf_tensors(file: GGUFFile, family: Family, config: dict) -> tuple[dict, dict]:
    tensors, formats = {}, {}
    for name, info in file.tensors.items():
        if name in _INTO_CONFIG:
            continue
        hf_name = _hf_name(family, name, config["num_hidden_layers"])
        if hf_name is None:
            raise SpecCompileError(f"{file.path}: tensor {name!r} has no counterpart in a Hugging Face "
                                   f"{family.model_type} model (not supported)")
        tensors[hf_name] = _undo_conversion(file, family, config, name, lazy_tensor(file.path, info))
        formats[hf_name] = info.ggml_type_name
    if family.model_type == "phi3":
        _fuse_phi3_qkv(tensors, formats)
    return tensors, formats


def _undo_conversion(file: GGUFFile, family: Family, config: dict, name: str, tensor: LazyTensor) -> LazyTensor:
    if family.permuted_qk and (".attn_q." in name or ".attn_k." in name):
        heads = config["num_attention_heads"] if ".attn_q." in name else config["num_key_value_heads"]
        return rows_permuted(tensor, _unpermute_order(file, name, tensor.shape[0], heads))
    if family.norms_plus_one and name.endswith("norm.weight"):
        return shifted(tensor, -1.0)
    return tensor


def _unpermute_order(file: GGUFFile, name: str, rows: int, heads: int) -> np.ndarray:
    """The inverse of LlamaModel.permute as a row gather: HF row (head h, half t, pair j) is GGUF
    row (h, j, t), where the converter wrote w.reshape(heads, 2, dim/2, ...).swapaxes(1, 2)."""
    if rows % (2 * heads):
        raise SpecCompileError(f"{file.path}: tensor {name!r} has {rows} rows, not {heads} heads of an even size")
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(0, 2, 1).reshape(-1)


def _fuse_phi3_qkv(tensors: dict, formats: dict) -> None:
    """HF's Phi-3 has one qkv_proj; a file that splits it into attn_q, attn_k and attn_v is joined back."""
    for q_name in [name for name in tensors if ".self_attn.q_proj." in name]:
        parts = [q_name.replace(".q_proj.", f".{p}_proj.") for p in "qkv"]
        if all(p in tensors for p in parts):
            fused = q_name.replace(".q_proj.", ".qkv_proj.")
            tensors[fused] = concatenated([tensors.pop(p) for p in parts], axis=0)
            formats[fused] = "+".join(dict.fromkeys(formats.pop(p) for p in parts))


# ---------------------------------------------------------------------------------------------
# config.json from the metadata


class _Metadata:
    """Typed reads of the file's metadata, each a one-line error when absent or of the wrong kind."""

    def __init__(self, file: GGUFFile):
        self.file, self.arch = file, file.architecture

    def get(self, key: str, kinds: tuple, default=None):
        key = key.replace("{arch}", self.arch)
        value = self.file.metadata.get(key)
        if value is None:
            if default is None:
                raise SpecCompileError(f"{self.file.path}: GGUF metadata has no {key!r}")
            return default
        if isinstance(value, bool) or not isinstance(value, kinds):  # bool is an int to Python, not to GGUF
            names = " or ".join(kind.__name__ for kind in kinds)
            raise SpecCompileError(f"{self.file.path}: GGUF metadata {key!r} is {value!r}, not {names}")
        return value

    def count(self, key: str, default=None) -> int:
        value = self.get(key, (int, list), default)
        if isinstance(value, list):  # a per-layer list, which these families state once per layer alike
            if len(set(value)) != 1:
                raise SpecCompileError(f"{self.file.path}: GGUF metadata {key!r} differs between layers")
            value = value[0]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise SpecCompileError(f"{self.file.path}: GGUF metadata {key!r} is {value!r}, not a count")
        return value

    def number(self, key: str, default=None) -> float:
        return float(self.get(key, (int, float), default))


def _config(file: GGUFFile, family: Family) -> dict:
    """config.json as transformers would have it for the model, from the keys llama.cpp's converter wrote."""
    meta = _Metadata(file)
    if "token_embd.weight" not in file.tensors:
        raise SpecCompileError(f"{file.path}: no token_embd.weight tensor")
    heads = meta.count("{arch}.attention.head_count")
    kv_heads = meta.count("{arch}.attention.head_count_kv", heads)
    hidden, layers = meta.count("{arch}.embedding_length"), meta.count("{arch}.block_count")
    if not heads or not kv_heads:
        raise SpecCompileError(f"{file.path}: GGUF metadata says the model has no attention or KV heads")
    if layers > len(file.tensors):  # every layer has tensors: a larger count is a lie, and lists are made of it
        raise SpecCompileError(f"{file.path}: GGUF metadata states {layers} layers, the file has {len(file.tensors)} "
                               f"tensors")
    # HF's head_dim: the key length where stated, else (llama only) the rope dimension count, else hidden / heads
    head_dim = meta.count("{arch}.attention.key_length", 0)
    if not head_dim and family.model_type == "llama":
        head_dim = meta.count("{arch}.rope.dimension_count", 0)
    head_dim = head_dim or hidden // heads
    if not head_dim:
        raise SpecCompileError(f"{file.path}: GGUF metadata gives heads of size 0 ({hidden} wide, {heads} heads)")
    config = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        # the embedding's rows, not the token list: the converter drops Gemma's padding rows
        "vocab_size": file.tensors["token_embd.weight"].shape[0],
        "hidden_size": hidden,
        "intermediate_size": meta.count("{arch}.feed_forward_length"),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": meta.number("{arch}.attention.layer_norm_rms_epsilon"),
        "max_position_embeddings": meta.count("{arch}.context_length"),
        "rope_theta": meta.number("{arch}.rope.freq_base", family.rope_theta),
        "rope_scaling": _rope_scaling(file, meta, head_dim),
        "tie_word_embeddings": "output.weight" not in file.tensors,  # llama.cpp writes output only when untied
        family.activation[0]: family.activation[1],
    }
    for name in ("bos", "eos", "pad"):
        key = "padding" if name == "pad" else name
        config[f"{name}_token_id"] = _token_id(file, meta, f"tokenizer.ggml.{key}_token_id")
    if family.model_type in ("llama", "qwen3"):  # Qwen2 has q/k/v biases always, and no switch for them
        config["attention_bias"] = "blk.0.attn_q.bias" in file.tensors
    if family.model_type == "llama":
        config["mlp_bias"] = "blk.0.ffn_up.bias" in file.tensors
    if family.model_type == "gemma3_text":
        config.update(_gemma3(file, meta, config))
    if family.model_type == "phi3":
        config.update(_phi3(file, meta, config))
    return config


def _token_id(file: GGUFFile, meta: _Metadata, key: str) -> int | None:
    token = meta.get(key, (int,), -1)
    tokens = file.metadata.get("tokenizer.ggml.tokens")
    if token == -1:
        return None
    if not isinstance(tokens, list) or not 0 <= token < len(tokens):
        raise SpecCompileError(f"{file.path}: GGUF metadata {key!r} is {token}, not a token of its vocabulary")
    return token


def _rope_scaling(file: GGUFFile, meta: _Metadata, head_dim: int) -> dict | None:
    """transformers' rope_scaling from llama.cpp's keys (TextModel.set_gguf_parameters writes them),
    or from Llama 3's rope_freqs tensor, which replaces its scaling parameters."""
    kind = meta.get("{arch}.rope.scaling.type", (str,), "none")
    factor = meta.number("{arch}.rope.scaling.factor", 0.0) or meta.number("{arch}.rope.scale_linear", 0.0)
    if kind == "none" and factor not in (0.0, 1.0):
        kind = "linear"  # older files state only the linear factor
    if kind == "none":
        return _llama3_scaling(file, meta, head_dim) if "rope_freqs.weight" in file.tensors else None
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": factor,
                   "original_max_position_embeddings": meta.count("{arch}.rope.scaling.original_context_length")}
        stated = {"beta_fast": "yarn_beta_fast", "beta_slow": "yarn_beta_slow", "attention_factor": "yarn_attn_factor"}
        for ours, theirs in stated.items():
            if file.metadata.get(f"{meta.arch}.rope.scaling.{theirs}") is not None:
                scaling[ours] = meta.number(f"{{arch}}.rope.scaling.{theirs}")
        return scaling
    if kind == "longrope":
        return None  # Phi-3's factors are tensors (_phi3)
    raise SpecCompileError(f"{file.path}: rope scaling {kind!r} is not supported (supported: linear, yarn, longrope)")


# Llama 3.1-3.3's scaling besides its factor: the only values any release used
LLAMA3_SCALING = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _llama3_scaling(file: GGUFFile, meta: _Metadata, head_dim: int) -> dict | None:
    """The converter (LlamaModel.generate_extra_tensors) turns Llama 3's rope_scaling into one factor per
    frequency: 1 for fast ones, `factor` for slow ones, a blend between. The factor is the largest; the
    rest is checked to be Llama 3's, since the tensor cannot say which band edges made it."""
    factors = _small_vector(file, "rope_freqs.weight", head_dim // 2)
    factor = float(factors.max())
    if factor == 1.0:
        return None
    scaling = {"rope_type": "llama3", "factor": float(str(np.float32(factor))), **LLAMA3_SCALING}
    theta = meta.number("{arch}.rope.freq_base", 10000.0)
    if not np.allclose(_llama3_factors(theta, head_dim, scaling), factors, rtol=1e-5, atol=0):
        raise SpecCompileError(f"{file.path}: rope_freqs.weight is not Llama 3's rope scaling "
                               f"(factor {factor}, {LLAMA3_SCALING}); it is not supported")
    return scaling


def _llama3_factors(theta: float, dim: int, p: dict) -> np.ndarray:
    """What the converter writes into rope_freqs.weight, in its float32 arithmetic."""
    freqs = 1.0 / (np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    wavelen = 2 * math.pi / freqs.astype(np.float64)
    old, low, high = p["original_max_position_embeddings"], p["low_freq_factor"], p["high_freq_factor"]
    smooth = (old / wavelen - low) / (high - low)
    blended = 1 / ((1 - smooth) / p["factor"] + smooth)
    return np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, p["factor"], blended))


def _small_vector(file: GGUFFile, name: str, length: int) -> np.ndarray:
    """A short float tensor that holds settings, read now and checked for its shape."""
    info = file.tensors.get(name)
    if info is None:
        raise SpecCompileError(f"{file.path}: no tensor {name!r} (its rope settings come in a pair)")
    if info.shape != (length,) or info.ggml_type_name not in _FLOATS:
        raise SpecCompileError(f"{file.path}: tensor {name!r} is {info.ggml_type_name}{list(info.shape)}, "
                               f"expected {length} floats")
    return lazy_tensor(file.path, info).load()


def _floats(values: np.ndarray) -> list[float]:
    return [float(str(v)) for v in values.astype(np.float32)]  # shortest decimals, as a config spells them


def _gemma3(file: GGUFFile, meta: _Metadata, config: dict) -> dict:
    """Gemma 3 as llama.cpp runs it (llama-model.cpp, LLM_ARCH_GEMMA3): every 6th layer global, the
    others windowed with their own rope base of 10000 and no scaling; attention scaled by head_dim^-0.5
    except in the 27B (62 layers), which scales by (hidden / heads)^-0.5."""
    layers, window = config["num_hidden_layers"], meta.count("{arch}.attention.sliding_window", 0)
    pattern = file.metadata.get(f"{meta.arch}.attention.sliding_window_pattern", 6)
    if isinstance(pattern, list) and len(pattern) == layers and all(isinstance(p, bool) for p in pattern):
        sliding = pattern  # one flag per layer, as Gemma 3n files write it
    elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0:
        sliding = [(i + 1) % pattern != 0 for i in range(layers)]
    else:
        raise SpecCompileError(f"{file.path}: GGUF metadata sliding_window_pattern {pattern!r} is not understood")
    scalar = config["hidden_size"] // config["num_attention_heads"] if layers == 62 else config["head_dim"]
    extra = {
        "sliding_window": window or None,
        "layer_types": ["sliding_attention" if s and window else "full_attention" for s in sliding],
        "query_pre_attn_scalar": scalar,
        "rope_local_base_freq": meta.number("{arch}.rope.freq_base_swa", 10000.0),
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    }
    if file.metadata.get(f"{meta.arch}.final_logit_softcapping") is not None:
        extra["final_logit_softcapping"] = meta.number("{arch}.final_logit_softcapping")
    return extra


def _phi3(file: GGUFFile, meta: _Metadata, config: dict) -> dict:
    """Phi-3's partial rotary, window and LongRoPE (Phi3MiniModel in convert_hf_to_gguf.py)."""
    head_dim, context = config["head_dim"], config["max_position_embeddings"]
    rotary = meta.count("{arch}.rope.dimension_count", head_dim)
    original = meta.count("{arch}.rope.scaling.original_context_length", context)
    if original < 2:
        raise SpecCompileError(f"{file.path}: GGUF metadata gives an original context of {original} positions")
    extra = {"partial_rotary_factor": rotary / head_dim, "original_max_position_embeddings": original,
             "sliding_window": meta.count("{arch}.attention.sliding_window", 0) or None}  # 0: none (Phi-4)
    if "rope_factors_long.weight" in file.tensors or "rope_factors_short.weight" in file.tensors:
        long, short = (_small_vector(file, f"rope_factors_{kind}.weight", rotary // 2) for kind in ("long", "short"))
        extra["rope_scaling"] = {"rope_type": "longrope", "long_factor": _floats(long), "short_factor": _floats(short)}
        scale = context / original  # the converter's attention factor; HF computes the same one unless told
        default = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        stated = meta.number("{arch}.rope.scaling.attn_factor", default)
        if not math.isclose(stated, default, rel_tol=1e-6):
            extra["rope_scaling"]["attention_factor"] = stated
    return extra


def _eos_token_ids(file: GGUFFile) -> list[int]:
    """Where generation stops: the file's EOS, EOT and EOM ids, and the chat-turn end tokens its
    vocabulary marks as control or user-defined tokens (Gemma's <end_of_turn>, Qwen's <|im_end|>, ...)."""
    meta = _Metadata(file)
    ids = [_token_id(file, meta, f"tokenizer.ggml.{kind}_token_id") for kind in ("eos", "eot", "eom")]
    tokens = file.metadata.get("tokenizer.ggml.tokens")
    types = file.metadata.get("tokenizer.ggml.token_type")
    if isinstance(tokens, list) and isinstance(types, list) and len(types) == len(tokens):
        wanted = set(CHAT_END_TOKENS)
        special = (3, 4)  # gguf.TokenType.CONTROL, USER_DEFINED: tokens matched whole, never spelt out of pieces
        ids += [i for i, (token, kind) in enumerate(zip(tokens, types)) if kind in special and token in wanted]
    return list(dict.fromkeys(i for i in ids if i is not None))
