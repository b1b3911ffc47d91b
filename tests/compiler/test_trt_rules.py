"""Tests for the TensorRT-parsability check, on small hand-built ONNX models."""

from __future__ import annotations

from collections.abc import Sequence

import onnx
import pytest
from onnx import TensorProto, helper

from speccompile.compiler.trt_rules import check_tensorrt_compatible, tensorrt_violations
from speccompile.errors import SpecCompileError

F32, I64 = TensorProto.FLOAT, TensorProto.INT64
LOCAL_DOMAIN = "speccompile"


def int64_initializer(name: str, values: list[int]) -> onnx.TensorProto:
    return helper.make_tensor(name, I64, [len(values)], values)


def sampler_function(extra_nodes: Sequence[onnx.NodeProto] = ()) -> onnx.FunctionProto:
    """A local function like our sampling helpers: CumSum over the scores, then ArgMax and Equal."""
    nodes = [
        helper.make_node(
            "Constant", [], ["axis"], value=helper.make_tensor("axis", I64, [], [-1]), name="sampler/axis"
        ),
        helper.make_node("CumSum", ["scores", "axis"], ["cumulative"], name="sampler/CumSum"),
        helper.make_node("ArgMax", ["cumulative"], ["token"], axis=-1, keepdims=0, name="sampler/ArgMax"),
        helper.make_node("Equal", ["token", "token"], ["same"], name="sampler/Equal"),
        *extra_nodes,
    ]
    return helper.make_function(
        LOCAL_DOMAIN, "Sampler", ["scores"], ["token", "same"], nodes, [helper.make_opsetid("", 24)]
    )


def build_model(
    *,
    scatter_axis: int = -2,
    reduce_axes_constant: bool = True,
    extra_nodes: Sequence[onnx.NodeProto] = (),
    extra_inputs: Sequence[onnx.ValueInfoProto] = (),
    extra_initializers: Sequence[onnx.TensorProto] = (),
    function: onnx.FunctionProto | None = None,
    opset: int = 24,
) -> onnx.ModelProto:
    """Attention scores -> Softmax -> ReduceSum -> local Sampler, plus a 4D KV-cache TensorScatter."""
    nodes = [
        helper.make_node("MatMul", ["q", "k_t"], ["scores"], name="attn/MatMul"),
        helper.make_node("Softmax", ["scores"], ["probs"], axis=-1, name="attn/Softmax"),
        helper.make_node("ReduceSum", ["probs", "reduce_axes"], ["pooled"], keepdims=0, name="head/ReduceSum"),
        helper.make_node("Sampler", ["pooled"], ["token", "same"], domain=LOCAL_DOMAIN, name="head/Sampler"),
        helper.make_node(
            "TensorScatter", ["past_cache", "update", "write_indices"], ["present_cache"],
            axis=scatter_axis, name="kv/TensorScatter",
        ),
        *extra_nodes,
    ]
    inputs = [
        helper.make_tensor_value_info("q", F32, [1, 2, 4, 8]),
        helper.make_tensor_value_info("k_t", F32, [1, 2, 8, 4]),
        helper.make_tensor_value_info("past_cache", F32, [1, 2, 16, 8]),
        helper.make_tensor_value_info("update", F32, [1, 2, 4, 8]),
        helper.make_tensor_value_info("write_indices", I64, [1]),
        *extra_inputs,
    ]
    initializers = [*extra_initializers]
    if reduce_axes_constant:
        initializers.append(int64_initializer("reduce_axes", [-1]))
    else:
        inputs.append(helper.make_tensor_value_info("reduce_axes", I64, [1]))
    outputs = [
        helper.make_tensor_value_info("token", I64, [1, 2]),
        helper.make_tensor_value_info("same", TensorProto.BOOL, [1, 2]),
        helper.make_tensor_value_info("present_cache", F32, [1, 2, 16, 8]),
    ]
    graph = helper.make_graph(nodes, "target_forward", inputs, outputs, initializers)
    return helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(LOCAL_DOMAIN, 1)],
        functions=[function or sampler_function()],
        ir_version=10,
    )


def only_violation(model: onnx.ModelProto) -> str:
    violations = tensorrt_violations(model)
    assert len(violations) == 1, violations
    return violations[0]


def test_valid_graph_passes():
    model = build_model()
    onnx.checker.check_model(model, full_check=True)  # the fixture itself is real ONNX
    assert tensorrt_violations(model) == []
    check_tensorrt_compatible(model, "target_forward")


def test_scatter_axis_spelled_positively_passes_when_rank_known():
    assert tensorrt_violations(build_model(scatter_axis=2)) == []


def test_unsupported_op_is_reported():
    unique = helper.make_node("Unique", ["write_indices"], ["uniq"], name="dedupe/Unique")
    message = only_violation(build_model(extra_nodes=[unique]))
    assert "node 'dedupe/Unique' (Unique)" in message


def test_custom_domain_node_without_function_is_reported():
    plugin = helper.make_node("FusedRope", ["q"], ["rope_q"], domain="com.example", name="attn/FusedRope")
    model = build_model(extra_nodes=[plugin])
    model.opset_import.append(helper.make_opsetid("com.example", 1))
    message = only_violation(model)
    assert "node 'attn/FusedRope' (FusedRope)" in message
    assert "no local function body" in message


def test_unsupported_op_inside_local_function_is_reported():
    hidden = helper.make_node("Multinomial", ["scores"], ["drawn"], name="sampler/Multinomial")
    message = only_violation(build_model(function=sampler_function(extra_nodes=[hidden])))
    assert "node 'sampler/Multinomial' (Multinomial) in function 'speccompile.Sampler'" in message


def test_reduce_with_runtime_axes_is_reported():
    message = only_violation(build_model(reduce_axes_constant=False))
    assert "node 'head/ReduceSum' (ReduceSum)" in message
    assert "reduce_axes" in message


def test_reduce_axes_from_constant_node_pass():
    axes = helper.make_node("Constant", [], ["const_axes"], value=int64_initializer("v", [0]), name="c")
    reduce = helper.make_node("ReduceMax", ["probs", "const_axes"], ["peak"], name="head/ReduceMax")
    assert tensorrt_violations(build_model(extra_nodes=[axes, reduce])) == []


def test_tensor_scatter_off_sequence_axis_is_reported():
    message = only_violation(build_model(scatter_axis=1))
    assert "node 'kv/TensorScatter' (TensorScatter)" in message
    assert "axis" in message


def test_tensor_scatter_needs_literal_minus_two_when_rank_unknown():
    scatter = helper.make_node(
        "TensorScatter", ["cache_any", "update_any"], ["cache_out"], axis=2, name="kv/UnrankedScatter"
    )
    unranked = [helper.make_tensor_value_info(name, F32, None) for name in ("cache_any", "update_any")]
    message = only_violation(build_model(extra_nodes=[scatter], extra_inputs=unranked))
    assert "node 'kv/UnrankedScatter' (TensorScatter)" in message


def test_tensor_scatter_needs_rank_four():
    scatter = helper.make_node("TensorScatter", ["cache3", "update3"], ["cache3_out"], name="kv/Scatter3D")
    rank3 = [helper.make_tensor_value_info(name, F32, [1, 16, 8]) for name in ("cache3", "update3")]
    message = only_violation(build_model(extra_nodes=[scatter], extra_inputs=rank3))
    assert "node 'kv/Scatter3D' (TensorScatter)" in message and "rank 3" in message


def test_cumsum_on_int64_is_reported():
    cumsum = helper.make_node("CumSum", ["mask", "cumsum_axis"], ["positions"], name="pos/CumSum")
    message = only_violation(
        build_model(
            extra_nodes=[cumsum],
            extra_inputs=[helper.make_tensor_value_info("mask", I64, [1, 8])],
            extra_initializers=[helper.make_tensor("cumsum_axis", I64, [], [1])],
        )
    )
    assert "node 'pos/CumSum' (CumSum)" in message and "INT64" in message


def test_cumsum_on_int64_inside_function_is_typed_from_the_call_site():
    call = helper.make_node("Sampler", ["mask"], ["t2", "s2"], domain=LOCAL_DOMAIN, name="pos/Sampler")
    int_mask = helper.make_tensor_value_info("mask", I64, [1, 8])
    model = build_model(extra_nodes=[call], extra_inputs=[int_mask])
    message = only_violation(model)
    assert "node 'sampler/CumSum' (CumSum) in function 'speccompile.Sampler'" in message
    assert "INT64" in message


def test_double_initializer_is_reported():
    scale = helper.make_tensor("scale_f64", TensorProto.DOUBLE, [1], [0.5])
    message = only_violation(build_model(extra_initializers=[scale]))
    assert "tensor 'scale_f64'" in message and "DOUBLE" in message


def test_opset_outside_range_is_reported():
    assert any("opset 25" in message for message in tensorrt_violations(build_model(opset=25)))


@pytest.mark.parametrize(
    "node, extra_inputs, expected",
    [
        (helper.make_node("Cast", ["q"], ["q64"], to=TensorProto.DOUBLE, name="bad/Cast"), [], "DOUBLE"),
        (
            helper.make_node("TopK", ["probs", "big_k"], ["v", "i"], name="bad/TopK"),
            [helper.make_tensor_value_info("big_k", I64, [1])],
            "run time",
        ),
        (
            helper.make_node("Unsqueeze", ["q", "dyn_axes"], ["q5"], name="bad/Unsqueeze"),
            [helper.make_tensor_value_info("dyn_axes", I64, [1])],
            "run time",
        ),
        (
            helper.make_node(
                "Attention", ["q", "kk", "vv", "", "past_k", "past_v"], ["y", "present_k", "present_v"],
                name="bad/Attention",
            ),
            [helper.make_tensor_value_info(n, F32, [1, 2, 4, 8]) for n in ("kk", "vv", "past_k", "past_v")],
            "past_key",
        ),
    ],
    ids=["cast-to-double", "topk-runtime-k", "unsqueeze-runtime-axes", "attention-kv-cache"],
)
def test_op_restrictions_are_reported(node, extra_inputs, expected):
    violations = tensorrt_violations(build_model(extra_nodes=[node], extra_inputs=extra_inputs))
    matching = [message for message in violations if f"node '{node.name}' ({node.op_type})" in message]
    assert matching and expected in matching[0], violations


def test_topk_k_over_limit_is_reported():
    topk = helper.make_node("TopK", ["probs", "k_big"], ["v", "i"], name="bad/TopKBig")
    model = build_model(extra_nodes=[topk], extra_initializers=[int64_initializer("k_big", [4096])])
    assert "K is 4096" in only_violation(model)


def test_check_raises_one_line_naming_graph_and_every_node():
    unique = helper.make_node("Unique", ["write_indices"], ["uniq"], name="dedupe/Unique")
    model = build_model(scatter_axis=1, extra_nodes=[unique])
    with pytest.raises(SpecCompileError) as error:
        check_tensorrt_compatible(model, "target_forward")
    message = str(error.value)
    assert message.startswith("graph target_forward is not TensorRT-parsable: ")
    assert "\n" not in message
    assert "'dedupe/Unique' (Unique)" in message and "'kv/TensorScatter' (TensorScatter)" in message
