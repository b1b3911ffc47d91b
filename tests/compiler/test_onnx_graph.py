"""GraphBuilder: matmul weights (float32 as they are, int8 as DequantizeLinear(q, scale) -> MatMul),
graph outputs, and the weights file."""

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto

from speccompile.compiler.onnx_graph import FLOAT, GraphBuilder, WeightFile


def run_matmul(weight: np.ndarray, x: np.ndarray, matmul_weights: str, tmp_path,
               quantized_kernel: str = "DequantizeLinear") -> np.ndarray:
    g = GraphBuilder("m", matmul_weights, quantized_kernel)
    y = g.matmul(g.input("x", FLOAT, list(x.shape)), "w", weight)
    g.output(y, "y", FLOAT, [x.shape[0], weight.shape[1]])
    weights = WeightFile("w.bin")
    weights.add(g.weights)
    weights.write(tmp_path / "w.bin")
    model = g.model(weights.locations)
    (tmp_path / "m.onnx").write_bytes(model.SerializeToString())
    return ort.InferenceSession(str(tmp_path / "m.onnx")).run(None, {"x": x})[0]


def test_float32_matmul_is_exact(tmp_path):
    rng = np.random.default_rng(0)
    w, x = rng.standard_normal((32, 48)).astype(np.float32), rng.standard_normal((3, 32)).astype(np.float32)
    np.testing.assert_allclose(run_matmul(w, x, "float32", tmp_path), x @ w, rtol=1e-5, atol=1e-5)


def test_int8_matmul_is_per_column_symmetric(tmp_path):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 40)).astype(np.float32) * np.linspace(0.01, 3.0, 40, dtype=np.float32)
    w[:, 7] = 0.0  # an all-zero column must not divide by zero
    x = rng.standard_normal((2, 64)).astype(np.float32)
    g = GraphBuilder("m", "int8")
    g.matmul("x", "w", w)
    q, scale = np.asarray(g.weights["w_q"]), np.asarray(g.weights["w_scale"])
    assert q.dtype == np.int8 and scale.shape == (40,) and np.abs(q).max() == 127
    # each column's largest weight maps to ±127, and dequantization is within half a step of the weight
    assert np.all(np.abs(q.astype(np.float32) * scale - w) <= scale / 2 + 1e-7)
    # ONNX Runtime's fused kernel also rounds the activations to int8 (per block), so the product is
    # close to, not equal to, x @ dequantized(W)
    y, exact = run_matmul(w, x, "int8", tmp_path), x @ w
    assert np.abs(y - exact).max() < 0.02 * np.abs(exact).max()


def w8a8_reference(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """W8A8 dynamic per token, in numpy: int8 weights per column, each row of x rounded to int8 with
    its own scale, integer sums, then both scales."""
    scale = np.abs(w).max(axis=0) / 127
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale), -127, 127).astype(np.int64)
    row_scale = (np.maximum(np.abs(x).max(axis=-1, keepdims=True), 1e-30) / np.float32(127)).astype(np.float32)
    a = np.rint(x / row_scale).astype(np.int64)
    return ((a @ q).astype(np.float32) * row_scale * scale).astype(np.float32)


@pytest.mark.parametrize("quantized_kernel", ["DequantizeLinear", "MatMulNBits"])
def test_w8a8_matmul_is_the_per_token_reference_and_each_row_its_own(tmp_path, quantized_kernel):
    """Per-kind and session graphs alike (the kernel choice does not apply): the numpy reference's
    numbers, a row's result the same alone or beside others (what makes a verification compute
    what a decode step does), an all-zero row zeros."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((64, 40)).astype(np.float32) * np.linspace(0.01, 3.0, 40, dtype=np.float32)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    x[1] *= 50.0  # a row of large activations must not change the others'
    x[3] = 0.0
    y = run_matmul(w, x, "w8a8", tmp_path, quantized_kernel)
    np.testing.assert_allclose(y, w8a8_reference(w, x), rtol=1e-5, atol=1e-5)
    assert not y[3].any()
    for row in range(len(x)):
        np.testing.assert_array_equal(run_matmul(w, x[row:row + 1], "w8a8", tmp_path, quantized_kernel), y[row:row + 1])
    exact = x @ w
    assert np.abs(y - exact).max() < 0.02 * np.abs(exact).max()


def test_a_branch_s_w8a8_matmul_is_the_graph_s_own(tmp_path):
    """A weight the main body shares with an If branch (the LM head, for Medusa heads) is multiplied
    there as in the body: the same uint8 weights and MatMulInteger with both zero points."""
    from speccompile.compiler.onnx_graph import BranchBuilder

    w = np.random.default_rng(4).standard_normal((64, 8)).astype(np.float32)
    g = GraphBuilder("m", "w8a8")
    g.matmul("x", "w", w)
    branch = BranchBuilder(g, "then")
    branch.matmul("x", "w", w, shared=True)
    assert set(g.weights) == {"w_u8", "w_scale"}
    for nodes in (g.nodes, branch.nodes):
        [matmul] = [n for n in nodes if n.op_type == "MatMulInteger"]
        assert len(matmul.input) == 4 and matmul.input[1] == "w_u8"


def test_int8_weights_are_written_as_int8_external_data(tmp_path):
    g = GraphBuilder("m", "int8")
    g.matmul("x", "w", np.ones((4, 4), np.float32))
    weights = WeightFile("w.bin")
    weights.add(g.weights)
    weights.write(tmp_path / "w.bin")
    types = {t.name: t.data_type for t in g.model(weights.locations).graph.initializer}
    assert types["w_q"] == TensorProto.INT8 and types["w_scale"] == TensorProto.FLOAT
    assert weights.locations["w_q"][2] == 16  # bytes: one per weight


def test_unknown_weight_format_is_a_bug():
    with pytest.raises(AssertionError, match="matmul_weights"):
        GraphBuilder("m", "int3")


def test_outputs_rename_the_node_that_makes_them_even_if_later_nodes_read_it(tmp_path):
    g = GraphBuilder("o")
    x = g.input("x", FLOAT, [2])
    doubled = g.op("Add", x, x)
    g.output(doubled, "doubled", FLOAT, [2])  # exposed before its consumer below exists
    g.output(g.op("Mul", doubled, doubled), "squared", FLOAT, [2])
    g.output(x, "passthrough", FLOAT, [2])  # a graph input cannot be renamed: Identity
    model = g.model({})
    assert [n.op_type for n in model.graph.node] == ["Add", "Mul", "Identity"]
    (tmp_path / "o.onnx").write_bytes(model.SerializeToString())
    outs = ort.InferenceSession(str(tmp_path / "o.onnx")).run(None, {"x": np.array([1.0, 3.0], np.float32)})
    assert [o.tolist() for o in outs] == [[2.0, 6.0], [4.0, 36.0], [1.0, 3.0]]


def test_one_weight_name_for_two_different_arrays_is_a_bug():
    weights = WeightFile("w.bin")
    weights.add({"w": np.zeros(4, np.float32)})
    weights.add({"w": np.ones(4, np.float32)})  # the same weight again, from another graph: stored once
    with pytest.raises(AssertionError, match="two different weights named w"):
        weights.add({"w": np.zeros(8, np.float32)})


@pytest.mark.parametrize("stored", ["float16", "bfloat16"])
def test_half_precision_weights_are_stored_half_and_computed_in_float32(tmp_path, stored):
    rng = np.random.default_rng(3)
    w, x = rng.standard_normal((32, 48)).astype(np.float32), rng.standard_normal((3, 32)).astype(np.float32)
    g = GraphBuilder("m", stored)
    g.matmul("x", "w", w)
    [(name, half)] = g.weights.items()
    assert half.dtype.itemsize == 2 and name == f"w_{stored}"
    tolerance = 1e-2 if stored == "float16" else 5e-2
    np.testing.assert_allclose(run_matmul(w, x, stored, tmp_path), x @ w, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize(("weights", "k", "bound"), [("int8", 96, 0.02), ("int4", 256, 0.2)])
def test_matmul_nbits_layout_computes_what_the_fused_pattern_computes(tmp_path, weights, k, bound):
    """Session graphs run int8 and int4 weights on MatMulNBits directly; ONNX Runtime fuses the
    portable DequantizeLinear -> MatMul (int4: blocked along K) into the same kernel: the two must
    give the same numbers. 4 bits (7 steps each side of zero) stay within a fifth of the range."""
    rng = np.random.default_rng(2)
    w = rng.standard_normal((k, 40)).astype(np.float32) * np.linspace(0.01, 3.0, 40, dtype=np.float32)
    x = rng.standard_normal((5, k)).astype(np.float32)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    fused = run_matmul(w, x, weights, tmp_path / "a")
    direct = run_matmul(w, x, weights, tmp_path / "b", quantized_kernel="MatMulNBits")
    np.testing.assert_array_equal(direct, fused)
    assert np.abs(direct - x @ w).max() < bound * np.abs(x @ w).max()


def test_int4_matmul_is_blockwise_symmetric_and_packed_two_per_byte(tmp_path):
    rng = np.random.default_rng(4)
    w = rng.standard_normal((384, 40)).astype(np.float32) * np.linspace(0.01, 3.0, 40, dtype=np.float32)
    w[128:256, 5] = 0.0  # an all-zero block must not divide by zero
    w[0, 9] = 50.0  # an outlier widens its own block's scale only
    x = rng.standard_normal((5, 384)).astype(np.float32)
    g = GraphBuilder("m", "int4")
    g.matmul("x", "w", w)
    q, scale = np.asarray(g.weights["w_q"]).astype(np.int8), np.asarray(g.weights["w_scale"])
    assert scale.shape == (3, 40) and q.min() >= -8 and q.max() <= 7  # blocks of 128 along K
    dequantized = (q.reshape(3, 128, 40) * scale[:, None, :]).reshape(384, 40)
    assert np.all(np.abs(dequantized - w) <= np.repeat(scale, 128, axis=0) / 2 + 1e-6)
    assert scale[1, 9] < scale[0, 9] / 10  # the outlier's column keeps fine steps in its other blocks
    weights = WeightFile("w.bin")
    weights.add(g.weights)
    types = {t.name: t.data_type for t in g.model(weights.locations).graph.initializer}
    assert types["w_q"] == TensorProto.INT4 and weights.locations["w_q"][2] == 384 * 40 // 2
    y = run_matmul(w, x, "int4", tmp_path)  # ONNX Runtime reads the packed bytes back as the same weights
    np.testing.assert_allclose(y, x @ dequantized, atol=0.02 * np.abs(x @ dequantized).max())


@pytest.mark.parametrize(("k", "block"), [(96, 32), (192, 64), (48, 16)])
def test_int4_blocks_are_the_largest_that_tile_k(k, block):
    g = GraphBuilder("m", "int4")
    g.matmul("x", "w", np.ones((k, 8), np.float32))
    assert np.asarray(g.weights["w_scale"]).shape == (k // block, 8)


def test_int4_needs_whole_blocks_along_k():
    from speccompile.errors import SpecCompileError

    with pytest.raises(SpecCompileError, match="blocks of 16 or more"):
        GraphBuilder("m", "int4").matmul("x", "w", np.ones((40, 8), np.float32))


def kept_weight(bits: int, k: int = 64, n: int = 24, seed: int = 5):
    """A [K, N] weight as a GGUF Q8_0 / Q4_0 tensor holds it (after transposition): integers and one
    float16-exact scale per 32 values along K."""
    from speccompile.compiler.tensors import INT4, Blocks, LazyTensor

    rng = np.random.default_rng(seed)
    low, high = (-127, 128) if bits == 8 else (-8, 8)
    q = rng.integers(low, high, (k, n)).astype(np.int8)
    scale = rng.uniform(0.001, 0.05, (k // 32, n)).astype(np.float16).astype(np.float32)
    values = (q.astype(np.float32) * np.repeat(scale, 32, axis=0)).astype(np.float32)
    q_lazy = LazyTensor(q.shape, INT4 if bits == 4 else np.dtype(np.int8), lambda: q.astype(INT4) if bits == 4 else q)
    blocks = Blocks(q_lazy, LazyTensor(scale.shape, np.dtype(np.float32), lambda: scale), axis=0, block=32)
    return LazyTensor(values.shape, np.dtype(np.float32), lambda: values, blocks), q, scale, values


@pytest.mark.parametrize("kernel", ["DequantizeLinear", "MatMulNBits"])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("matmul_weights", ["float32", "int8"])
def test_kept_blocks_are_stored_as_given_whatever_the_graph_precision(tmp_path, bits, kernel, matmul_weights):
    """A weight with its source's blocks (GGUF Q8_0 / Q4_0) keeps its integers and scales: the graph
    stores them (not a requantization at `matmul_weights`) and computes x @ (scale × q)."""
    weight, q, scale, values = kept_weight(bits)
    x = np.random.default_rng(6).standard_normal((3, 64)).astype(np.float32)
    g = GraphBuilder("m", matmul_weights, kernel)
    g.matmul("x", "w", weight)
    assert g.kept == ["w"]
    stored = {name: np.asarray(w) for name, w in g.weights.items()}
    if kernel == "DequantizeLinear":
        np.testing.assert_array_equal(stored["w_q"].astype(np.int8), q)
        np.testing.assert_array_equal(stored["w_scale"], scale)
    else:
        np.testing.assert_array_equal(stored["w_nbits_scale"], scale.T.ravel())
    y = run_matmul(weight, x, matmul_weights, tmp_path, kernel)
    exact = x @ values
    # MatMulNBits rounds activations to int8 per block (accuracy level 4), as llama.cpp's CPU dot products do
    assert np.abs(y - exact).max() < 0.02 * np.abs(exact).max()
