/*
 * The SpecAccept IPluginV3 (see spec_accept_plugin.h): shapes, types and registration for TensorRT;
 * the rule itself runs in the CUDA kernels of plugins/kernels. The library's entry points
 * (setLoggerFinder, getCreators) live here too and serve SpecTransform and SpecSample as well
 * (spec_sampling_plugins.cpp).
 */
#include "spec_accept_plugin.h"

#include "spec_accept_kernels.h"
#include "spec_sampling_plugins.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <iostream>
#include <iterator>
#include <limits>

#if defined(_WIN32)
#define SPECCOMPILE_PLUGIN_API __declspec(dllexport)
#else
#define SPECCOMPILE_PLUGIN_API __attribute__((visibility("default")))
#endif

using nvinfer1::DataType;
using nvinfer1::Dims;
using nvinfer1::DimsExprs;
using nvinfer1::DynamicPluginTensorDesc;
using nvinfer1::PluginField;
using nvinfer1::PluginFieldCollection;
using nvinfer1::PluginFieldType;
using nvinfer1::PluginTensorDesc;
using nvinfer1::TensorFormat;

namespace speccompile
{
namespace
{

// The identity the ONNX node asks for: op_type, plugin_version, plugin_namespace.
constexpr char const* kPLUGIN_NAME = "SpecAccept";
constexpr char const* kPLUGIN_VERSION = "1";
constexpr char const* kPLUGIN_NAMESPACE = "speccompile";
constexpr char const* kMODE_FIELD = "mode";

// Input dtypes in ONNX input order (test_kernels_build.py holds them to the ONNX function's inputs).
constexpr DataType kGREEDY_INPUTS[] = {
    DataType::kFLOAT, // target_logits [B, γ+1, V]
    DataType::kINT64, // draft_tokens  [B, γ]
    DataType::kINT64, // draft_len     [B]
    DataType::kINT64, // past_len      [B]
};
constexpr DataType kSAMPLE_INPUTS[] = {
    DataType::kFLOAT, // target_probs  [B, γ+1, V]
    DataType::kFLOAT, // draft_probs   [B, γ, V]
    DataType::kINT64, // draft_tokens  [B, γ]
    DataType::kINT64, // draft_len     [B]
    DataType::kFLOAT, // u_accept      [B, γ]
    DataType::kFLOAT, // u_sample      [B]
    DataType::kINT64, // past_len      [B]
};
// The mask is bool, as the graph feeds it: PluginTensorDesc's documentation still warns that kBOOL is
// unsupported, yet plugins in TensorRT's own repository (PointPillarScatter) declare kBOOL inputs. The
// kernels never read it, since walking tree_parents decides the same paths; it is an input only because the
// node has it.
constexpr DataType kTREE_INPUTS[] = {
    DataType::kFLOAT, // target_logits [B, N, V]
    DataType::kINT64, // tree_tokens   [B, N]
    DataType::kINT64, // draft_len     [B]
    DataType::kINT64, // past_len      [B]
    DataType::kINT64, // tree_parents  [N]
    DataType::kINT64, // tree_depths   [N]
    DataType::kBOOL,  // tree_mask     [N, N]
};
constexpr DataType kTREE_TYPICAL_INPUTS[] = {
    DataType::kFLOAT, // target_logits [B, N, V]
    DataType::kINT64, // tree_tokens   [B, N]
    DataType::kINT64, // draft_len     [B]
    DataType::kINT64, // past_len      [B]
    DataType::kINT64, // tree_parents  [N]
    DataType::kINT64, // tree_depths   [N]
    DataType::kBOOL,  // tree_mask     [N, N]
    DataType::kFLOAT, // epsilon       [B]
    DataType::kFLOAT, // delta         [B]
};

// What each mode is, indexed by AcceptMode. Every output is i64 [B]: accepted, next_token, new_len, and
// for trees best_node.
struct ModeSpec
{
    char const* name; // the node's `mode`
    DataType const* inputs;
    int32_t nbInputs;
    int32_t nbOutputs;
};
constexpr ModeSpec kMODES[] = {
    {"greedy", kGREEDY_INPUTS, std::size(kGREEDY_INPUTS), 3},
    {"sample", kSAMPLE_INPUTS, std::size(kSAMPLE_INPUTS), 3},
    {"tree", kTREE_INPUTS, std::size(kTREE_INPUTS), 4},
    {"tree_typical", kTREE_TYPICAL_INPUTS, std::size(kTREE_TYPICAL_INPUTS), 4},
};

ModeSpec const& specOf(AcceptMode mode)
{
    return kMODES[static_cast<int32_t>(mode)];
}

bool isTree(AcceptMode mode)
{
    return mode == AcceptMode::kTREE || mode == AcceptMode::kTREE_TYPICAL;
}

bool hasArity(AcceptMode mode, int32_t nbInputs, int32_t nbOutputs)
{
    return nbInputs == specOf(mode).nbInputs && nbOutputs == specOf(mode).nbOutputs;
}

// ---------------------------------------------------------------------------------------------
// Logging: TensorRT hands a logger finder to libraries it loads (setLoggerFinder below).

std::atomic<nvinfer1::ILoggerFinder*> gLoggerFinder{nullptr};

} // namespace

void logError(char const* message) noexcept
{
    nvinfer1::ILoggerFinder* finder = gLoggerFinder.load();
    nvinfer1::ILogger* logger = finder != nullptr ? finder->findLogger() : nullptr;
    if (logger != nullptr)
    {
        logger->log(nvinfer1::ILogger::Severity::kERROR, message);
        return;
    }
    std::cerr << "[speccompile] " << message << std::endl;
}

namespace
{

// ---------------------------------------------------------------------------------------------
// Fields and shapes

// `mode` arrives as kCHAR; whether `length` counts a terminating NUL differs between callers (the ONNX
// parser copies the attribute's bytes, getFieldsToSerialize below includes the NUL), so stop at the
// first NUL. A missing `mode` means greedy, the rule the node's ONNX function body implements.
bool parseMode(PluginFieldCollection const* fc, AcceptMode& mode)
{
    mode = AcceptMode::kGREEDY;
    for (int32_t i = 0; fc != nullptr && i < fc->nbFields; ++i)
    {
        PluginField const& field = fc->fields[i];
        if (field.name == nullptr || std::strcmp(field.name, kMODE_FIELD) != 0)
            continue; // plugin_namespace, plugin_version, ...: not ours to read
        if (field.type != PluginFieldType::kCHAR || field.data == nullptr || field.length < 0)
            return false;
        char const* text = static_cast<char const*>(field.data);
        std::string const value(text, std::find(text, text + field.length, '\0'));
        auto const known = std::find_if(
            std::begin(kMODES), std::end(kMODES), [&value](ModeSpec const& spec) { return value == spec.name; });
        if (known == std::end(kMODES))
            return false;
        mode = static_cast<AcceptMode>(known - std::begin(kMODES));
    }
    return true;
}

bool isShape(Dims const& dims, std::initializer_list<int64_t> shape)
{
    if (dims.nbDims != static_cast<int32_t>(shape.size()))
        return false;
    return std::equal(shape.begin(), shape.end(), dims.d);
}

// The inputs agree with input 0 = [B, γ+1, V] (trees: [B, N, V], N <= SPECCOMPILE_MAX_TREE_NODES), and
// B, γ, V fit the kernels' int arguments.
bool shapesAgree(AcceptMode mode, PluginTensorDesc const* in)
{
    Dims const& scores = in[0].dims;
    int64_t const kMax = std::numeric_limits<int32_t>::max();
    if (scores.nbDims != 3 || scores.d[0] < 0 || scores.d[0] > kMax || scores.d[1] < 1 || scores.d[1] > kMax
        || scores.d[2] < 1 || scores.d[2] > kMax)
        return false;
    int64_t const B = scores.d[0], G = scores.d[1] - 1, N = scores.d[1], V = scores.d[2];
    switch (mode)
    {
    case AcceptMode::kGREEDY:
        return isShape(in[1].dims, {B, G}) && isShape(in[2].dims, {B}) && isShape(in[3].dims, {B});
    case AcceptMode::kSAMPLE:
        return isShape(in[1].dims, {B, G, V}) && isShape(in[2].dims, {B, G}) && isShape(in[3].dims, {B})
            && isShape(in[4].dims, {B, G}) && isShape(in[5].dims, {B}) && isShape(in[6].dims, {B});
    case AcceptMode::kTREE:
    case AcceptMode::kTREE_TYPICAL:
        break;
    }
    bool const tree = N <= SPECCOMPILE_MAX_TREE_NODES && isShape(in[1].dims, {B, N}) && isShape(in[2].dims, {B})
        && isShape(in[3].dims, {B}) && isShape(in[4].dims, {N}) && isShape(in[5].dims, {N})
        && isShape(in[6].dims, {N, N});
    if (mode == AcceptMode::kTREE)
        return tree;
    return tree && isShape(in[7].dims, {B}) && isShape(in[8].dims, {B});
}

} // namespace

// ---------------------------------------------------------------------------------------------
// SpecAcceptPlugin

SpecAcceptPlugin::SpecAcceptPlugin(AcceptMode mode)
    : mMode(mode)
    , mModeName(specOf(mode).name)
    , mModeField(kMODE_FIELD, mModeName.c_str(), PluginFieldType::kCHAR, static_cast<int32_t>(mModeName.size() + 1))
    , mFields{1, &mModeField}
{
}

nvinfer1::IPluginCapability* SpecAcceptPlugin::getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept
{
    switch (type)
    {
    case nvinfer1::PluginCapabilityType::kCORE: return static_cast<nvinfer1::IPluginV3OneCore*>(this);
    case nvinfer1::PluginCapabilityType::kBUILD: return static_cast<nvinfer1::IPluginV3OneBuild*>(this);
    case nvinfer1::PluginCapabilityType::kRUNTIME: return static_cast<nvinfer1::IPluginV3OneRuntime*>(this);
    }
    return nullptr;
}

nvinfer1::IPluginV3* SpecAcceptPlugin::clone() noexcept
{
    try
    {
        return new SpecAcceptPlugin(mMode);
    }
    catch (std::exception const& e)
    {
        logError(e.what());
    }
    return nullptr;
}

char const* SpecAcceptPlugin::getPluginName() const noexcept
{
    return kPLUGIN_NAME;
}

char const* SpecAcceptPlugin::getPluginVersion() const noexcept
{
    return kPLUGIN_VERSION;
}

char const* SpecAcceptPlugin::getPluginNamespace() const noexcept
{
    return kPLUGIN_NAMESPACE;
}

int32_t SpecAcceptPlugin::getNbOutputs() const noexcept
{
    return specOf(mMode).nbOutputs;
}

int32_t SpecAcceptPlugin::getOutputDataTypes(
    DataType* outputTypes, int32_t nbOutputs, DataType const* /*inputTypes*/, int32_t nbInputs) const noexcept
{
    if (!hasArity(mMode, nbInputs, nbOutputs))
        return -1;
    std::fill(outputTypes, outputTypes + nbOutputs, DataType::kINT64);
    return 0;
}

int32_t SpecAcceptPlugin::getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const* /*shapeInputs*/,
    int32_t /*nbShapeInputs*/, DimsExprs* outputs, int32_t nbOutputs, nvinfer1::IExprBuilder& /*exprBuilder*/) noexcept
{
    if (!hasArity(mMode, nbInputs, nbOutputs) || inputs[0].nbDims != 3)
    {
        logError("SpecAccept: expected input 0 of shape [B, gamma+1, V] (trees: [B, N, V]) and the mode's number "
                 "of inputs and outputs");
        return -1;
    }
    // One value per sequence: every output is [B], B being input 0's leading dimension expression.
    for (int32_t i = 0; i < nbOutputs; ++i)
    {
        outputs[i].nbDims = 1;
        outputs[i].d[0] = inputs[0].d[0];
    }
    return 0;
}

bool SpecAcceptPlugin::supportsFormatCombination(
    int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept
{
    if (!hasArity(mMode, nbInputs, nbOutputs) || pos < 0 || pos >= nbInputs + nbOutputs)
        return false;
    DataType const expected = pos < nbInputs ? specOf(mMode).inputs[pos] : DataType::kINT64;
    return inOut[pos].desc.format == TensorFormat::kLINEAR && inOut[pos].desc.type == expected;
}

int32_t SpecAcceptPlugin::configurePlugin(
    DynamicPluginTensorDesc const* /*in*/, int32_t nbInputs, DynamicPluginTensorDesc const* /*out*/,
    int32_t nbOutputs) noexcept
{
    return hasArity(mMode, nbInputs, nbOutputs) ? 0 : -1;
}

int32_t SpecAcceptPlugin::onShapeChange(
    PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const* /*out*/, int32_t nbOutputs) noexcept
{
    if (hasArity(mMode, nbInputs, nbOutputs) && shapesAgree(mMode, in))
        return 0;
    logError("SpecAccept: input shapes disagree with input 0 = [B, gamma+1, V] (trees: [B, N, V] with N <= "
             "SPECCOMPILE_MAX_TREE_NODES), or exceed int32");
    return -1;
}

int32_t SpecAcceptPlugin::enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* /*outputDesc*/,
    void const* const* inputs, void* const* outputs, void* /*workspace*/, cudaStream_t stream) noexcept
{
    Dims const& scores = inputDesc[0].dims; // [B, γ+1, V] or [B, N, V], checked by onShapeChange
    int const B = static_cast<int>(scores.d[0]);
    int const G = static_cast<int>(scores.d[1] - 1);
    int const N = static_cast<int>(scores.d[1]);
    int const V = static_cast<int>(scores.d[2]);
    auto* accepted = static_cast<int64_t*>(outputs[0]);
    auto* nextToken = static_cast<int64_t*>(outputs[1]);
    auto* newLen = static_cast<int64_t*>(outputs[2]);
    auto* bestNode = isTree(mMode) ? static_cast<int64_t*>(outputs[3]) : nullptr;
    auto f32 = [inputs](int32_t i) { return static_cast<float const*>(inputs[i]); };
    auto i64 = [inputs](int32_t i) { return static_cast<int64_t const*>(inputs[i]); };
    // Inputs in the order of the mode's table (kGREEDY_INPUTS, ...); the trees' input 6, tree_mask, is not read.
    switch (mMode)
    {
    case AcceptMode::kGREEDY:
        return speccompile_greedy_accept(f32(0), i64(1), i64(2), i64(3), B, G, V, accepted, nextToken, newLen, stream);
    case AcceptMode::kSAMPLE:
        return speccompile_sample_accept(
            f32(0), f32(1), i64(2), i64(3), f32(4), f32(5), i64(6), B, G, V, accepted, nextToken, newLen, stream);
    case AcceptMode::kTREE:
        return speccompile_tree_accept(
            f32(0), i64(1), i64(2), i64(3), i64(4), i64(5), B, N, V, accepted, nextToken, newLen, bestNode, stream);
    case AcceptMode::kTREE_TYPICAL:
        return speccompile_tree_typical_accept(f32(0), i64(1), i64(2), i64(3), i64(4), i64(5), f32(7), f32(8), B, N,
            V, accepted, nextToken, newLen, bestNode, stream);
    }
    return -1;
}

nvinfer1::IPluginV3* SpecAcceptPlugin::attachToContext(nvinfer1::IPluginResourceContext* /*context*/) noexcept
{
    return clone(); // no per-context resources
}

PluginFieldCollection const* SpecAcceptPlugin::getFieldsToSerialize() noexcept
{
    return &mFields; // handed back to createPlugin(..., TensorRTPhase::kRUNTIME) on deserialization
}

// ---------------------------------------------------------------------------------------------
// SpecAcceptPluginCreator

SpecAcceptPluginCreator::SpecAcceptPluginCreator()
    : mModeField(kMODE_FIELD, nullptr, PluginFieldType::kCHAR, 0)
    , mFields{1, &mModeField}
{
}

char const* SpecAcceptPluginCreator::getPluginName() const noexcept
{
    return kPLUGIN_NAME;
}

char const* SpecAcceptPluginCreator::getPluginVersion() const noexcept
{
    return kPLUGIN_VERSION;
}

char const* SpecAcceptPluginCreator::getPluginNamespace() const noexcept
{
    return kPLUGIN_NAMESPACE;
}

PluginFieldCollection const* SpecAcceptPluginCreator::getFieldNames() noexcept
{
    return &mFields;
}

nvinfer1::IPluginV3* SpecAcceptPluginCreator::createPlugin(
    char const* /*name*/, PluginFieldCollection const* fc, nvinfer1::TensorRTPhase /*phase*/) noexcept
{
    // Both phases rebuild from the same single field: the build phase gets the ONNX attributes, the
    // runtime phase what getFieldsToSerialize() wrote.
    try
    {
        AcceptMode mode{};
        if (parseMode(fc, mode))
            return new SpecAcceptPlugin(mode);
        logError("SpecAccept: field `mode` must be the string \"greedy\", \"sample\", \"tree\" or "
                 "\"tree_typical\"");
    }
    catch (std::exception const& e)
    {
        logError(e.what());
    }
    return nullptr;
}

// Static registration: the creator is registered when the library is loaded (dlopen / ctypes).
// IPluginRegistry::loadLibrary registers what getCreators() returns as well; define
// SPECCOMPILE_NO_STATIC_REGISTRATION (CMake: -DSPECCOMPILE_STATIC_REGISTRATION=OFF) for a library that
// registers through getCreators() only.
#ifndef SPECCOMPILE_NO_STATIC_REGISTRATION
REGISTER_TENSORRT_PLUGIN(SpecAcceptPluginCreator);
#endif

} // namespace speccompile

// ---------------------------------------------------------------------------------------------
// Entry points IPluginRegistry::loadLibrary (and trtexec --dynamicPlugins) look up in the library.

extern "C" SPECCOMPILE_PLUGIN_API void setLoggerFinder(nvinfer1::ILoggerFinder* finder)
{
    speccompile::gLoggerFinder.store(finder);
}

extern "C" SPECCOMPILE_PLUGIN_API nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators)
{
    static speccompile::SpecAcceptPluginCreator acceptCreator;
    static speccompile::SpecTransformPluginCreator transformCreator;
    static speccompile::SpecSamplePluginCreator sampleCreator;
    static nvinfer1::IPluginCreatorInterface* const creators[] = {&acceptCreator, &transformCreator, &sampleCreator};
    nbCreators = static_cast<int32_t>(sizeof(creators) / sizeof(creators[0]));
    return creators;
}
