"""Which ONNX Runtime formulation of a low-bit weight matmul is fastest at the row counts a
speculative loop runs (1 row per decode step, γ+1 per verification, times the batch).

    python -m tools.measure matmul_kernels                    # the 1.1B target's projections
    python -m tools.measure matmul_kernels --rows 1 2 5 8 16 --repeats 15

Each formulation runs one graph holding --layers copies of a TinyLlama-1.1B block's four projections
(QKV 2048x2560, O 2048x2048, gate/up 2048x11264, down 5632x2048), each with its own random weights,
so the weights stream from memory as in a real model rather than sitting in the 32 MiB cache.
Each row: a formulation's median time per block at each row count, and the largest count's cost in
single-row passes.

The formulations:
- `float32`: MatMul on float32 weights (the reference).
- `nbits<b> bs<B> acc<A>`: ONNX Runtime's MatMulNBits with b-bit weights in blocks of B along K,
  one float scale per block, computed in float32 (accuracy_level 0) or with the activations
  quantized to int8 per row and block (accuracy_level 4). Both keep each row's result independent
  of the other rows in the pass.
- `dqmatmul`: DynamicQuantizeMatMul (ONNX Runtime's fused DynamicQuantizeLinear + MatMulInteger +
  scale): int8 weights with one scale per output column, activations quantized to uint8 with one
  scale for the whole [rows, K] input, so a row's numbers depend on the others in its pass.
- `matmulinteger rowwise`: int8 weights per column, activations quantized to int8 with one scale
  per row in the graph (ReduceMax, Div, Round, Cast), MatMulInteger, then both scales: row-independent.
- `matmulinteger u8u8 rowwise`: the same numbers with both operands shifted by 128 into uint8 (zero
  points 128), the `w8a8` precision's formulation (GraphBuilder._matmul_integer). ONNX Runtime's
  u8u8 kernel is exact; its u8s8 one sums pairs of products in 16 bits on AVX2 and saturates.
"""

import logging

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from tools.measure.harness import interleaved
from tools.measure.options import Common
from tools.measure.record import Column, Measured, Spread, Table

COMMON = Common(repeats=11)
log = logging.getLogger(__name__)

BLOCK_SHAPES = {"qkv": (2048, 2560), "o": (2048, 2048), "gate_up": (2048, 11264), "down": (5632, 2048)}
ORT = "com.microsoft"


def _weights(k: int, n: int, rng) -> np.ndarray:
    return (rng.standard_normal((k, n), dtype=np.float32) * 0.02).astype(np.float32)


def _nbits(w: np.ndarray, bits: int, block: int):
    """MatMulNBits' layout: uint8 [N, K/block, block*bits/8], scales [N * K/block], symmetric (default zero point)."""
    k, n = w.shape
    levels = (1 << (bits - 1)) - 1  # 127 or 7
    blocks = w.T.reshape(n, k // block, block)
    scale = np.abs(blocks).max(axis=2) / levels
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    q = np.clip(np.rint(blocks / scale[:, :, None]), -levels - 1, levels).astype(np.int16) + (1 << (bits - 1))
    q = q.astype(np.uint8)
    if bits == 4:
        q = (q[:, :, 0::2] | (q[:, :, 1::2] << 4)).astype(np.uint8)
    return q, scale.reshape(-1)


def _per_column_int8(w: np.ndarray):
    scale = (np.abs(w).max(axis=0) / 127).astype(np.float32)
    return np.clip(np.rint(w / scale), -127, 127).astype(np.int8), scale


class _Graph:
    def __init__(self):
        self.nodes, self.inits, self.count = [], [], 0

    def init(self, name, array):
        self.inits.append(numpy_helper.from_array(array, name))
        return name

    def op(self, op_type, *inputs, domain="", **attrs):
        self.count += 1
        out = f"{op_type}_{self.count}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], domain=domain, **attrs))
        return out


def _matmul(g: _Graph, x: str, w: np.ndarray, kind: str, name: str) -> str:
    k, n = w.shape
    if kind == "float32":
        return g.op("MatMul", x, g.init(name, w))
    if kind.startswith("nbits"):
        bits, block, acc = (int(part[len(tag):]) for part, tag in zip(kind.split()[0:3], ("nbits", "bs", "acc")))
        q, scale = _nbits(w, bits, block)
        return g.op("MatMulNBits", x, g.init(name + "_q", q), g.init(name + "_s", scale), domain=ORT,
                    K=k, N=n, bits=bits, block_size=block, accuracy_level=acc)
    q, scale = _per_column_int8(w)
    if kind == "dqmatmul":
        return g.op("DynamicQuantizeMatMul", x, g.init(name + "_q", q), g.init(name + "_s", scale), domain=ORT)
    if kind == "matmulinteger rowwise":
        row_scale = g.op("Div", g.op("ReduceMax", g.op("Abs", x), g.init(name + "_ax", np.array([-1], np.int64)),
                                     keepdims=1), g.init(name + "_127", np.array(127, np.float32)))
        xq = g.op("Cast", g.op("Round", g.op("Div", x, row_scale)), to=TensorProto.INT8)
        acc = g.op("Cast", g.op("MatMulInteger", xq, g.init(name + "_q", q)), to=TensorProto.FLOAT)
        return g.op("Mul", g.op("Mul", acc, row_scale), g.init(name + "_s", scale))
    if kind == "matmulinteger u8u8 rowwise":
        row_scale = g.op("Div", g.op("ReduceMax", g.op("Abs", x), g.init(name + "_ax", np.array([-1], np.int64)),
                                     keepdims=1), g.init(name + "_127", np.array(127, np.float32)))
        rounded = g.op("Round", g.op("Div", x, row_scale))
        shifted = g.op("Add", rounded, g.init(name + "_128", np.array(128, np.float32)))
        zero = g.init(name + "_zero", np.array(128, np.uint8))
        weights = g.init(name + "_q", (q.astype(np.int16) + 128).astype(np.uint8))
        sums = g.op("MatMulInteger", g.op("Cast", shifted, to=TensorProto.UINT8), weights, zero, zero)
        return g.op("Mul", g.op("Mul", g.op("Cast", sums, to=TensorProto.FLOAT), row_scale), g.init(name + "_s", scale))
    raise ValueError(kind)


def _model(kind: str, layers: int, rng) -> bytes:
    g = _Graph()
    outputs = []
    for layer in range(layers):
        for part, (k, n) in BLOCK_SHAPES.items():
            x = "x_down" if part == "down" else "x"
            outputs.append(g.op("ReduceSum", _matmul(g, x, _weights(k, n, rng), kind, f"l{layer}_{part}"),
                                keepdims=0))
    total = g.op("Sum", *outputs)
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", 2048]),
              helper.make_tensor_value_info("x_down", TensorProto.FLOAT, ["M", 5632])]
    graph = helper.make_graph(g.nodes, kind, inputs, [helper.make_tensor_value_info(total, TensorProto.FLOAT, [])],
                              g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(ORT, 1)],
                              ir_version=10)
    return model.SerializeToString()


def _time(session, rows: int, repeats: int) -> Spread:
    """Seconds per run of the graph at `rows` rows, after one untimed run."""
    feed = {"x": np.random.default_rng(rows).standard_normal((rows, 2048), dtype=np.float32),
            "x_down": np.random.default_rng(rows + 1).standard_normal((rows, 5632), dtype=np.float32)}
    session.run(None, feed)
    [samples] = interleaved({"run": lambda _: session.run(None, feed)}, repeats).values()
    return Spread.of(s.seconds for s in samples)


FORMULATIONS = ["float32", "nbits8 bs32 acc4", "nbits8 bs32 acc0", "nbits8 bs128 acc4", "nbits8 bs128 acc0",
                "nbits4 bs32 acc4", "nbits4 bs32 acc0", "nbits4 bs64 acc4", "nbits4 bs128 acc4", "nbits4 bs128 acc0",
                "dqmatmul", "matmulinteger rowwise", "matmulinteger u8u8 rowwise"]


def add_options(parser) -> None:
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 5, 8])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--only", nargs="*", choices=FORMULATIONS, metavar="FORMULATION",
                        help="formulations to run, each quoted (\"nbits4 bs32 acc4\"); default: all")


def per_block_ms(kind: str, args, rng) -> dict[int, Spread]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    session = ort.InferenceSession(_model(kind, args.layers, rng), options, providers=["CPUExecutionProvider"])
    return {rows: _time(session, rows, args.repeats).scaled(1000 / args.layers) for rows in args.rows}


def run(args) -> Measured:
    rng = np.random.default_rng(0)
    first, last = args.rows[0], args.rows[-1]
    columns = (Column("formulation"), *(Column(f"rows_{m}", "ms", 2, f"M={m}") for m in args.rows),
               Column("ratio", "×", 2, f"M={last} / M={first}"))
    rows = []
    for kind in args.only or FORMULATIONS:
        times = per_block_ms(kind, args, rng)
        log.info(f"{kind:24s} " + "  ".join(f"M={m}: {t.median:6.2f} ms" for m, t in times.items()))
        rows.append({"formulation": kind, **{f"rows_{m}": t for m, t in times.items()},
                     "ratio": times[last].median / times[first].median})
    title = f"ms per 1.1B block (4 projections), medians of {args.repeats}"
    return Measured((Table.of("matmul_kernels", columns, rows, title),))
