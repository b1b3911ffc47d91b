"""Weights as recipes: read from the checkpoint only when the bundle writer needs their bytes.

Why: a build used to hold every weight in memory as fp32, several times over (the checkpoint's
tensors, their canonical layout, and each graph's fused QKV and gate/up copies), so its peak memory
grew with the model times the number of graphs: about 6× the fp32 weights. A `LazyTensor` knows its
shape and dtype without reading anything, which is all the graph builder needs; `WeightFile.write`
materialises one weight at a time, writes it and drops it. Peak memory is then a small multiple of
the largest single tensor (an embedding or LM head), whatever the size of the model.

Safetensors are read here with no dependency beyond numpy (and ml_dtypes, which onnx already
needs, for bfloat16): an 8-byte header length, a JSON header of (dtype, shape, byte range) per
tensor, then the raw little-endian data. Each tensor is read with one positioned read into a fresh
buffer, not memory-mapped: mapped pages of a multi-GB shard would count towards the process's
resident memory until unmapped.
"""

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np

from speccompile.errors import SpecCompileError, read_safetensors_header

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
INT4 = np.dtype(ml_dtypes.int4)  # one value per byte in memory; two per byte on disk (stored_nbytes, packed_int4)
SAFETENSORS_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": BFLOAT16}


@dataclass(frozen=True, eq=False)
class Blocks:
    """A weight kept in the block-quantized form its source stored it in (a GGUF's blocks along the
    input dimension): value = scale × q + offset, q the integers (int8, or INT4 for 4 bits) in the
    tensor's own shape, scale and offset [..] that shape with the blocked axis divided by `block`.
    offset is None for symmetric formats (Q8_0, Q4_0, Q5_0, Q6_K) and holds each block's value at
    q = 0 for those with a minimum (Q4_1, Q5_1, Q4_K, Q5_K). The LazyTensor that carries it loads the
    dequantized float32 values."""

    q: "LazyTensor"
    scale: "LazyTensor"
    axis: int  # the axis cut into blocks (the input dimension)
    block: int
    offset: "LazyTensor | None" = None

    @property
    def bits(self) -> int:
        return 4 if self.q.dtype == INT4 else 8

    def mapped(self, change: Callable[["LazyTensor"], "LazyTensor"], axis: int | None = None) -> "Blocks":
        """The same blocks with `change` applied to q, scale and offset alike (rows taken, transposed...)."""
        offset = None if self.offset is None else change(self.offset)
        return Blocks(change(self.q), change(self.scale), self.axis if axis is None else axis, self.block, offset)


@dataclass(frozen=True, eq=False)
class LazyTensor:
    """An array known by shape and dtype, produced by `load()` when its bytes are needed."""

    shape: tuple[int, ...]
    dtype: np.dtype
    make: Callable[[], np.ndarray] = field(repr=False)
    blocks: Blocks | None = field(default=None, repr=False)  # its source's own quantized form, where kept

    def load(self) -> np.ndarray:
        array = self.make()
        assert array.shape == self.shape and array.dtype == self.dtype, \
            f"lazy tensor made {array.dtype}{list(array.shape)}, promised {self.dtype}{list(self.shape)}"
        return array

    def __array__(self, dtype=None, copy=None):  # np.asarray(lazy) works, e.g. in tests
        array = self.load()
        return array if dtype is None else array.astype(dtype)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return stored_nbytes(self)

    @property
    def ndim(self) -> int:
        return len(self.shape)


def materialize(tensor) -> np.ndarray:
    return tensor.load() if isinstance(tensor, LazyTensor) else tensor


def stored_nbytes(tensor) -> int:
    """Bytes a tensor takes in a weights file: int4 packs two values per byte, as ONNX stores it."""
    size = math.prod(tensor.shape)
    return (size + 1) // 2 if tensor.dtype == INT4 else size * tensor.dtype.itemsize


def packed_int4(array: np.ndarray) -> np.ndarray:
    """ONNX's INT4 bytes of `array` (row-major): element 2i in the low nibble of byte i, 2i+1 in the high."""
    nibbles = (array.reshape(-1).astype(np.int8) & 0xF).astype(np.uint8)
    if nibbles.size % 2:
        nibbles = np.append(nibbles, np.uint8(0))
    return nibbles[0::2] | (nibbles[1::2] << 4)


# ---------------------------------------------------------------------------------------------
# safetensors


def safetensors_tensors(file: Path) -> dict[str, LazyTensor]:
    """Every tensor of one safetensors file, as float32 lazy tensors; only the header is read now.
    A malformed header or a byte range outside the file is a SpecCompileError here, not at write."""
    header, data_start = read_safetensors_header(file)
    size = file.stat().st_size
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise SpecCompileError(f"{file}: cannot read safetensors file (bad header entry {name!r}: {e})") from None
        if dtype not in SAFETENSORS_DTYPES:
            supported = ", ".join(SAFETENSORS_DTYPES)
            raise SpecCompileError(f"{file}: tensor {name} has dtype {dtype}; supported: {supported}")
        stored = SAFETENSORS_DTYPES[dtype]
        if end - begin != math.prod(shape) * stored.itemsize or data_start + end > size or begin < 0:
            raise SpecCompileError(f"{file}: cannot read safetensors file (tensor {name} lies outside the file)")
        read = functools.partial(_read_tensor, file, data_start + begin, stored, shape)
        tensors[name] = LazyTensor(shape, np.dtype(np.float32), read)
    return tensors


def _read_tensor(file: Path, offset: int, stored: np.dtype, shape: tuple) -> np.ndarray:
    with open(file, "rb") as f:
        f.seek(offset)
        array = np.fromfile(f, dtype=stored, count=math.prod(shape)).reshape(shape)
    return array.astype(np.float32, copy=False)


# ---------------------------------------------------------------------------------------------
# transforms: each returns a new lazy tensor; nothing is read until the result is loaded


def transposed(t: LazyTensor) -> LazyTensor:
    assert t.ndim == 2, f"transpose of a {t.ndim}-d tensor"
    blocks = t.blocks and t.blocks.mapped(transposed, axis=1 - t.blocks.axis)
    return LazyTensor(t.shape[::-1], t.dtype, lambda: np.ascontiguousarray(t.load().T), blocks)


def split_part(t: LazyTensor, parts: int, index: int) -> LazyTensor:
    """Part `index` of `parts` equal slices along the last axis (GPT-2's fused c_attn)."""
    shape = (*t.shape[:-1], t.shape[-1] // parts)
    return LazyTensor(shape, t.dtype, lambda: np.ascontiguousarray(np.split(t.load(), parts, axis=-1)[index]))


def rows(t: LazyTensor, begin: int, end: int) -> LazyTensor:
    """Rows begin..end of a 2-d tensor (one projection of a fused nn.Linear, stored [out, in]);
    kept blocks along the other axis stay whole."""
    blocks = t.blocks
    if blocks is not None:
        assert blocks.axis == 1, "rows of a tensor blocked along its rows"
        blocks = blocks.mapped(lambda part: rows(part, begin, end))
    return LazyTensor((end - begin, *t.shape[1:]), t.dtype, lambda: np.ascontiguousarray(t.load()[begin:end]), blocks)


def rows_permuted(t: LazyTensor, order: np.ndarray) -> LazyTensor:
    """Row i of the result is row order[i] of t (llama.cpp's q/k row order undone); kept blocks,
    along the other axis, move whole."""
    blocks = t.blocks
    if blocks is not None:
        assert blocks.axis == 1, "row permutation of a tensor blocked along its rows"
        blocks = blocks.mapped(lambda part: rows_permuted(part, order))
    return LazyTensor(t.shape, t.dtype, lambda: np.ascontiguousarray(t.load()[order]), blocks)


def shifted(t: LazyTensor, by: float) -> LazyTensor:
    """t + by in float32: Gemma's RMSNorm scales by 1 + w (by=1), which llama.cpp's converter stores
    as such (read back with by=-1)."""
    return LazyTensor(t.shape, t.dtype, lambda: t.load() + np.float32(by))


def concatenated(tensors: list, axis: int = -1) -> LazyTensor:
    """Side by side along `axis` (fused QKV and gate/up projections, their biases); kept blocks
    stay kept when every part has them along another axis."""
    first = tensors[0]
    axis = axis % first.ndim
    shape = list(first.shape)
    shape[axis] = sum(t.shape[axis] for t in tensors)
    blocks = None
    parts = [getattr(t, "blocks", None) for t in tensors]
    if all(parts) and len({(b.axis, b.block, b.bits) for b in parts}) == 1 and parts[0].axis != axis:
        offsets = None
        if any(b.offset is not None for b in parts):  # symmetric parts beside asymmetric ones: offsets of 0
            offsets = concatenated([b.offset if b.offset is not None else zeros(b.scale) for b in parts], axis)
        blocks = Blocks(concatenated([b.q for b in parts], axis), concatenated([b.scale for b in parts], axis),
                        parts[0].axis, parts[0].block, offsets)
    return LazyTensor(tuple(shape), first.dtype, lambda: np.concatenate([materialize(t) for t in tensors], axis=axis),
                      blocks)


def columns(t: LazyTensor, ids) -> LazyTensor:
    """The columns `ids` (an index array or a slice) of a 2-d tensor: an LM head cut to a vocabulary."""
    count = len(range(*ids.indices(t.shape[1]))) if isinstance(ids, slice) else len(ids)
    blocks = t.blocks
    if blocks is not None and blocks.axis == 0:
        blocks = blocks.mapped(lambda part: columns(part, ids))
    elif blocks is not None:
        blocks = None  # columns cut through blocks: the float values go on alone
    return LazyTensor((t.shape[0], count), t.dtype, lambda: np.ascontiguousarray(t.load()[:, ids]), blocks)


def zeros(like: LazyTensor) -> LazyTensor:
    return LazyTensor(like.shape, like.dtype, lambda: np.zeros(like.shape, like.dtype))


def cast(t: LazyTensor, dtype) -> LazyTensor:
    dtype = np.dtype(dtype)
    return t if dtype == t.dtype else LazyTensor(t.shape, dtype, lambda: t.load().astype(dtype))


def quantized_int8(t: LazyTensor) -> tuple[LazyTensor, LazyTensor]:
    """Symmetric per-output-column int8 of a [K, N] weight: q = round(W / s), s = max_k |W[k, n]| / 127.
    Returns (q int8 [K, N], s float32 [N]), made by one quantization that is held only until both
    have been loaded."""
    pair = SharedResult(lambda: _quantize_columns(t.load()), parts=2)
    k, n = t.shape
    return (LazyTensor((k, n), np.dtype(np.int8), lambda: pair.take(0)),
            LazyTensor((n,), np.dtype(np.float32), lambda: pair.take(1)))


def quantized_int4(t: LazyTensor, block: int) -> tuple[LazyTensor, LazyTensor]:
    """Symmetric blockwise int4 of a [K, N] weight, like llama.cpp's Q4_0 and ONNX Runtime's
    MatMulNBits: each column is cut into K / block blocks along K, each with its own scale
    s = max |W| / 7 over the block, and q = clip(round(W / s), -8, 7). Returns (q int4 [K, N],
    s float32 [K / block, N]): the layout of ONNX's blocked DequantizeLinear (axis 0)."""
    k, n = t.shape
    assert k % block == 0, f"int4 blocks of {block} do not tile K={k}"
    pair = SharedResult(lambda: _quantize_blocks(t.load(), block), parts=2)
    return (LazyTensor((k, n), INT4, lambda: pair.take(0)),
            LazyTensor((k // block, n), np.dtype(np.float32), lambda: pair.take(1)))


EMBEDDING_BLOCK = 32  # Q8_0's blocks: a table in int8 blocks costs 1.125 bytes a value


def embedding_in_int8_blocks(table: LazyTensor, block: int = EMBEDDING_BLOCK) -> LazyTensor:
    """A token embedding [V, H] as symmetric int8 blocks of `block` along H (llama.cpp's Q8_0 layout,
    float32 scales), which the graphs gather as integers and scale after the gather
    (transformer._embedding): 3.6x fewer bytes than float32 on disk and in memory, where only a few
    rows are ever read per step. Its load() gives the dequantized values, which is what the graphs
    compute with. A table kept in its source's blocks along H (a GGUF's) stays as it is; one whose H
    does not divide into blocks stays float32."""
    if table.blocks is not None and table.blocks.axis == 1:
        return table
    vocab, hidden = table.shape
    if hidden % block:
        return table
    pair = SharedResult(lambda: _quantize_rows(table.load(), block), parts=2)
    q = LazyTensor((vocab, hidden), np.dtype(np.int8), lambda: pair.take(0))
    scale = LazyTensor((vocab, hidden // block), np.dtype(np.float32), lambda: pair.take(1))

    def dequantized() -> np.ndarray:
        return (q.load().reshape(vocab, -1, block) * scale.load()[:, :, None]).reshape(vocab, hidden)

    return LazyTensor((vocab, hidden), np.dtype(np.float32), dequantized, blocks=Blocks(q, scale, axis=1, block=block))


def nbits_blocks(q: LazyTensor, block: int) -> LazyTensor:
    """int8 or int4 q [K, N] in ONNX Runtime's MatMulNBits layout: uint8 [N, K / block, block * bits / 8],
    one row per output column, stored as q + 2^(bits-1) (the kernel's default zero point); 4-bit
    values two to a byte, the first in the low nibble."""
    k, n = q.shape
    bits = 4 if q.dtype == INT4 else 8
    shape = (n, k // block, block * bits // 8)

    def make():
        unsigned = (q.load().T.astype(np.int16) + (1 << (bits - 1))).astype(np.uint8).reshape(n, k // block, block)
        return unsigned if bits == 8 else unsigned[:, :, 0::2] | (unsigned[:, :, 1::2] << 4)

    return LazyTensor(shape, np.dtype(np.uint8), make)


def nbits_scales(scale: LazyTensor, blocks: int) -> LazyTensor:
    """MatMulNBits' scales [N * K / block], column after column. From one scale per column [N] (int8's
    portable layout), each repeated once per block: the same quantization; from blockwise scales
    [K / block, N] (int4's), transposed."""
    if scale.ndim == 2:
        return LazyTensor((scale.size,), np.dtype(np.float32), lambda: np.ascontiguousarray(scale.load().T).ravel())
    (n,) = scale.shape
    return LazyTensor((n * blocks,), np.dtype(np.float32), lambda: np.repeat(scale.load(), blocks))


class SharedResult:
    """A tuple computed on the first take and released once every part has been taken."""

    def __init__(self, make: Callable[[], tuple], parts: int):
        self.make, self.parts, self.value, self.taken = make, parts, None, set()

    def take(self, index: int):
        if self.value is None:
            self.value = self.make()
        part = self.value[index]
        self.taken.add(index)
        if len(self.taken) == self.parts:
            self.value, self.taken = None, set()
        return part


def _symmetric(values: np.ndarray, axis: int, low: int, high: int) -> tuple[np.ndarray, np.ndarray]:
    """q = clip(round(values / s), low, high) with s = max |values| / high along `axis` (1 where they are
    all zero): (q int8 in values' shape, s float32 without that axis)."""
    scale = np.abs(values).max(axis=axis) / float(high)
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    return np.clip(np.rint(values / np.expand_dims(scale, axis)), low, high).astype(np.int8), scale


def _quantize_blocks(weight: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    k, n = weight.shape
    q, scale = _symmetric(weight.reshape(k // block, block, n), 1, -8, 7)
    return q.reshape(k, n).astype(INT4), scale


def _quantize_rows(table: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    vocab, hidden = table.shape
    q, scale = _symmetric(table.reshape(vocab, hidden // block, block), 2, -127, 127)
    return q.reshape(vocab, hidden), scale


def _quantize_columns(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return _symmetric(weight, 0, -127, 127)
