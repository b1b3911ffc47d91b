/*
 * The SpecAccept plugin's build- and run-time logic on the host: mode parsing, arity, formats, shape
 * inference and checks, serialization, and the arguments enqueue() hands each kernel. TensorRT's
 * libraries and a GPU are not needed: the plugin sources compile against TensorRT's headers with
 * SPECCOMPILE_NO_STATIC_REGISTRATION (the only call into libnvinfer), and the kernels' C ABI is
 * replaced by stubs that record their arguments. Exit status 0 when every check holds; each failure is
 * printed. Built and run by test_plugin_host.py.
 */
#include "spec_accept_kernels.h"
#include "spec_accept_plugin.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

using nvinfer1::DataType;
using nvinfer1::Dims;
using nvinfer1::DynamicPluginTensorDesc;
using nvinfer1::PluginField;
using nvinfer1::PluginFieldCollection;
using nvinfer1::PluginFieldType;
using nvinfer1::PluginTensorDesc;
using nvinfer1::TensorFormat;
using speccompile::SpecAcceptPlugin;

namespace
{

int gFailures = 0;

void check(bool ok, std::string const& what)
{
    if (!ok)
    {
        std::printf("FAILED: %s\n", what.c_str());
        ++gFailures;
    }
}

// ---- stub kernels: the last call's name and arguments ----------------------------------------------

struct Call
{
    std::string name;
    std::vector<void const*> pointers; // in argument order, outputs included
    std::vector<int> sizes;            // B, G or N, V (B, V for sample; B, R, V for transform)
};
Call gCall;

int record(char const* name, std::initializer_list<void const*> pointers, std::initializer_list<int> sizes)
{
    gCall = Call{name, pointers, sizes};
    return 0;
}

} // namespace

extern "C" int speccompile_greedy_accept(const float* logits, const int64_t* draft_tokens, const int64_t* draft_len,
    const int64_t* past_len, int B, int G, int V, int64_t* accepted, int64_t* next_token, int64_t* new_len,
    cudaStream_t)
{
    return record("greedy", {logits, draft_tokens, draft_len, past_len, accepted, next_token, new_len}, {B, G, V});
}

extern "C" int speccompile_sample_accept(const float* target_probs, const float* draft_probs,
    const int64_t* draft_tokens, const int64_t* draft_len, const float* u_accept, const float* u_sample,
    const int64_t* past_len, int B, int G, int V, int64_t* accepted, int64_t* next_token, int64_t* new_len,
    cudaStream_t)
{
    return record("sample",
        {target_probs, draft_probs, draft_tokens, draft_len, u_accept, u_sample, past_len, accepted, next_token,
            new_len},
        {B, G, V});
}

extern "C" int speccompile_sample(const float* probs, const float* uniform, int B, int V, int64_t* token, cudaStream_t)
{
    return record("draw", {probs, uniform, token}, {B, V});
}

extern "C" int speccompile_transform(const float* logits, const float* temperature, const int64_t* top_k,
    const float* top_p, int B, int R, int V, float* probs, cudaStream_t)
{
    return record("transform", {logits, temperature, top_k, top_p, probs}, {B, R, V});
}

extern "C" int speccompile_tree_accept(const float* logits, const int64_t* tree_tokens, const int64_t* draft_len,
    const int64_t* past_len, const int64_t* tree_parents, const int64_t* tree_depths, int B, int N, int V,
    int64_t* accepted, int64_t* next_token, int64_t* new_len, int64_t* best_node, cudaStream_t)
{
    return record("tree",
        {logits, tree_tokens, draft_len, past_len, tree_parents, tree_depths, accepted, next_token, new_len,
            best_node},
        {B, N, V});
}

extern "C" int speccompile_tree_typical_accept(const float* logits, const int64_t* tree_tokens,
    const int64_t* draft_len, const int64_t* past_len, const int64_t* tree_parents, const int64_t* tree_depths,
    const float* epsilon, const float* delta, int B, int N, int V, int64_t* accepted, int64_t* next_token,
    int64_t* new_len, int64_t* best_node, cudaStream_t)
{
    return record("tree_typical",
        {logits, tree_tokens, draft_len, past_len, tree_parents, tree_depths, epsilon, delta, accepted, next_token,
            new_len, best_node},
        {B, N, V});
}

namespace
{

// ---- one mode's tensors ----------------------------------------------------------------------------

struct Mode
{
    char const* name;
    std::vector<DataType> inputs;
    int32_t nbOutputs;
};

// The ONNX function's inputs (speccompile/compiler/spec_accept.py), with B = 2, γ = 3 (4 positions) or N = 5
// nodes, V = 7.
constexpr int64_t kB = 2, kPositions = 5, kV = 7;

std::vector<Dims> shapesOf(std::string const& mode)
{
    auto dims = [](std::initializer_list<int64_t> d) {
        Dims out{};
        out.nbDims = static_cast<int32_t>(d.size());
        std::copy(d.begin(), d.end(), out.d);
        return out;
    };
    int64_t const B = kB, P = kPositions, V = kV, G = P - 1, N = P;
    if (mode == "greedy")
        return {dims({B, P, V}), dims({B, G}), dims({B}), dims({B})};
    if (mode == "sample")
        return {dims({B, P, V}), dims({B, G, V}), dims({B, G}), dims({B}), dims({B, G}), dims({B}), dims({B})};
    std::vector<Dims> tree{dims({B, N, V}), dims({B, N}), dims({B}), dims({B}), dims({N}), dims({N}), dims({N, N})};
    if (mode == "tree_typical")
        tree.insert(tree.end(), {dims({B}), dims({B})});
    return tree;
}

std::unique_ptr<SpecAcceptPlugin> create(char const* mode, bool withNul)
{
    static speccompile::SpecAcceptPluginCreator creator;
    // The ONNX parser passes the attribute's bytes; getFieldsToSerialize() includes the NUL.
    PluginField field("mode", mode, PluginFieldType::kCHAR, static_cast<int32_t>(std::strlen(mode) + withNul));
    PluginFieldCollection fields{1, &field};
    auto* plugin = creator.createPlugin("node", &fields, nvinfer1::TensorRTPhase::kBUILD);
    return std::unique_ptr<SpecAcceptPlugin>(static_cast<SpecAcceptPlugin*>(plugin));
}

std::vector<DynamicPluginTensorDesc> describe(Mode const& mode)
{
    std::vector<DynamicPluginTensorDesc> inOut(mode.inputs.size() + mode.nbOutputs);
    for (size_t i = 0; i < inOut.size(); ++i)
    {
        inOut[i].desc.type = i < mode.inputs.size() ? mode.inputs[i] : DataType::kINT64;
        inOut[i].desc.format = TensorFormat::kLINEAR;
    }
    return inOut;
}

// A builder that is never asked to build: the plugin's outputs reuse input 0's leading expression.
struct UnusedExprBuilder : nvinfer1::IExprBuilder
{
};

void checkBuild(SpecAcceptPlugin& plugin, Mode const& mode)
{
    std::string const name = mode.name;
    int32_t const nbInputs = static_cast<int32_t>(mode.inputs.size()), nbOutputs = mode.nbOutputs;
    check(plugin.getNbOutputs() == nbOutputs, name + ": getNbOutputs");
    std::vector<DataType> types(nbOutputs, DataType::kFLOAT);
    check(plugin.getOutputDataTypes(types.data(), nbOutputs, mode.inputs.data(), nbInputs) == 0, name + ": types");
    for (DataType type : types)
        check(type == DataType::kINT64, name + ": every output is int64");
    check(plugin.getOutputDataTypes(types.data(), nbOutputs - 1, mode.inputs.data(), nbInputs) != 0,
        name + ": one output too few is refused");

    auto inOut = describe(mode);
    for (int32_t pos = 0; pos < nbInputs + nbOutputs; ++pos)
    {
        check(plugin.supportsFormatCombination(pos, inOut.data(), nbInputs, nbOutputs),
            name + ": format of tensor " + std::to_string(pos));
        auto wrong = inOut;
        wrong[pos].desc.type = wrong[pos].desc.type == DataType::kINT32 ? DataType::kHALF : DataType::kINT32;
        check(!plugin.supportsFormatCombination(pos, wrong.data(), nbInputs, nbOutputs),
            name + ": a wrong type at tensor " + std::to_string(pos) + " is refused");
    }
    check(!plugin.supportsFormatCombination(0, inOut.data(), nbInputs, nbOutputs - 1), name + ": wrong arity");
    check(plugin.configurePlugin(inOut.data(), nbInputs, inOut.data() + nbInputs, nbOutputs) == 0,
        name + ": configure");

    // Every output is [B], B being input 0's first dimension expression (any pointer: it is only copied).
    std::vector<nvinfer1::DimsExprs> in(nbInputs), out(nbOutputs);
    auto const* batch = reinterpret_cast<nvinfer1::IDimensionExpr const*>(&in);
    in[0].nbDims = 3;
    in[0].d[0] = batch;
    UnusedExprBuilder builder;
    check(plugin.getOutputShapes(in.data(), nbInputs, nullptr, 0, out.data(), nbOutputs, builder) == 0,
        name + ": output shapes");
    for (auto const& shape : out)
        check(shape.nbDims == 1 && shape.d[0] == batch, name + ": outputs are [B]");
}

std::vector<PluginTensorDesc> tensors(std::vector<Dims> const& shapes)
{
    std::vector<PluginTensorDesc> descs(shapes.size());
    for (size_t i = 0; i < shapes.size(); ++i)
        descs[i].dims = shapes[i];
    return descs;
}

void checkShapes(SpecAcceptPlugin& plugin, Mode const& mode)
{
    std::string const name = mode.name;
    auto const shapes = shapesOf(name);
    int32_t const nbInputs = static_cast<int32_t>(shapes.size());
    auto out = tensors(std::vector<Dims>(mode.nbOutputs));
    check(plugin.onShapeChange(tensors(shapes).data(), nbInputs, out.data(), mode.nbOutputs) == 0, name + ": shapes");
    for (int32_t i = 1; i < nbInputs; ++i)
    {
        auto wrong = shapes;
        wrong[i].d[wrong[i].nbDims - 1] += 1; // the last extent off by one
        check(plugin.onShapeChange(tensors(wrong).data(), nbInputs, out.data(), mode.nbOutputs) != 0,
            name + ": a wrong shape of input " + std::to_string(i) + " is refused");
    }
    if (name.rfind("tree", 0) == 0)
    {
        // Past SPECCOMPILE_MAX_TREE_NODES the kernels have no room for the tree's nodes.
        for (int64_t n : {int64_t{SPECCOMPILE_MAX_TREE_NODES}, int64_t{SPECCOMPILE_MAX_TREE_NODES} + 1})
        {
            auto large = shapes;
            large[0].d[1] = large[1].d[1] = large[4].d[0] = large[5].d[0] = large[6].d[0] = large[6].d[1] = n;
            bool const fits = n <= SPECCOMPILE_MAX_TREE_NODES;
            check((plugin.onShapeChange(tensors(large).data(), nbInputs, out.data(), mode.nbOutputs) == 0) == fits,
                name + ": N = " + std::to_string(n) + (fits ? " is accepted" : " is refused"));
        }
    }
}

void checkEnqueue(SpecAcceptPlugin& plugin, Mode const& mode)
{
    std::string const name = mode.name;
    auto const shapes = shapesOf(name);
    auto const in = tensors(shapes), out = tensors(std::vector<Dims>(mode.nbOutputs));
    // Distinct fake device addresses: inputs at 0x1000 + 0x100 i, outputs at 0x9000 + 0x100 j.
    std::vector<void const*> inputs;
    std::vector<void*> outputs;
    for (size_t i = 0; i < shapes.size(); ++i)
        inputs.push_back(reinterpret_cast<void const*>(0x1000 + 0x100 * i));
    for (int32_t j = 0; j < mode.nbOutputs; ++j)
        outputs.push_back(reinterpret_cast<void*>(0x9000 + 0x100 * j));
    gCall = Call{};
    check(plugin.enqueue(in.data(), out.data(), inputs.data(), outputs.data(), nullptr, nullptr) == 0, name + ": run");
    check(gCall.name == name, name + ": runs its own kernel, not " + gCall.name);

    // What each kernel must receive: the ONNX inputs in order (the tree mask, input 6, is not an argument),
    // then the outputs in order.
    std::vector<void const*> expected(inputs.begin(), inputs.end());
    if (name.rfind("tree", 0) == 0)
        expected.erase(expected.begin() + 6);
    expected.insert(expected.end(), outputs.begin(), outputs.end());
    check(gCall.pointers == expected, name + ": tensors in argument order");
    int const second = name.rfind("tree", 0) == 0 ? kPositions : kPositions - 1; // N nodes, or γ drafts
    check(gCall.sizes == std::vector<int>({kB, second, kV}), name + ": sizes");
}

void checkMode(Mode const& mode)
{
    for (bool withNul : {false, true})
    {
        auto plugin = create(mode.name, withNul);
        check(plugin != nullptr, std::string(mode.name) + ": created");
        if (plugin == nullptr)
            return;
        // The engine rebuilds the plugin from getFieldsToSerialize(): it must name the same mode.
        PluginFieldCollection const* fields = plugin->getFieldsToSerialize();
        check(fields->nbFields == 1 && std::strcmp(static_cast<char const*>(fields->fields[0].data), mode.name) == 0,
            std::string(mode.name) + ": serializes its mode");
        checkBuild(*plugin, mode);
        checkShapes(*plugin, mode);
        checkEnqueue(*plugin, mode);
    }
}

} // namespace

int main()
{
    auto const f = DataType::kFLOAT, i = DataType::kINT64, b = DataType::kBOOL;
    Mode const modes[] = {
        {"greedy", {f, i, i, i}, 3},
        {"sample", {f, f, i, i, f, f, i}, 3},
        {"tree", {f, i, i, i, i, i, b}, 4},
        {"tree_typical", {f, i, i, i, i, i, b, f, f}, 4},
    };
    for (Mode const& mode : modes)
        checkMode(mode);
    check(create("trees", false) == nullptr, "an unknown mode is refused");
    check(create("tree_", false) == nullptr, "a mode's prefix is not the mode");
    std::printf(gFailures == 0 ? "all checks hold\n" : "%d checks failed\n", gFailures);
    return gFailures == 0 ? 0 : 1;
}
