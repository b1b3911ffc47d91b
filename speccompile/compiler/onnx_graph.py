"""A small builder over `onnx.helper`: emit nodes by op name, name tensors by scope.

Weights are not embedded in the graphs: each is an external-data initializer pointing into one
weights file per model, so the forward and every verification graph of a model share one copy on
disk (see `WeightFile`).
"""

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from speccompile.bundle import function_copies
from speccompile.compiler.tensors import (
    BFLOAT16,
    INT4,
    Blocks,
    LazyTensor,
    cast,
    materialize,
    nbits_blocks,
    nbits_scales,
    packed_int4,
    quantized_int4,
    quantized_int8,
    stored_nbytes,
)
from speccompile.errors import SpecCompileError

OPSET = 24  # TensorScatter (in-place KV write) needs 24; TensorRT 10.15's parser reads opsets 9..24
IR_VERSION = 10
FLOAT, INT32, INT64, BOOL = TensorProto.FLOAT, TensorProto.INT32, TensorProto.INT64, TensorProto.BOOL
UINT8 = TensorProto.UINT8
WEIGHT_DTYPES = {np.dtype(np.float32): (TensorProto.FLOAT, "<f4"), np.dtype(np.int8): (TensorProto.INT8, "i1"),
                 np.dtype(np.int64): (TensorProto.INT64, "<i8"), np.dtype(np.float16): (TensorProto.FLOAT16, "<f2"),
                 BFLOAT16: (TensorProto.BFLOAT16, BFLOAT16), np.dtype(np.uint8): (TensorProto.UINT8, "u1"),
                 INT4: (TensorProto.INT4, "u1")}  # int4: written packed, two values per byte (packed_int4)
ORT_DOMAIN = "com.microsoft"  # ONNX Runtime's contrib ops
QUANTIZED_KERNELS = ("DequantizeLinear", "MatMulNBits")  # how a graph runs int8/int4 weights (GraphBuilder.matmul)
NBITS_BLOCK = 32  # int8's MatMulNBits blocks (its scales stay per column, as ONNX Runtime's fusion makes them)
# int4's quantization blocks along K: the largest of these that divides K. 128, not Q4_0's 32: on
# 2 AVX-512 cores MatMulNBits (int8 compute) ran a 1.1B block's projections in 0.68-0.81 ms per
# decode step against 0.91-0.93 ms at 32, and 5 rows in 1.13-1.18 ms against 1.68-1.74
# (python -m tools.measure matmul_kernels); docs/performance.md has the table and the agreement each costs.
INT4_BLOCKS = (128, 64, 32, 16)
# How a graph stores its projection and LM-head weights (see GraphBuilder.matmul).
MATMUL_WEIGHTS = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": BFLOAT16,
                  "int8": np.dtype(np.int8), "int4": INT4, "w8a8": np.dtype(np.int8)}
# Precisions whose graphs only ONNX Runtime runs (TensorRT's parser has no MatMulInteger)
ORT_ONLY_WEIGHTS = frozenset({"w8a8"})


class GraphBuilder:
    """Accumulates nodes, inputs, outputs and initializers for one ONNX graph."""

    def __init__(self, name: str, matmul_weights: str = "float32", quantized_kernel: str = "DequantizeLinear"):
        assert matmul_weights in MATMUL_WEIGHTS, f"matmul_weights {matmul_weights!r} not in {MATMUL_WEIGHTS}"
        assert quantized_kernel in QUANTIZED_KERNELS, f"quantized_kernel {quantized_kernel!r} unknown"
        self.name = name
        self.matmul_weights = matmul_weights
        self.quantized_kernel = quantized_kernel
        self.nodes: list[onnx.NodeProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.constants: dict[str, onnx.TensorProto] = {}
        self.weights: dict[str, np.ndarray | LazyTensor] = {}  # name -> what the weights file stores
        self.functions: list[onnx.FunctionProto] = []
        self.domains: dict[str, int] = {}
        self.scope = ""
        self._count = 0
        self._renames: dict[str, str] = {}  # node output -> graph output name (see output())
        self.kept: list[str] = []  # matmul weights kept in their source's blocks (_kept_blocks)

    # -- tensors ------------------------------------------------------------------------------
    def input(self, name: str, elem_type: int, shape: list) -> str:
        """A graph input; asking again for one by its name (several parts read it) returns it."""
        if all(value.name != name for value in self.inputs):
            self.inputs.append(helper.make_tensor_value_info(name, elem_type, shape))
        return name

    def output(self, tensor: str, name: str, elem_type: int, shape: list) -> str:
        """Expose `tensor` as graph output `name`. A node's output is renamed where it is made (at
        `model()`, so later nodes may still consume `tensor`): no Identity runs at inference time.
        Graph inputs, constants and weights go through an Identity."""
        if tensor != name:
            if any(tensor in node.output for node in self.nodes):
                self._renames[tensor] = name
            else:
                self.nodes.append(helper.make_node("Identity", [tensor], [name], name=f"{name}/Identity"))
        self.outputs.append(helper.make_tensor_value_info(name, elem_type, shape))
        return name

    def weight(self, name: str, array: np.ndarray | LazyTensor) -> str:
        assert array.dtype in WEIGHT_DTYPES, f"weight {name} is {array.dtype}, expected one of {list(WEIGHT_DTYPES)}"
        self.weights[name] = array
        return name

    def matmul(self, x: str, name: str, weight: np.ndarray | LazyTensor, shared: bool = False,
               rank: int | None = None) -> str:
        """x @ weight [K, N] (fp32 compute), with the weight stored as this graph's `matmul_weights` say.
        (`shared`: see BranchBuilder.matmul. `rank`: x's, where the caller knows it; see _block_offsets.)

        float16 / bfloat16: stored at half the bytes and cast to fp32 in the graph. ONNX Runtime's
        CPU provider folds that cast when it loads the graph, so this saves disk, not memory.
        int8: symmetric per-output-column scales (tensors.quantized_int8) and DequantizeLinear(q, s)
        feeding the MatMul. That is the standard weight-only pattern: ONNX Runtime fuses it into
        MatMulNBits (a quarter of the fp32 bytes a GEMV streams); TensorRT's parser reads it as
        explicit quantization.
        int4: symmetric blocks of 128 along K (INT4_BLOCKS; tensors.quantized_int4) and ONNX's blocked
        DequantizeLinear (int4, axis 0) feeding the MatMul: ONNX Runtime fuses it into MatMulNBits
        (4 bits), TensorRT reads it as int4 weight-only block quantization.
        A graph built with quantized_kernel="MatMulNBits" (session graphs) runs both on MatMulNBits
        directly, with the same numbers (_matmul_nbits).
        w8a8: int8 weights as int8's, and the activations quantized to int8 per token (_matmul_integer),
        in every graph alike (one layout on disk). ONNX Runtime only.
        """
        blocks = getattr(weight, "blocks", None)
        if blocks is not None and blocks.axis == 0:
            return self._kept_blocks(x, name, blocks, rank)
        stored = self.matmul_weights
        if stored == "float32":
            return self.op("MatMul", x, self.weight(name, weight))
        if stored in ("float16", "bfloat16"):
            half = self.weight(f"{name}_{stored}", cast(_lazy(weight), MATMUL_WEIGHTS[stored]))
            return self.op("MatMul", x, self.op("Cast", half, to=FLOAT))
        k = weight.shape[0]
        if stored == "w8a8":
            return self._matmul_integer(x, name, *quantized_int8(_lazy(weight)))
        if stored == "int4":
            block = next((b for b in INT4_BLOCKS if k % b == 0), None)
            if block is None:
                raise SpecCompileError(f"{name}: int4 weights are quantized in blocks of {INT4_BLOCKS[-1]} or more "
                                       f"along the input dimension, which is {k} here; use --target-weights/"
                                       f"--draft-weights int8")
            quantized, scale = quantized_int4(_lazy(weight), block)
            axis, attrs = 0, {"block_size": block}
        else:
            block = NBITS_BLOCK
            quantized, scale = quantized_int8(_lazy(weight))
            axis, attrs = 1, {}
        if self.quantized_kernel == "MatMulNBits" and k % block == 0:
            return self._matmul_nbits(x, name, quantized, scale, block)
        dequantized = self.op("DequantizeLinear", self.weight(name + "_q", quantized),
                              self.weight(name + "_scale", scale), axis=axis, **attrs)
        return self.op("MatMul", x, dequantized)

    def _kept_blocks(self, x: str, name: str, blocks: Blocks, rank: int | None = None) -> str:
        """A weight kept in its source's own blocks (a GGUF's, along K): the same integers, scales and
        minimums whatever `matmul_weights` says, so the graph computes with the file's numbers.
        Blocked DequantizeLinear feeding the MatMul (ONNX Runtime fuses it), or MatMulNBits directly
        where the graph runs it; blocks with a minimum add its product with each block's sum of x
        (_block_offsets)."""
        self.kept.append(name)
        if self.quantized_kernel == "MatMulNBits":
            y = self._matmul_nbits(x, name, blocks.q, blocks.scale, blocks.block)
        else:
            dequantized = self.op("DequantizeLinear", self.weight(name + "_q", blocks.q),
                                  self.weight(name + "_scale", blocks.scale), axis=0, block_size=blocks.block)
            y = self.op("MatMul", x, dequantized)
        return y if blocks.offset is None else self.op("Add", y, self._block_offsets(x, name, blocks, rank))

    def _block_offsets(self, x: str, name: str, blocks: Blocks, rank: int | None = None) -> str:
        """x @ W for W = scale × q + offset splits into x @ (scale × q), which the integer kernels
        compute, and Σ_blocks (Σ_{k in block} x_k) × offset: each block's sum of x [.., K / block]
        times the offsets [K / block, N], a float MatMul 1/block the size of the weight. Why not
        MatMulNBits' zero points: they are integers, where a Q4_K or Q4_1 minimum is any float; its
        float zero points run a dequantizing fallback (45 ms for a 2048 × 5632 int4 weight against
        0.4 ms). Where the caller knows x's rank (a transformer layer's [B, T, K]) the split into blocks
        is a constant shape; otherwise it is computed from x's (two more ops a matrix: on a Q4_K_M
        1.1B target the minimums' small ops were 7% of a step)."""
        k = blocks.q.shape[0]
        per_block_shape = [k // blocks.block, blocks.block]
        if rank is not None:
            shape = self.const([0] * (rank - 1) + per_block_shape)
        else:
            shape = self.op("Concat", self.op("Shape", x, end=-1), self.const(per_block_shape), axis=0)
        per_block = self.op("Reshape", x, shape)
        sums = self.op("ReduceSum", per_block, self.const([-1]), keepdims=0)
        return self.op("MatMul", sums, self.weight(name + "_offset", blocks.offset))

    def _matmul_nbits(self, x: str, name: str, quantized: LazyTensor, scale: LazyTensor, block: int) -> str:
        """The same int8 or int4 weights as ONNX Runtime's MatMulNBits takes them, for graphs only
        ONNX Runtime runs (session graphs). Why not DequantizeLinear -> MatMul, which ONNX Runtime
        fuses into this very kernel: the fusion keeps the fused weights beside the packed ones (1.1B
        int8 target: 2.49 GB RSS for 1.72 GB of weights). Block size and accuracy level are the
        fusion's (int8: 32; int4: the quantization's; int8 compute: activations rounded to int8 per
        row and block), so the numbers are the per-kind graphs' exactly."""
        k, n = quantized.shape
        bits = 4 if quantized.dtype == INT4 else 8
        self.domains[ORT_DOMAIN] = 1
        blocks = self.weight(name + "_nbits", nbits_blocks(quantized, block))
        scales = self.weight(name + "_nbits_scale", nbits_scales(scale, k // block))
        return self.op("MatMulNBits", x, blocks, scales, domain=ORT_DOMAIN, K=k, N=n, bits=bits,
                       block_size=block, accuracy_level=4)

    def _matmul_integer(self, x: str, name: str, quantized: LazyTensor, scale: LazyTensor) -> str:
        """x @ (q * s) with x quantized per token: a = round(x / r) with r = max|x| / 127 over the
        token's K features (vLLM's W8A8 dynamic per-token scheme), both a and q shifted by 128 into
        uint8, then MatMulInteger (exact int32 sums) and the two scales: y = (a @ q) * r * s.
        Why: ONNX Runtime's int8-compute MatMulNBits costs 2.2x one row for the 5 rows of a γ=4
        verification on an AVX2 host, MatMulInteger's u8u8 kernel 1.3x, at the same one-row time
        (`python -m tools.measure matmul_kernels`). Why u8u8: its u8s8 kernel sums pairs of products
        in 16 bits on AVX2 and saturates. A token's numbers depend on its own features only, so a
        verification's projections compute what a decode step's do. The price: one scale per token where
        MatMulNBits keeps one per 32 features, coarser where a few features are large."""
        peak = self.op("ReduceMax", self.op("Abs", x), self.const([-1]), keepdims=1)
        row_scale = self.op("Div", self.op("Max", peak, self.const(1e-30, np.float32)), self.const(127.0, np.float32))
        shifted = self.op("Add", self.op("Round", self.op("Div", x, row_scale)), self.const(128.0, np.float32))
        offset = LazyTensor(quantized.shape, np.dtype(np.uint8),
                            lambda: (quantized.load().astype(np.int16) + 128).astype(np.uint8))
        zero = self.const(128, np.uint8)
        sums = self.op("MatMulInteger", self.op("Cast", shifted, to=onnx.TensorProto.UINT8),
                       self.weight(name + "_u8", offset), zero, zero)
        scaled = self.op("Mul", self.op("Cast", sums, to=FLOAT), row_scale)
        return self.op("Mul", scaled, self.weight(name + "_scale", scale))

    def const(self, value, dtype=np.int64) -> str:
        """A small constant (shape, axes, scalar) stored inline in the graph."""
        array = np.asarray(value, dtype=dtype)
        key = f"const_{array.dtype}_{'x'.join(map(str, array.shape))}_{'_'.join(map(str, array.ravel().tolist()))}"
        key = key.replace("-", "m").replace(".", "p")
        if key not in self.constants:
            self.constants[key] = numpy_helper.from_array(array, key)
        return key

    # -- nodes --------------------------------------------------------------------------------
    def op(self, op_type: str, *inputs: str, outputs: int = 1, domain: str = "", out=None, node: str | None = None,
           **attrs):
        """Add one node; returns its output name (or list of names when outputs > 1).

        `out` names the output(s) explicitly (e.g. graph outputs, to avoid an Identity). `node` names
        the node instead of the running count, which it leaves as it is: a node made only on request
        (an optional output) then renames none of the others.
        """
        if node is None:
            self._count += 1
        node_name = node or f"{self.scope}{op_type}_{self._count}"
        names = [f"{node_name}/out{k}" if outputs > 1 else f"{node_name}/out" for k in range(outputs)]
        if out is not None:
            names = [out] if isinstance(out, str) else list(out)
            assert len(names) == outputs, f"{op_type}: {outputs} outputs, {len(names)} names"
        self.nodes.append(helper.make_node(op_type, list(inputs), names, name=node_name, domain=domain, **attrs))
        return names if outputs > 1 else names[0]

    def graph_nodes(self) -> list[onnx.NodeProto]:
        """The nodes as the model holds them (graph outputs renamed where they are made)."""
        return [self._renamed(node) for node in self.nodes]

    def _renamed(self, node: onnx.NodeProto) -> onnx.NodeProto:
        """The node with renamed tensors, in an If's branches too (they read outer names)."""
        if not self._renames or not _names_in(node) & self._renames.keys():
            return node
        node = onnx.NodeProto.FromString(node.SerializeToString())
        _rename(node, self._renames)
        return node

    def add_function(self, function: onnx.FunctionProto) -> None:
        self.functions.append(function)
        self.domains[function.domain] = 1

    def branch(self, label: str) -> "BranchBuilder":
        """A builder for one branch of an If node of this graph (see BranchBuilder)."""
        return BranchBuilder(self, label)

    # -- model --------------------------------------------------------------------------------
    def model(self, weight_locations: dict[str, tuple[str, int, int]]) -> onnx.ModelProto:
        """The ModelProto, with weights referencing (file, offset, length) in `weight_locations`."""
        initializers = list(self.constants.values())
        for name, array in self.weights.items():
            initializers.append(_external_tensor(name, array, *weight_locations[name]))
        graph = helper.make_graph(self.graph_nodes(), self.name, self.inputs, self.outputs, initializers)
        opsets = [helper.make_opsetid("", OPSET)] + [helper.make_opsetid(d, v) for d, v in self.domains.items()]
        model = helper.make_model(graph, opset_imports=opsets, functions=self.functions, producer_name="speccompile")
        model.ir_version = IR_VERSION
        return model


def _names_in(node: onnx.NodeProto) -> set[str]:
    """Every tensor a node reads or writes, its subgraphs' included."""
    names = {*node.input, *node.output}
    for attribute in node.attribute:
        if attribute.type == onnx.AttributeProto.GRAPH:
            for inner in attribute.g.node:
                names |= _names_in(inner)
    return names


def _rename(node: onnx.NodeProto, renames: dict[str, str]) -> None:
    for field in (node.input, node.output):
        for k, tensor in enumerate(field):
            field[k] = renames.get(tensor, tensor)
    for attribute in node.attribute:
        if attribute.type == onnx.AttributeProto.GRAPH:
            for inner in attribute.g.node:
                _rename(inner, renames)
            for value in attribute.g.output:
                value.name = renames.get(value.name, value.name)


class BranchBuilder(GraphBuilder):
    """The body of an If branch: its nodes are its own, everything else belongs to the outer graph.

    Inputs, constants, weights and functions are registered in the outer graph (a branch reads
    outer-scope values by name); the tensors it makes are prefixed with its scope, so that they never
    shadow an outer name; `output` records what the branch yields instead of adding a graph output.
    A function the outer graph already has under the same name with another body (SpecAccept's greedy
    and sampling forms) is added under a numbered name, and this branch's calls use that name.
    """

    def __init__(self, parent: GraphBuilder, label: str):
        super().__init__(f"{parent.name}/{parent.scope}{label}", parent.matmul_weights, parent.quantized_kernel)
        self.parent, self.scope = parent, f"{parent.scope}{label}/"
        self.domains = parent.domains
        self.yields: dict[str, str] = {}  # output name -> tensor of this branch
        self._functions: dict[tuple[str, str], str] = {}

    def input(self, name: str, elem_type: int, shape: list) -> str:
        if all(value.name != name for value in self.parent.inputs):
            self.parent.input(name, elem_type, shape)
        return name

    def output(self, tensor: str, name: str, elem_type: int, shape: list) -> str:
        self.yields[name] = tensor
        return name

    def const(self, value, dtype=np.int64) -> str:
        return self.parent.const(value, dtype)

    def weight(self, name: str, array) -> str:
        return self.parent.weight(name, array)

    def matmul(self, x: str, name: str, weight, shared: bool = False, rank: int | None = None) -> str:
        """Only `shared`: a weight the main body multiplies too, read again here (the LM head, for
        Medusa heads). A branch's own weight would not be pre-packed by ONNX Runtime."""
        assert shared, f"{name}: weights are read in the outer graph (ONNX Runtime pre-packs only those)"
        return super().matmul(x, name, weight, rank=rank)

    def op(self, op_type: str, *inputs: str, outputs: int = 1, domain: str = "", out=None, **attrs):
        if out is not None:
            out = self.scope + out if isinstance(out, str) else [self.scope + name for name in out]
        op_type = self._functions.get((domain, op_type), op_type)
        return super().op(op_type, *inputs, outputs=outputs, domain=domain, out=out, **attrs)

    def add_function(self, function: onnx.FunctionProto) -> None:
        existing = {f.name: f for f in self.parent.functions if f.domain == function.domain}
        for name in function_copies(function.name):
            named = onnx.FunctionProto.FromString(function.SerializeToString())
            named.name = name
            if name not in existing:
                self.parent.add_function(named)
            if existing.get(name, named) == named:  # added now, or the same definition already there
                break
        self._functions[function.domain, function.name] = name

    def graph(self, outputs: list[tuple[str, int]]) -> onnx.GraphProto:
        """The branch as an If attribute yielding `outputs` ((tensor of this branch, element type)), in order."""
        values = [helper.make_tensor_value_info(tensor, elem_type, None) for tensor, elem_type in outputs]
        return helper.make_graph(self.graph_nodes(), self.name, [], values)


def _external_tensor(name: str, array: np.ndarray, location: str, offset: int, length: int) -> onnx.TensorProto:
    tensor = onnx.TensorProto(name=name, data_type=WEIGHT_DTYPES[array.dtype][0], dims=list(array.shape))
    tensor.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        tensor.external_data.add(key=key, value=value)
    return tensor


def _lazy(array: np.ndarray | LazyTensor) -> LazyTensor:
    return array if isinstance(array, LazyTensor) else LazyTensor(array.shape, array.dtype, lambda: array)


class WeightFile:
    """Lays out a model's weights in one raw little-endian file, 64-byte aligned (mmap-friendly).

    The layout needs only shapes and dtypes; `write` then materialises one weight at a time (lazy
    tensors read from the checkpoint), so the bytes of the whole model are never in memory at once.
    """

    ALIGN = 64

    def __init__(self, filename: str):
        self.filename = filename
        self.locations: dict[str, tuple[str, int, int]] = {}
        self._tensors: list[tuple[int, np.ndarray | LazyTensor]] = []
        self.size = 0

    def add(self, weights: dict[str, np.ndarray | LazyTensor]) -> None:
        for name, array in weights.items():
            nbytes = stored_nbytes(array)
            if name in self.locations:  # shared by several graphs of the model
                assert self.locations[name][2] == nbytes, f"two different weights named {name}"
                continue
            offset = -(-self.size // self.ALIGN) * self.ALIGN
            self.locations[name] = (self.filename, offset, nbytes)
            self._tensors.append((offset, array))
            self.size = offset + nbytes

    def write(self, path) -> None:
        with open(path, "wb") as f:
            for offset, tensor in self._tensors:
                f.seek(offset)
                array = materialize(tensor)
                if array.dtype == INT4:
                    array = packed_int4(array)
                np.ascontiguousarray(array, dtype=WEIGHT_DTYPES[array.dtype][1]).tofile(f)
                del array  # before the next one is read: one tensor in memory at a time


class FunctionBuilder:
    """Builds the body of an ONNX model-local function (constants become Constant nodes)."""

    def __init__(self, domain: str, name: str, inputs: list[str], attributes: list[str]):
        self.domain, self.name, self.inputs, self.attributes = domain, name, inputs, attributes
        self.nodes: list[onnx.NodeProto] = []
        self._count = 0

    def const(self, value, dtype=np.int64) -> str:
        self._count += 1
        out = f"c{self._count}"
        tensor = numpy_helper.from_array(np.asarray(value, dtype=dtype), out)
        self.nodes.append(helper.make_node("Constant", [], [out], value=tensor))
        return out

    def op(self, op_type: str, *inputs: str, outputs: int = 1, out=None, domain: str = "", **attrs):
        self._count += 1
        if out is None:
            names = [f"{op_type.lower()}{self._count}_{k}" for k in range(outputs)]
        else:
            names = [out] if isinstance(out, str) else list(out)
        self.nodes.append(helper.make_node(op_type, list(inputs), names, domain=domain, **attrs))
        return names if outputs > 1 else names[0]

    def function(self, outputs: list[str], opset: int,
                 extra_opsets: dict[str, int] | None = None) -> onnx.FunctionProto:
        opsets = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, v) for d, v in (extra_opsets or {}).items()]
        return helper.make_function(self.domain, self.name, self.inputs, outputs, self.nodes, opset_imports=opsets,
                                    attributes=self.attributes)
