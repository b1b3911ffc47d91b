"""plugins/ builds: the kernels with nvcc alone and through CMake, with their C ABI exported.

Nothing here needs a GPU. The TensorRT plugin library is built (and looked up in TensorRT's plugin
registry) only where CMake finds TensorRT; elsewhere those tests skip and say so.
"""

import re
import shutil
import subprocess

import pytest
from onnx import TensorProto

from speccompile.compiler import spec_accept
from speccompile.compiler.onnx_graph import GraphBuilder
from speccompile.compiler.transformer import _sampling_inputs, accept_tree
from tests.plugins.kernels_lib import MAX_TREE_NODES, PLUGINS, SYMBOLS, exported_symbols, load_kernels

CUDA_ERROR_INVALID_VALUE = 1


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


# ---- nvcc alone ---------------------------------------------------------------------------------


def test_nvcc_builds_the_kernels_with_their_c_abi(kernels_library):
    assert set(SYMBOLS) <= exported_symbols(kernels_library("sm_80"))


def test_kernel_header_is_plain_c(tmp_path):
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH (it supplies the CUDA include path)")
    source = tmp_path / "uses_header.c"
    source.write_text('#include "spec_accept_kernels.h"\nint main(void) { return 0; }\n')
    run(["nvcc", "-x", "c", "-c", f"-I{PLUGINS / 'kernels'}", "-o", str(tmp_path / "uses_header.o"), str(source)])


def test_bad_arguments_are_refused_before_any_launch(kernels_library):
    """Argument checks return cudaErrorInvalidValue without touching the GPU, so they run anywhere."""
    lib = load_kernels(kernels_library("sm_80"))
    outs = [None] * 3
    greedy_ins, sample_ins = [None] * 4, [None] * 7
    assert lib.speccompile_greedy_accept(*greedy_ins, 2, 1, 0, *outs, None) == CUDA_ERROR_INVALID_VALUE  # V = 0
    assert lib.speccompile_greedy_accept(*greedy_ins, 2, 1, 8, *outs, None) == CUDA_ERROR_INVALID_VALUE  # NULLs
    assert lib.speccompile_sample_accept(*sample_ins, -1, 1, 8, *outs, None) == CUDA_ERROR_INVALID_VALUE  # B < 0
    fake = 256  # a device pointer that is never dereferenced: every call below is refused before a launch
    no_draft_len = [fake, fake, None, fake]  # draft_len is [B]: required even with γ = 0
    assert lib.speccompile_greedy_accept(*no_draft_len, 2, 0, 8, *[fake] * 3, None) == CUDA_ERROR_INVALID_VALUE
    no_draft_len = [fake, None, None, None, None, fake, fake]
    assert lib.speccompile_sample_accept(*no_draft_len, 2, 0, 8, *[fake] * 3, None) == CUDA_ERROR_INVALID_VALUE
    assert lib.speccompile_sample(None, None, 1, 8, None, None) == CUDA_ERROR_INVALID_VALUE
    assert lib.speccompile_transform(*[None] * 4, 2, 1, 0, None, None) == CUDA_ERROR_INVALID_VALUE  # V = 0
    assert lib.speccompile_transform(*[None] * 4, 2, -1, 8, None, None) == CUDA_ERROR_INVALID_VALUE  # R < 0
    assert lib.speccompile_transform(*[None] * 4, 2, 3, 8, None, None) == CUDA_ERROR_INVALID_VALUE  # NULLs
    big = 1 << 16  # B * R = 2^32 rows: more than a grid holds
    assert lib.speccompile_transform(*[fake] * 4, big, big, 8, fake, None) == CUDA_ERROR_INVALID_VALUE
    # An empty batch is a no-op, not an error.
    assert lib.speccompile_greedy_accept(*greedy_ins, 0, 4, 8, *outs, None) == 0
    assert lib.speccompile_sample_accept(*sample_ins, 0, 4, 8, *outs, None) == 0
    assert lib.speccompile_sample(None, None, 0, 8, None, None) == 0
    assert lib.speccompile_transform(*[None] * 4, 0, 3, 8, None, None) == 0
    assert lib.speccompile_transform(*[None] * 4, 2, 0, 8, None, None) == 0  # no rows


def test_tree_arguments_are_refused_before_any_launch(kernels_library):
    lib = load_kernels(kernels_library("sm_80"))
    fake, outs = 256, [256] * 4
    tree, typical = lib.speccompile_tree_accept, lib.speccompile_tree_typical_accept
    ins, typical_ins = [fake] * 6, [fake] * 8
    for B, N, V in [(-1, 4, 8), (2, 0, 8), (2, MAX_TREE_NODES + 1, 8), (2, 4, 0)]:  # bad sizes
        assert tree(*ins, B, N, V, *outs, None) == CUDA_ERROR_INVALID_VALUE, (B, N, V)
        assert typical(*typical_ins, B, N, V, *outs, None) == CUDA_ERROR_INVALID_VALUE, (B, N, V)
    for missing in range(6):  # every input is required, even with a single node
        assert tree(*ins[:missing], None, *ins[missing + 1:], 2, 1, 8, *outs, None) == CUDA_ERROR_INVALID_VALUE
    assert typical(*typical_ins[:6], None, fake, 2, 4, 8, *outs, None) == CUDA_ERROR_INVALID_VALUE  # epsilon
    assert typical(*typical_ins[:7], None, 2, 4, 8, *outs, None) == CUDA_ERROR_INVALID_VALUE  # delta
    assert tree(*ins, 2, 4, 8, *outs[:3], None, None) == CUDA_ERROR_INVALID_VALUE  # best_node
    # An empty batch is a no-op, not an error.
    assert tree(*[None] * 6, 0, 4, 8, *[None] * 4, None) == 0
    assert typical(*[None] * 8, 0, MAX_TREE_NODES, 8, *[None] * 4, None) == 0


def test_tree_node_limit_is_the_headers():
    header = (PLUGINS / "kernels" / "spec_accept_kernels.h").read_text()
    assert re.search(r"#define SPECCOMPILE_MAX_TREE_NODES (\d+)", header).group(1) == str(MAX_TREE_NODES)


# ---- the plugin's identity --------------------------------------------------------------------------


ONNX_TO_TRT = {TensorProto.FLOAT: "kFLOAT", TensorProto.INT64: "kINT64", TensorProto.BOOL: "kBOOL",
               TensorProto.UINT8: "kUINT8"}


def test_plugin_answers_to_what_the_onnx_node_asks_for():
    """TensorRT's parser looks the creator up by (op_type, plugin_version, plugin_namespace) and hands
    it the node's inputs in ONNX order, which enqueue() indexes by position: every mode of the ONNX
    function has a row in the plugin's mode table with its inputs (names and dtypes) and output count."""
    source = (PLUGINS / "tensorrt" / "spec_accept_plugin.cpp").read_text()
    constants = dict(re.findall(r'constexpr char const\* (k\w+) = "([^"]*)";', source))
    assert constants["kPLUGIN_VERSION"] == spec_accept.PLUGIN_VERSION
    assert constants["kPLUGIN_NAMESPACE"] == spec_accept.PLUGIN_NAMESPACE
    block = re.search(r"kMODES\[\] = \{(.*?)\n\};", source, re.S).group(1)
    modes = re.findall(r'\{"(\w+)", (k\w+), std::size\(\2\), (\d+)\}', block)
    assert [mode for mode, _, _ in modes] == [mode for op, mode in spec_accept.FUNCTIONS if op == "SpecAccept"]
    for mode, table, nb_outputs in modes:
        function = spec_accept.FUNCTIONS["SpecAccept", mode]()
        assert function.name == constants["kPLUGIN_NAME"]
        assert constants["kMODE_FIELD"] in function.attribute
        assert [name for _, name in dtype_table(source, table)] == list(function.input)
        assert int(nb_outputs) == len(function.output)
        assert list(function.output)[:3] == spec_accept.OUTPUTS  # enqueue() writes outputs 0..2 in every mode
    # The dtypes the tree graphs feed (the ONNX function declares none; the graph's tensors do).
    for table, typical in [("kTREE_INPUTS", False), ("kTREE_TYPICAL_INPUTS", True)]:
        assert dtype_table(source, table) == tree_node_dtypes(typical)
    assert re.search(r'extern "C" \w+ nvinfer1::IPluginCreatorInterface\* const\* '
                     r'getCreators\(int32_t& nbCreators\)', source)
    assert "REGISTER_TENSORRT_PLUGIN(SpecAcceptPluginCreator)" in source


def dtype_table(source: str, table: str) -> list[tuple[str, str]]:
    """[(DataType, tensor name)] of a `constexpr DataType table[] = {...}` in a plugin source."""
    block = re.search(r"\b" + table + r"\[\] = \{(.*?)\};", source, re.S).group(1)
    return re.findall(r"DataType::(k\w+),\s+// (\w+)", block)


def tree_node_dtypes(typical: bool) -> list[tuple[str, str]]:
    """[(DataType, ONNX function input)] of the tree SpecAccept node as transformer.accept_tree builds it,
    on float logits, int64 ids and past_len (what the verification graph hands it)."""
    g = GraphBuilder("tree")
    logits = g.input("logits", TensorProto.FLOAT, ["batch", "tree_nodes", "vocab"])
    ids = g.input("input_ids", TensorProto.INT64, ["batch", "tree_nodes"])
    accept_tree(g, logits, ids, g.input("past_len", TensorProto.INT64, ["batch"]), typical, vocab_out=64)
    [node] = [n for n in g.nodes if n.op_type == "SpecAccept"]
    declared = {v.name: ONNX_TO_TRT[v.type.tensor_type.elem_type] for v in g.inputs}
    declared |= {out: "kFLOAT" for n in g.nodes if n.op_type == "If" for out in n.output}  # the grammar-masked logits
    function = spec_accept.FUNCTIONS["SpecAccept", "tree_typical" if typical else "tree"]()
    return [(declared[tensor], name) for tensor, name in zip(node.input, function.input, strict=True)]


def test_sampling_plugins_answer_to_what_the_onnx_nodes_ask_for():
    """SpecTransform and SpecSample: identity, the `mode` field, and the inputs and outputs in ONNX order
    with the dtypes the graphs feed them (speccompile/compiler/transformer.py)."""
    source = (PLUGINS / "tensorrt" / "spec_sampling_plugins.cpp").read_text()
    constants = dict(re.findall(r'constexpr char const\* (k\w+) = "([^"]*)";', source))
    assert constants["kPLUGIN_VERSION"] == spec_accept.PLUGIN_VERSION
    assert constants["kPLUGIN_NAMESPACE"] == spec_accept.PLUGIN_NAMESPACE
    # The graphs' tensors: sampling controls as transformer._sampling_inputs declares them, the rest fixed.
    g = GraphBuilder("controls")
    _sampling_inputs(g)
    trt_types = {TensorProto.FLOAT: "kFLOAT", TensorProto.INT64: "kINT64"}
    dtypes = {v.name: trt_types[v.type.tensor_type.elem_type] for v in g.inputs}
    dtypes.update(logits="kFLOAT", probs="kFLOAT", uniform="kFLOAT", token="kINT64")
    functions = [("TRANSFORM", spec_accept.spec_transform_function(64)), ("SAMPLE", spec_accept.spec_sample_function())]
    for prefix, function in functions:
        assert function.name == constants[f"k{prefix}_NAME"]
        assert constants["kMODE_FIELD"] in function.attribute
        for table, names in [("INPUTS", function.input), ("OUTPUTS", function.output)]:
            entries = dtype_table(source, f"k{prefix}_{table}")
            assert [name for _, name in entries] == list(names)
            assert [dtype for dtype, _ in entries] == [dtypes[name] for name in names]
        # The node's `mode` is what the plugin serializes.
        g = GraphBuilder("node")
        spec_accept.spec_op(g, function.name, *function.input, out=list(function.output)[0], vocab_size=64)
        [node] = [n for n in g.nodes if n.op_type == function.name]
        assert {a.name: a.s.decode() for a in node.attribute}[constants["kMODE_FIELD"]] == constants["kMODE_DEFAULT"]
        assert f"REGISTER_TENSORRT_PLUGIN({function.name}PluginCreator)" in source
    # loadLibrary registers what getCreators() returns: all three ops.
    entry = (PLUGINS / "tensorrt" / "spec_accept_plugin.cpp").read_text().split("getCreators(int32_t& nbCreators)")[1]
    for op in ("SpecAccept", "SpecTransform", "SpecSample"):
        assert f"speccompile::{op}PluginCreator " in entry


# ---- CMake ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cmake_build(tmp_path_factory):
    """plugins/ configured for one architecture: (build dir, configure log)."""
    if shutil.which("cmake") is None or shutil.which("nvcc") is None:
        pytest.skip("cmake and nvcc are both needed to build plugins/")
    build = tmp_path_factory.mktemp("plugins-build")
    configure = run(["cmake", "-S", str(PLUGINS), "-B", str(build), "-DCMAKE_CUDA_ARCHITECTURES=80",
                     "-DCMAKE_BUILD_TYPE=Release"])
    return build, configure.stdout


@pytest.fixture(scope="module")
def plugin_library(cmake_build):
    build, log = cmake_build
    if "TensorRT found" not in log:
        pytest.skip("CMake found no TensorRT headers/libnvinfer (set TensorRT_ROOT): "
                    "the plugin library is not built here")
    run(["cmake", "--build", str(build), "--target", "speccompile_plugins", "-j", "2"])
    return build / "libspeccompile_plugins.so"


def test_cmake_builds_the_kernels_library(cmake_build):
    build, log = cmake_build
    assert "speccompile_plugins" in log  # says whether the TensorRT plugin is part of this build
    run(["cmake", "--build", str(build), "--target", "speccompile_kernels", "-j", "2"])
    assert set(SYMBOLS) <= exported_symbols(build / "libspeccompile_kernels.so")


def test_cmake_builds_the_plugin_library_with_its_loader_entry_points(plugin_library):
    assert {"getCreators", "setLoggerFinder", *SYMBOLS} <= exported_symbols(plugin_library)


@pytest.mark.tensorrt
def test_tensorrt_registry_finds_the_creators(plugin_library):
    trt = pytest.importorskip("tensorrt")
    registry = trt.get_plugin_registry()
    assert registry.load_library(str(plugin_library)) is not None
    for op in ("SpecAccept", "SpecTransform", "SpecSample"):
        creator = registry.get_creator(op, spec_accept.PLUGIN_VERSION, spec_accept.PLUGIN_NAMESPACE)
        assert creator is not None, op
