"""The `SpecAccept` op: acceptance + KV-rollback bookkeeping as one node of the verification graph.

It is an ONNX model-local function in the `speccompile` domain. Its body uses standard ops only, so
ONNX Runtime runs it with no custom library; the node also carries `plugin_namespace` and
`plugin_version`, so TensorRT's parser can serve it with our plugin (plugins/) instead of inlining
the body. The numpy reference of the same rule is `speccompile.core.acceptance`.

Greedy rule. The target scored [last, d_1 .. d_γ] at positions L .. L+γ, so its argmax t_j at
input j is its own choice for the token after input j.
  accepted  n = number of leading j in 1..γ with d_j == t_{j-1}
  next        = t_n  (the correction at the first mismatch, or the bonus token when n == γ)
  new_len     = L + n + 1  (last and d_1..d_n stay in the cache; entries past them are dead and
                            will be overwritten, which is the O(1) rollback)
"""

import onnx
from onnx import TensorProto, helper

DOMAIN = "speccompile"
PLUGIN_NAMESPACE = "speccompile"
PLUGIN_VERSION = "1"
INPUTS = ["target_logits", "draft_tokens", "past_len"]
OUTPUTS = ["accepted", "next_token", "new_len"]


def _const(name: str, value, dtype=TensorProto.INT64, dims=()) -> onnx.NodeProto:
    values = value if isinstance(value, list) else [value]
    return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, dtype, list(dims), values))


def spec_accept_function(opset: int) -> onnx.FunctionProto:
    nodes = [
        _const("one", 1), _const("axis1", [1], dims=[1]),
        _const("start", [0], dims=[1]), _const("end", [-1], dims=[1]),
        _const("zero_f", 0.0, TensorProto.FLOAT),
        # t_j: the target's greedy token after each of the γ+1 inputs.
        helper.make_node("ArgMax", ["target_logits"], ["target_tokens"], axis=-1, keepdims=0),
        # t_0 .. t_{γ-1} are the target's choices at the positions the drafts d_1..d_γ occupy.
        helper.make_node("Slice", ["target_tokens", "start", "end", "axis1"], ["target_choice"]),
        helper.make_node("Equal", ["draft_tokens", "target_choice"], ["match"]),
        # Leading run of matches: a position counts while no mismatch has occurred at or before it.
        # (CumSum runs in float: TensorRT's CumSum takes float types only.)
        helper.make_node("Not", ["match"], ["mismatch"]),
        helper.make_node("Cast", ["mismatch"], ["mismatch_f"], to=TensorProto.FLOAT),
        helper.make_node("CumSum", ["mismatch_f", "one"], ["mismatches_so_far"]),
        helper.make_node("Equal", ["mismatches_so_far", "zero_f"], ["in_leading_run"]),
        helper.make_node("Cast", ["in_leading_run"], ["in_leading_run_i"], to=TensorProto.INT64),
        helper.make_node("ReduceSum", ["in_leading_run_i", "axis1"], ["accepted"], keepdims=0),
        # next = t_n: the correction at the first mismatch, or the bonus token when all γ matched.
        helper.make_node("Unsqueeze", ["accepted", "axis1"], ["accepted_col"]),
        helper.make_node("GatherElements", ["target_tokens", "accepted_col"], ["next_col"], axis=1),
        helper.make_node("Squeeze", ["next_col", "axis1"], ["next_token"]),
        helper.make_node("Add", ["past_len", "accepted"], ["kept_drafts_end"]),
        helper.make_node("Add", ["kept_drafts_end", "one"], ["new_len"]),
    ]
    return helper.make_function(
        DOMAIN, "SpecAccept", INPUTS, OUTPUTS, nodes,
        opset_imports=[helper.make_opsetid("", opset)],
        attributes=["plugin_namespace", "plugin_version", "mode"],
    )


def spec_accept_node(builder, target_logits: str, draft_tokens: str, past_len: str) -> list[str]:
    """Add a SpecAccept node (and its function definition) to `builder`; its outputs are named
    `accepted`, `next_token`, `new_len` (the verification graph's outputs)."""
    from speccompile.compiler.onnx_graph import OPSET

    if not builder.functions:
        builder.add_function(spec_accept_function(OPSET))
    return builder.op(
        "SpecAccept", target_logits, draft_tokens, past_len, outputs=3, domain=DOMAIN, out=OUTPUTS,
        plugin_namespace=PLUGIN_NAMESPACE, plugin_version=PLUGIN_VERSION, mode="greedy",
    )
