"""Static check that an exported ONNX model is something TensorRT's ONNX parser will accept.

The op table and the per-op restrictions follow onnx-tensorrt's operator support matrix
(docs/operators.md) for TensorRT 10.x (10.15: opsets 9..24); TensorRT 11.x parses the same set.
Only op names are encoded as a table; restrictions that bite speculative-decoding graphs (KV-cache
scatter, reductions, sampling ops, casts, Attention) are small check functions in `NODE_RULES`.

We run this before handing a graph to TensorRT because the parser's own failures arrive late (at
engine build, on the GPU machine) and name one node at a time; this names every problem at once.

Type and rank facts come from `onnx.shape_inference`; when it cannot run (e.g. a >2 GiB model held
in memory) we fall back to whatever value_info the model already carries and skip the checks that
need facts we lack, rather than guess. Initializer payloads are never read when stored externally.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import uses_external_data

from speccompile.errors import SpecCompileError

MIN_OPSET = 9
MAX_OPSET = 24
DEFAULT_DOMAINS = frozenset({"", "ai.onnx"})

# Ops marked "Y" in the TensorRT 10.x matrix. Anything else in the default domain is rejected:
# ops the matrix marks "N" and ops it does not list at all are equally unparsable.
SUPPORTED_OPS = frozenset(
    {
        "Abs", "Acos", "Acosh", "Add", "And", "ArgMax", "ArgMin", "Asin", "Asinh", "Atan",
        "Atanh", "Attention", "AveragePool", "BatchNormalization", "BlackmanWindow", "Cast",
        "CastLike", "Ceil", "Celu", "Clip", "Concat", "Constant", "ConstantOfShape", "Conv",
        "ConvTranspose", "Cos", "Cosh", "CumSum", "DeformConv", "DepthToSpace",
        "DequantizeLinear", "Div", "Dropout", "Einsum", "Elu", "Equal", "Erf", "Exp", "Expand",
        "EyeLike", "Flatten", "Floor", "Gather", "GatherElements", "GatherND", "Gelu", "Gemm",
        "GlobalAveragePool", "GlobalLpPool", "GlobalMaxPool", "Greater", "GreaterOrEqual",
        "GridSample", "GroupNormalization", "GRU", "HammingWindow", "HannWindow", "HardSigmoid",
        "HardSwish", "Hardmax", "Identity", "If", "ImageScaler", "InstanceNormalization",
        "IsInf", "IsNaN", "LayerNormalization", "LeakyRelu", "Less", "LessOrEqual", "Log",
        "LogSoftmax", "Loop", "LRN", "LSTM", "LpNormalization", "LpPool", "MatMul", "Max",
        "MaxPool", "Mean", "MeanVarianceNormalization", "Min", "Mish", "Mod", "Mul", "Neg",
        "NonMaxSuppression", "NonZero", "Not", "OneHot", "Or", "Pad", "ParametricSoftplus",
        "Pow", "PRelu", "QuantizeLinear", "RandomNormal", "RandomNormalLike", "RandomUniform",
        "RandomUniformLike", "Range", "Reciprocal", "ReduceL1", "ReduceL2", "ReduceLogSum",
        "ReduceLogSumExp", "ReduceMax", "ReduceMean", "ReduceMin", "ReduceProd", "ReduceSum",
        "ReduceSumSquare", "Relu", "Reshape", "Resize", "ReverseSequence", "RMSNormalization",
        "RNN", "RoiAlign", "RotaryEmbedding", "Round", "STFT", "ScaledTanh", "Scan", "Scatter",
        "ScatterElements", "ScatterND", "Selu", "Shape", "Shrink", "Sigmoid", "Sign", "Sin",
        "Sinh", "Size", "Slice", "Softmax", "Softplus", "Softsign", "SpaceToDepth", "Split",
        "Sqrt", "Squeeze", "Sub", "Sum", "Tan", "Tanh", "TensorScatter", "ThresholdedRelu",
        "Tile", "TopK", "Transpose", "Trilu", "Unsqueeze", "Upsample", "Where", "Xor",
    }
)

REDUCE_OPS = frozenset(
    {
        "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean",
        "ReduceMin", "ReduceProd", "ReduceSum", "ReduceSumSquare",
    }
)

# Element types a TensorRT network tensor may have. INT8 and INT4 stay because they are how quantized
# weights reach Q/DQ nodes (DataType::kINT4: weight-only block quantization); UINT8 is further
# restricted to network inputs and outputs.
ALLOWED_TENSOR_TYPES = frozenset(
    {
        TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.INT32,
        TensorProto.INT64, TensorProto.INT8, TensorProto.INT4, TensorProto.UINT8, TensorProto.BOOL,
    }
)
CAST_TARGET_TYPES = frozenset(
    {
        TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.INT32,
        TensorProto.INT64, TensorProto.UINT8, TensorProto.BOOL,
    }
)
FLOAT_TYPES = frozenset({TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16})
TOPK_K_LIMIT = 3840

# Returned by Scope.attribute for a function-body attribute that refers to a caller attribute we
# could not bind (a function nobody calls): the checks then skip rather than guess.
UNRESOLVED = object()

ConstantSource = onnx.TensorProto | onnx.SparseTensorProto | onnx.NodeProto
FunctionKey = tuple[str, str]


def dtype_name(elem_type: int) -> str:
    return TensorProto.DataType.Name(elem_type)


@dataclass
class Scope:
    """What a node check may ask about the values around it (one graph, subgraph or function)."""

    where: str  # appended to messages: "" for the main graph, " in function 'd.f'" otherwise
    constants: dict[str, ConstantSource] = field(default_factory=dict)
    value_types: dict[str, onnx.TypeProto] = field(default_factory=dict)

    def is_constant(self, name: str) -> bool:
        return name in self.constants

    def constant_value(self, name: str) -> np.ndarray | None:
        """The value of a build-time constant, or None when absent, external or not literal."""
        source = self.constants.get(name)
        if isinstance(source, onnx.TensorProto):
            return _tensor_value(source)
        if isinstance(source, onnx.NodeProto):
            return _constant_node_value(source)
        return None

    def elem_type(self, name: str) -> int | None:
        type_proto = self.value_types.get(name)
        if type_proto is None or type_proto.WhichOneof("value") != "tensor_type":
            return None
        return type_proto.tensor_type.elem_type or None

    def rank(self, name: str) -> int | None:
        type_proto = self.value_types.get(name)
        if type_proto is None or type_proto.WhichOneof("value") != "tensor_type":
            return None
        tensor_type = type_proto.tensor_type
        return len(tensor_type.shape.dim) if tensor_type.HasField("shape") else None

    @staticmethod
    def attribute(node: onnx.NodeProto, name: str, default: object = None) -> object:
        for attr in node.attribute:
            if attr.name == name:
                return UNRESOLVED if attr.ref_attr_name else helper.get_attribute_value(attr)
        return default


NodeRule = Callable[[onnx.NodeProto, Scope], "str | None"]


# ---------------------------------------------------------------------------------------------
# Per-op restrictions. Each returns one reason string, or None when the node is fine.


def optional_input(node: onnx.NodeProto, index: int) -> str:
    """The input name at `index`, "" when omitted (past the end or left empty)."""
    return node.input[index] if index < len(node.input) else ""


def optional_output(node: onnx.NodeProto, index: int) -> str:
    return node.output[index] if index < len(node.output) else ""


def join_reasons(reasons: Sequence[str]) -> str | None:
    return ", ".join(reasons) if reasons else None


def check_reduce_axes(node: onnx.NodeProto, scope: Scope) -> str | None:
    # The attribute form (older opsets) is constant by construction; the input form must be too,
    # because TensorRT fixes the reduced axes when it builds the engine.
    axes = optional_input(node, 1)
    if axes and not scope.is_constant(axes):
        return f"axes '{axes}' is computed at run time; TensorRT needs them as a build-time constant"
    return None


def check_cumsum(node: onnx.NodeProto, scope: Scope) -> str | None:
    reasons = []
    axis = optional_input(node, 1)
    if axis and not scope.is_constant(axis):
        reasons.append(f"axis '{axis}' is computed at run time; TensorRT needs a build-time constant")
    data_type = scope.elem_type(node.input[0]) if node.input else None
    if data_type is not None and data_type not in FLOAT_TYPES:
        reasons.append(
            f"data '{node.input[0]}' is {dtype_name(data_type)}; TensorRT's CumSum runs on "
            "FLOAT/FLOAT16/BFLOAT16 only (cast to float first)"
        )
    return join_reasons(reasons)


def check_tensor_scatter(node: onnx.NodeProto, scope: Scope) -> str | None:
    reasons = []
    for role, name in (("past_cache", optional_input(node, 0)), ("update", optional_input(node, 1))):
        rank = scope.rank(name) if name else None
        if rank is not None and rank != 4:
            reasons.append(f"{role} '{name}' has rank {rank}; TensorRT needs rank 4")
    axis = scope.attribute(node, "axis", -2)
    cache_rank = scope.rank(optional_input(node, 0))
    if axis is not UNRESOLVED:
        # With a known rank, any spelling of "second-to-last axis" is the same op; without one
        # only the literal -2 is known to mean that.
        if cache_rank is None and axis != -2:
            reasons.append(f"axis is {axis} on a cache of unknown rank; TensorRT needs axis -2")
        elif cache_rank is not None and axis % cache_rank != cache_rank - 2:
            reasons.append(f"axis is {axis}; TensorRT scatters only along axis -2 (the sequence axis)")
    return join_reasons(reasons)


def check_squeeze_axes(node: onnx.NodeProto, scope: Scope) -> str | None:
    # An omitted axes input (Squeeze) or the old attribute form leaves nothing to resolve.
    axes = optional_input(node, 1)
    if axes and not scope.is_constant(axes):
        return f"axes '{axes}' is computed at run time; TensorRT needs them as a build-time constant"
    return None


def check_topk(node: onnx.NodeProto, scope: Scope) -> str | None:
    reasons = []
    k_input = optional_input(node, 1)
    if k_input and not scope.is_constant(k_input):
        reasons.append(f"K '{k_input}' is computed at run time; TensorRT needs a build-time constant")
    k = _topk_k_value(node, scope, k_input)
    if k is not None and k >= TOPK_K_LIMIT:
        reasons.append(f"K is {k}; TensorRT's TopK needs K < {TOPK_K_LIMIT}")
    if scope.attribute(node, "sorted", 1) == 0:
        reasons.append("sorted=0; TensorRT's TopK always sorts and needs sorted=1")
    return join_reasons(reasons)


def _topk_k_value(node: onnx.NodeProto, scope: Scope, k_input: str) -> int | None:
    if k_input:
        value = scope.constant_value(k_input)
        return int(value.reshape(-1)[0]) if value is not None and value.size else None
    k = scope.attribute(node, "k")  # opset 9 keeps K as an attribute
    return k if isinstance(k, int) else None


def check_cast(node: onnx.NodeProto, scope: Scope) -> str | None:
    target = scope.attribute(node, "to")
    if isinstance(target, int) and target not in CAST_TARGET_TYPES:
        return f"casts to {dtype_name(target)}, which TensorRT's Cast cannot produce"
    return None


def check_cast_like(node: onnx.NodeProto, scope: Scope) -> str | None:
    target = scope.elem_type(optional_input(node, 1))
    if target is not None and target not in CAST_TARGET_TYPES:
        return f"casts to {dtype_name(target)}, which TensorRT's CastLike cannot produce"
    return None


ATTENTION_UNSUPPORTED_INPUTS = ((4, "past_key"), (5, "past_value"), (6, "nonpad_kv_seqlen"))
ATTENTION_UNSUPPORTED_OUTPUTS = ((1, "present_key"), (2, "present_value"), (3, "qk_matmul_output"))


def check_attention(node: onnx.NodeProto, scope: Scope) -> str | None:
    # TensorRT's Attention layer has no KV-cache plumbing: the cache must be handled outside the
    # op (e.g. TensorScatter + Concat), so cache inputs/outputs are rejected outright.
    reasons = [
        f"uses input {role}"
        for index, role in ATTENTION_UNSUPPORTED_INPUTS
        if optional_input(node, index)
    ]
    reasons += [
        f"uses output {role}"
        for index, role in ATTENTION_UNSUPPORTED_OUTPUTS
        if optional_output(node, index)
    ]
    for attr_name in ("softcap", "qk_matmul_output_mode"):
        value = scope.attribute(node, attr_name, 0)
        if value is not UNRESOLVED and value != 0:
            reasons.append(f"sets {attr_name}={value}")
    for role, index in (("Q", 0), ("K", 1), ("V", 2)):
        rank = scope.rank(optional_input(node, index))
        if rank is not None and rank != 4:
            reasons.append(f"{role} has rank {rank} (needs 4)")
    if reasons:
        return ", ".join(reasons) + " (unsupported by TensorRT's Attention)"
    return None


NODE_RULES: dict[str, NodeRule] = {
    **{op: check_reduce_axes for op in REDUCE_OPS},
    "CumSum": check_cumsum,
    "TensorScatter": check_tensor_scatter,
    "Squeeze": check_squeeze_axes,
    "Unsqueeze": check_squeeze_axes,
    "TopK": check_topk,
    "Cast": check_cast,
    "CastLike": check_cast_like,
    "Attention": check_attention,
}


# ---------------------------------------------------------------------------------------------
# Constants and types.


def _tensor_value(tensor: onnx.TensorProto) -> np.ndarray | None:
    # External payloads may not be loaded (or may be huge): never touch them.
    if uses_external_data(tensor):
        return None
    try:
        return numpy_helper.to_array(tensor)
    except Exception:  # an odd dtype or a truncated payload: just "value unknown"
        return None


def _constant_node_value(node: onnx.NodeProto) -> np.ndarray | None:
    for attr in node.attribute:
        if attr.ref_attr_name:
            return None
        if attr.name == "value":
            return _tensor_value(attr.t)
        if attr.name in ("value_int", "value_ints", "value_float", "value_floats"):
            return np.asarray(helper.get_attribute_value(attr))
    return None


def _constant_node_type(node: onnx.NodeProto) -> onnx.TypeProto | None:
    for attr in node.attribute:
        if attr.ref_attr_name:
            return None
        if attr.name == "value":
            return helper.make_tensor_type_proto(attr.t.data_type, list(attr.t.dims))
        if attr.name == "sparse_value":
            sparse = attr.sparse_tensor
            return helper.make_tensor_type_proto(sparse.values.data_type, list(sparse.dims))
        scalar_or_list = {
            "value_int": (TensorProto.INT64, []),
            "value_ints": (TensorProto.INT64, [len(attr.ints)]),
            "value_float": (TensorProto.FLOAT, []),
            "value_floats": (TensorProto.FLOAT, [len(attr.floats)]),
            "value_string": (TensorProto.STRING, []),
            "value_strings": (TensorProto.STRING, [len(attr.strings)]),
        }
        if attr.name in scalar_or_list:
            return helper.make_tensor_type_proto(*scalar_or_list[attr.name])
    return None


def _collect_constant_nodes(
    nodes: Iterable[onnx.NodeProto],
    constants: dict[str, ConstantSource],
    value_types: dict[str, onnx.TypeProto],
) -> None:
    """Record Constant outputs (and Identity copies of constants, which exporters love to insert)."""
    for node in nodes:
        if node.domain not in DEFAULT_DOMAINS or not node.output:
            continue
        if node.op_type == "Constant":
            constants[node.output[0]] = node
            type_proto = _constant_node_type(node)
            if type_proto is not None:
                value_types.setdefault(node.output[0], type_proto)
        elif node.op_type == "Identity" and node.input and node.input[0] in constants:
            constants[node.output[0]] = constants[node.input[0]]


def _declared_types(values: Iterable[onnx.ValueInfoProto]) -> dict[str, onnx.TypeProto]:
    return {value.name: value.type for value in values if value.type.WhichOneof("value") is not None}


def _graph_scope(
    graph: onnx.GraphProto, where: str, parent: Scope | None
) -> tuple[Scope, dict[str, onnx.TypeProto]]:
    """The scope a graph's nodes see, plus the types this graph itself introduces."""
    own_types = _declared_types([*graph.input, *graph.output, *graph.value_info])
    constants: dict[str, ConstantSource] = dict(parent.constants) if parent else {}
    for tensor in graph.initializer:
        constants[tensor.name] = tensor
        own_types.setdefault(
            tensor.name, helper.make_tensor_type_proto(tensor.data_type, list(tensor.dims))
        )
    for sparse in graph.sparse_initializer:
        constants[sparse.values.name] = sparse
        own_types.setdefault(
            sparse.values.name, helper.make_tensor_type_proto(sparse.values.data_type, list(sparse.dims))
        )
    _collect_constant_nodes(graph.node, constants, own_types)
    value_types = {**(parent.value_types if parent else {}), **own_types}
    return Scope(where=where, constants=constants, value_types=value_types), own_types


def tensor_type_violations(
    value_types: Mapping[str, onnx.TypeProto], where: str, io_names: frozenset[str] = frozenset()
) -> list[str]:
    """Element-type problems for the given values; `io_names` are network inputs/outputs."""
    violations = []
    for name, type_proto in value_types.items():
        kind = type_proto.WhichOneof("value")
        if kind is None:
            continue
        if kind != "tensor_type":
            kind_name = kind.removesuffix("_type")
            violations.append(
                f"value '{name}'{where} has a {kind_name} type; TensorRT handles dense tensors only"
            )
            continue
        elem_type = type_proto.tensor_type.elem_type
        if elem_type == TensorProto.UNDEFINED:
            continue
        if elem_type not in ALLOWED_TENSOR_TYPES:
            violations.append(
                f"tensor '{name}'{where} has element type {dtype_name(elem_type)}, "
                "which TensorRT does not support"
            )
        elif elem_type == TensorProto.UINT8 and name not in io_names:
            violations.append(
                f"tensor '{name}'{where} is UINT8; "
                "TensorRT allows UINT8 only as a network input or output"
            )
    return violations


def _infer_shapes_or_keep(model: onnx.ModelProto) -> onnx.ModelProto:
    try:
        return onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False)
    except Exception:  # >2 GiB protos, unknown ops, malformed graphs: fall back to declared types
        return model


def opset_violations(opset_imports: Iterable[onnx.OperatorSetIdProto], owner: str) -> list[str]:
    return [
        f"{owner} imports ai.onnx opset {opset.version}; TensorRT parses opsets {MIN_OPSET}..{MAX_OPSET}"
        for opset in opset_imports
        if opset.domain in DEFAULT_DOMAINS and not MIN_OPSET <= opset.version <= MAX_OPSET
    ]


def node_label(node: onnx.NodeProto) -> str:
    if node.name:
        return node.name
    return f"<unnamed {node.op_type} -> {node.output[0] if node.output else '?'}>"


def _bind_attribute_refs(
    nodes: Iterable[onnx.NodeProto], bindings: Mapping[str, onnx.AttributeProto]
) -> list[onnx.NodeProto]:
    """Copies of a function body with attribute references replaced by the caller's values.

    A reference the caller left unbound (an optional attribute it omitted) is dropped so the op's
    default applies, as ONNX's function semantics say.
    """
    bound_nodes = []
    for node in nodes:
        bound = onnx.NodeProto()
        bound.CopyFrom(node)
        del bound.attribute[:]
        for attr in node.attribute:
            if not attr.ref_attr_name:
                bound.attribute.append(attr)
            elif attr.ref_attr_name in bindings:
                value = onnx.AttributeProto()
                value.CopyFrom(bindings[attr.ref_attr_name])
                value.name = attr.name
                bound.attribute.append(value)
        bound_nodes.append(bound)
    return bound_nodes


# ---------------------------------------------------------------------------------------------
# The walk.


class _ModelChecker:
    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        self.functions: dict[FunctionKey, onnx.FunctionProto] = {
            (function.domain, function.name): function for function in model.functions
        }
        self.violations: list[str] = []
        self.plugin_only: list[str] = []  # body violations of nodes a plugin can serve instead
        self.functions_entered: set[FunctionKey] = set()
        self.functions_active: list[FunctionKey] = []
        self.bodies_checked: set[tuple] = set()
        self.body_types_cache: dict[tuple, dict[str, onnx.TypeProto]] = {}

    def run(self) -> list[str]:
        self.violations += opset_violations(self.model.opset_import, "model")
        for function in self.model.functions:
            owner = f"function '{function.domain}.{function.name}'"
            self.violations += opset_violations(function.opset_import, owner)
        graph = self.model.graph
        scope, own_types = _graph_scope(graph, "", parent=None)
        io_names = frozenset(value.name for value in [*graph.input, *graph.output])
        self.violations += tensor_type_violations(own_types, "", io_names)
        self.check_nodes(graph.node, scope)
        # A body no node reaches is still checked, without caller facts: it ships in the model
        # and a stale, unparsable body is a bug we want reported before anyone calls it.
        for key, function in self.functions.items():
            if key not in self.functions_entered:
                self.check_function_body(function, [None] * len(function.input), {}, bindings=None)
        return list(dict.fromkeys(self.violations))  # a function called twice reports once

    def check_nodes(self, nodes: Iterable[onnx.NodeProto], scope: Scope) -> None:
        for node in nodes:
            self.check_node(node, scope)
            self.check_subgraphs(node, scope)

    def check_node(self, node: onnx.NodeProto, scope: Scope) -> None:
        prefix = f"node '{node_label(node)}' ({node.op_type}){scope.where}"
        if (node.domain, node.op_type) in self.functions:
            self.check_function_call(node, scope)
        elif node.domain not in DEFAULT_DOMAINS:
            self.violations.append(
                f"{prefix}: custom op in domain '{node.domain}' "
                "with no local function body and no plugin"
            )
        elif node.op_type not in SUPPORTED_OPS:
            self.violations.append(f"{prefix}: op not supported by TensorRT's ONNX parser")
        elif (rule := NODE_RULES.get(node.op_type)) and (reason := rule(node, scope)):
            self.violations.append(f"{prefix}: {reason}")

    def check_subgraphs(self, node: onnx.NodeProto, scope: Scope) -> None:
        # If/Loop/Scan bodies are parsed like any graph and see the enclosing scope's values.
        for attr in node.attribute:
            graphs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
            for subgraph in graphs:
                where = f" in {attr.name} of node '{node_label(node)}'{scope.where}"
                child, own_types = _graph_scope(subgraph, where, parent=scope)
                self.violations += tensor_type_violations(own_types, where)
                self.check_nodes(subgraph.node, child)

    def check_function_call(self, node: onnx.NodeProto, scope: Scope) -> None:
        function = self.functions[(node.domain, node.op_type)]
        actuals = [optional_input(node, index) for index in range(len(function.input))]
        input_types = [scope.value_types.get(name) if name else None for name in actuals]
        # TensorRT inlines the body, so a constant argument stays a constant inside it.
        constants = {
            formal: scope.constants[actual]
            for formal, actual in zip(function.input, actuals)
            if actual and actual in scope.constants
        }
        bindings = {attr.name: attr for attr in function.attribute_proto}
        bindings.update({attr.name: attr for attr in node.attribute})
        if "plugin_namespace" not in {attr.name for attr in node.attribute}:
            self.check_function_body(function, input_types, constants, bindings)
            return
        # With a plugin registered (ENABLE_PLUGIN_OVERRIDE) TensorRT never parses this body; what
        # the body would need is recorded, not fatal.
        before, self.violations = self.violations, []
        try:
            self.check_function_body(function, input_types, constants, bindings)
        finally:
            self.plugin_only += self.violations
            self.violations = before

    def check_function_body(
        self,
        function: onnx.FunctionProto,
        input_types: Sequence[onnx.TypeProto | None],
        constants: dict[str, ConstantSource],
        bindings: Mapping[str, onnx.AttributeProto] | None,
    ) -> None:
        key = (function.domain, function.name)
        if key in self.functions_active:  # recursion is invalid ONNX; don't loop on it
            return
        types_signature = tuple(t.SerializeToString() if t is not None else b"" for t in input_types)
        bindings_signature = (
            None
            if bindings is None
            else tuple(sorted((name, attr.SerializeToString()) for name, attr in bindings.items()))
        )
        constants_signature = tuple(sorted((name, id(source)) for name, source in constants.items()))
        body_key = (key, types_signature, bindings_signature, constants_signature)
        if body_key in self.bodies_checked:
            return
        self.bodies_checked.add(body_key)
        self.functions_entered.add(key)

        if bindings is None:
            nodes = list(function.node)
        else:
            nodes = _bind_attribute_refs(function.node, bindings)
        types_key = (key, types_signature, bindings_signature)
        value_types = self.function_body_types(function, nodes, input_types, types_key)
        where = f" in function '{function.domain}.{function.name}'"
        constants = dict(constants)
        _collect_constant_nodes(nodes, constants, value_types)
        # Formal inputs carry the caller's types, already reported at the call site.
        body_types = {name: t for name, t in value_types.items() if name not in function.input}
        self.violations += tensor_type_violations(body_types, where)
        self.functions_active.append(key)
        try:
            self.check_nodes(nodes, Scope(where=where, constants=constants, value_types=value_types))
        finally:
            self.functions_active.pop()

    def function_body_types(
        self,
        function: onnx.FunctionProto,
        nodes: Sequence[onnx.NodeProto],
        input_types: Sequence[onnx.TypeProto | None],
        cache_key: tuple,
    ) -> dict[str, onnx.TypeProto]:
        """Types inside a function body, inferred by wrapping it as a graph typed like its caller.

        Shape inference does not annotate function bodies, yet rules like CumSum's dtype matter
        most there (sampling helpers live in local functions).
        """
        if cache_key in self.body_types_cache:
            return dict(self.body_types_cache[cache_key])
        inputs = []
        for name, type_proto in zip(function.input, input_types):
            value = onnx.ValueInfoProto(name=name)
            if type_proto is not None:
                value.type.CopyFrom(type_proto)
            inputs.append(value)
        outputs = [onnx.ValueInfoProto(name=name) for name in function.output]
        probe = helper.make_model(
            helper.make_graph(nodes, f"{function.name}_body", inputs, outputs),
            opset_imports=list(function.opset_import),
            functions=list(self.model.functions),
            ir_version=self.model.ir_version or onnx.IR_VERSION,
        )
        inferred = _infer_shapes_or_keep(probe).graph
        types = _declared_types([*inferred.input, *inferred.value_info, *inferred.output])
        self.body_types_cache[cache_key] = types
        return dict(types)


# ---------------------------------------------------------------------------------------------
# Public API.


def tensorrt_report(model: onnx.ModelProto) -> tuple[list[str], list[str]]:
    """(violations, plugin_only): reasons TensorRT's ONNX parser would reject `model`, and reasons
    it could parse only with our plugin serving the local-function nodes that carry plugin attributes."""
    checker = _ModelChecker(_infer_shapes_or_keep(model))
    violations = checker.run()
    return violations, list(dict.fromkeys(checker.plugin_only))


def tensorrt_violations(model: onnx.ModelProto) -> list[str]:
    """Every reason TensorRT's ONNX parser would reject `model`, one message each; [] when fine.

    Bodies of plugin-served nodes count here too (as if no plugin were loaded)."""
    violations, plugin_only = tensorrt_report(model)
    return violations + plugin_only


def check_tensorrt_compatible(model: onnx.ModelProto, graph_name: str) -> list[str]:
    """Raise SpecCompileError naming `graph_name` and every offending node, on one line.

    Returns what parsing would need the speccompile plugin for (empty when the bodies parse too).
    """
    violations, plugin_only = tensorrt_report(model)
    if violations:
        details = "; ".join(" ".join(message.split()) for message in violations)  # keep it one line
        raise SpecCompileError(f"graph {graph_name} is not TensorRT-parsable: {details}")
    return plugin_only
