/*
 * The SpecTransform and SpecSample IPluginV3s (see spec_sampling_plugins.h): shapes, types and
 * registration for TensorRT; the work runs in the CUDA kernels of plugins/kernels.
 */
#include "spec_sampling_plugins.h"

#include "spec_accept_kernels.h"
#include "spec_accept_plugin.h" // logError

#include <algorithm>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <limits>

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

// The identities the ONNX nodes ask for: op_type, plugin_version, plugin_namespace.
constexpr char const* kTRANSFORM_NAME = "SpecTransform";
constexpr char const* kSAMPLE_NAME = "SpecSample";
constexpr char const* kPLUGIN_VERSION = "1";
constexpr char const* kPLUGIN_NAMESPACE = "speccompile";
constexpr char const* kMODE_FIELD = "mode";
constexpr char const* kMODE_DEFAULT = "default"; // what spec_op() writes for ops without variants

// Tensor dtypes in ONNX input / output order.
constexpr DataType kTRANSFORM_INPUTS[] = {
    DataType::kFLOAT, // logits      [B, R, V]
    DataType::kFLOAT, // temperature [B]
    DataType::kINT64, // top_k       [B]
    DataType::kFLOAT, // top_p       [B]
};
constexpr DataType kTRANSFORM_OUTPUTS[] = {
    DataType::kFLOAT, // probs       [B, R, V]
};
constexpr DataType kSAMPLE_INPUTS[] = {
    DataType::kFLOAT, // probs       [B, V]
    DataType::kFLOAT, // uniform     [B]
};
constexpr DataType kSAMPLE_OUTPUTS[] = {
    DataType::kINT64, // token       [B]
};

template <typename T, size_t N>
constexpr int32_t nbOf(T const (&)[N])
{
    return static_cast<int32_t>(N);
}

bool isShape(Dims const& dims, std::initializer_list<int64_t> shape)
{
    if (dims.nbDims != static_cast<int32_t>(shape.size()))
        return false;
    return std::equal(shape.begin(), shape.end(), dims.d);
}

bool fitsInt(int64_t value, int64_t least)
{
    return value >= least && value <= std::numeric_limits<int32_t>::max();
}

} // namespace

// ---------------------------------------------------------------------------------------------
// SpecSamplingPlugin

SpecSamplingPlugin::SpecSamplingPlugin(
    DataType const* inputs, int32_t nbInputs, DataType const* outputs, int32_t nbOutputs)
    : mInputTypes(inputs)
    , mNbInputs(nbInputs)
    , mOutputTypes(outputs)
    , mNbOutputs(nbOutputs)
    , mModeField(kMODE_FIELD, kMODE_DEFAULT, PluginFieldType::kCHAR,
          static_cast<int32_t>(std::strlen(kMODE_DEFAULT) + 1)) // with the NUL, as SpecAccept writes `mode`
    , mFields{1, &mModeField}
{
}

bool SpecSamplingPlugin::hasArity(int32_t nbInputs, int32_t nbOutputs) const noexcept
{
    return nbInputs == mNbInputs && nbOutputs == mNbOutputs;
}

nvinfer1::IPluginCapability* SpecSamplingPlugin::getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept
{
    switch (type)
    {
    case nvinfer1::PluginCapabilityType::kCORE: return static_cast<nvinfer1::IPluginV3OneCore*>(this);
    case nvinfer1::PluginCapabilityType::kBUILD: return static_cast<nvinfer1::IPluginV3OneBuild*>(this);
    case nvinfer1::PluginCapabilityType::kRUNTIME: return static_cast<nvinfer1::IPluginV3OneRuntime*>(this);
    }
    return nullptr;
}

char const* SpecSamplingPlugin::getPluginVersion() const noexcept
{
    return kPLUGIN_VERSION;
}

char const* SpecSamplingPlugin::getPluginNamespace() const noexcept
{
    return kPLUGIN_NAMESPACE;
}

int32_t SpecSamplingPlugin::getNbOutputs() const noexcept
{
    return mNbOutputs;
}

int32_t SpecSamplingPlugin::getOutputDataTypes(
    DataType* outputTypes, int32_t nbOutputs, DataType const* /*inputTypes*/, int32_t nbInputs) const noexcept
{
    if (!hasArity(nbInputs, nbOutputs))
        return -1;
    std::copy(mOutputTypes, mOutputTypes + nbOutputs, outputTypes);
    return 0;
}

bool SpecSamplingPlugin::supportsFormatCombination(
    int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept
{
    if (!hasArity(nbInputs, nbOutputs) || pos < 0 || pos >= nbInputs + nbOutputs)
        return false;
    DataType const expected = pos < nbInputs ? mInputTypes[pos] : mOutputTypes[pos - nbInputs];
    return inOut[pos].desc.format == TensorFormat::kLINEAR && inOut[pos].desc.type == expected;
}

int32_t SpecSamplingPlugin::configurePlugin(
    DynamicPluginTensorDesc const* /*in*/, int32_t nbInputs, DynamicPluginTensorDesc const* /*out*/,
    int32_t nbOutputs) noexcept
{
    return hasArity(nbInputs, nbOutputs) ? 0 : -1;
}

nvinfer1::IPluginV3* SpecSamplingPlugin::attachToContext(nvinfer1::IPluginResourceContext* /*context*/) noexcept
{
    return clone(); // no per-context resources
}

PluginFieldCollection const* SpecSamplingPlugin::getFieldsToSerialize() noexcept
{
    return &mFields; // handed back to createPlugin(..., TensorRTPhase::kRUNTIME) on deserialization
}

// ---------------------------------------------------------------------------------------------
// SpecTransformPlugin

SpecTransformPlugin::SpecTransformPlugin()
    : SpecSamplingPlugin(kTRANSFORM_INPUTS, nbOf(kTRANSFORM_INPUTS), kTRANSFORM_OUTPUTS, nbOf(kTRANSFORM_OUTPUTS))
{
}

nvinfer1::IPluginV3* SpecTransformPlugin::clone() noexcept
{
    try
    {
        return new SpecTransformPlugin();
    }
    catch (std::exception const& e)
    {
        logError(e.what());
    }
    return nullptr;
}

char const* SpecTransformPlugin::getPluginName() const noexcept
{
    return kTRANSFORM_NAME;
}

int32_t SpecTransformPlugin::getOutputShapes(DimsExprs const* inputs, int32_t nbInputs,
    DimsExprs const* /*shapeInputs*/, int32_t /*nbShapeInputs*/, DimsExprs* outputs, int32_t nbOutputs,
    nvinfer1::IExprBuilder& /*exprBuilder*/) noexcept
{
    if (!hasArity(nbInputs, nbOutputs) || inputs[0].nbDims != 3)
    {
        logError("SpecTransform: expected logits [B, R, V], temperature, top_k, top_p");
        return -1;
    }
    outputs[0] = inputs[0]; // probs has the logits' shape
    return 0;
}

int32_t SpecTransformPlugin::onShapeChange(
    PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const* /*out*/, int32_t nbOutputs) noexcept
{
    if (hasArity(nbInputs, nbOutputs) && in[0].dims.nbDims == 3)
    {
        int64_t const B = in[0].dims.d[0], R = in[0].dims.d[1], V = in[0].dims.d[2];
        // One block per row: B * R is the grid size, an int.
        if (fitsInt(B, 0) && fitsInt(R, 0) && fitsInt(V, 1) && fitsInt(B * R, 0) && isShape(in[1].dims, {B})
            && isShape(in[2].dims, {B}) && isShape(in[3].dims, {B}))
            return 0;
    }
    logError("SpecTransform: expected logits [B, R, V] (B * R and V within int32, V >= 1) and temperature, top_k, "
             "top_p of shape [B]");
    return -1;
}

int32_t SpecTransformPlugin::enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* /*outputDesc*/,
    void const* const* inputs, void* const* outputs, void* /*workspace*/, cudaStream_t stream) noexcept
{
    Dims const& logits = inputDesc[0].dims; // [B, R, V], checked by onShapeChange
    int const B = static_cast<int>(logits.d[0]);
    int const R = static_cast<int>(logits.d[1]);
    int const V = static_cast<int>(logits.d[2]);
    return speccompile_transform(static_cast<float const*>(inputs[0]), static_cast<float const*>(inputs[1]),
        static_cast<int64_t const*>(inputs[2]), static_cast<float const*>(inputs[3]), B, R, V,
        static_cast<float*>(outputs[0]), stream);
}

// ---------------------------------------------------------------------------------------------
// SpecSamplePlugin

SpecSamplePlugin::SpecSamplePlugin()
    : SpecSamplingPlugin(kSAMPLE_INPUTS, nbOf(kSAMPLE_INPUTS), kSAMPLE_OUTPUTS, nbOf(kSAMPLE_OUTPUTS))
{
}

nvinfer1::IPluginV3* SpecSamplePlugin::clone() noexcept
{
    try
    {
        return new SpecSamplePlugin();
    }
    catch (std::exception const& e)
    {
        logError(e.what());
    }
    return nullptr;
}

char const* SpecSamplePlugin::getPluginName() const noexcept
{
    return kSAMPLE_NAME;
}

int32_t SpecSamplePlugin::getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const* /*shapeInputs*/,
    int32_t /*nbShapeInputs*/, DimsExprs* outputs, int32_t nbOutputs, nvinfer1::IExprBuilder& /*exprBuilder*/) noexcept
{
    if (!hasArity(nbInputs, nbOutputs) || inputs[0].nbDims != 2)
    {
        logError("SpecSample: expected probs [B, V] and uniform [B]");
        return -1;
    }
    // One token per row: [B], B being the probs' leading dimension expression.
    outputs[0].nbDims = 1;
    outputs[0].d[0] = inputs[0].d[0];
    return 0;
}

int32_t SpecSamplePlugin::onShapeChange(
    PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const* /*out*/, int32_t nbOutputs) noexcept
{
    if (hasArity(nbInputs, nbOutputs) && in[0].dims.nbDims == 2)
    {
        int64_t const B = in[0].dims.d[0], V = in[0].dims.d[1];
        if (fitsInt(B, 0) && fitsInt(V, 1) && isShape(in[1].dims, {B}))
            return 0;
    }
    logError("SpecSample: expected probs [B, V] (B and V within int32, V >= 1) and uniform [B]");
    return -1;
}

int32_t SpecSamplePlugin::enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* /*outputDesc*/,
    void const* const* inputs, void* const* outputs, void* /*workspace*/, cudaStream_t stream) noexcept
{
    Dims const& probs = inputDesc[0].dims; // [B, V], checked by onShapeChange
    return speccompile_sample(static_cast<float const*>(inputs[0]), static_cast<float const*>(inputs[1]),
        static_cast<int>(probs.d[0]), static_cast<int>(probs.d[1]), static_cast<int64_t*>(outputs[0]), stream);
}

// ---------------------------------------------------------------------------------------------
// Creators

SpecSamplingPluginCreator::SpecSamplingPluginCreator()
    : mModeField(kMODE_FIELD, nullptr, PluginFieldType::kCHAR, 0)
    , mFields{1, &mModeField}
{
}

char const* SpecSamplingPluginCreator::getPluginVersion() const noexcept
{
    return kPLUGIN_VERSION;
}

char const* SpecSamplingPluginCreator::getPluginNamespace() const noexcept
{
    return kPLUGIN_NAMESPACE;
}

PluginFieldCollection const* SpecSamplingPluginCreator::getFieldNames() noexcept
{
    return &mFields;
}

char const* SpecTransformPluginCreator::getPluginName() const noexcept
{
    return kTRANSFORM_NAME;
}

// Both phases build the same plugin: the build phase gets the ONNX attributes (plugin_namespace,
// plugin_version, mode), the runtime phase what getFieldsToSerialize() wrote; none changes the op.
nvinfer1::IPluginV3* SpecTransformPluginCreator::createPlugin(
    char const* /*name*/, PluginFieldCollection const* /*fc*/, nvinfer1::TensorRTPhase /*phase*/) noexcept
{
    try
    {
        return new SpecTransformPlugin();
    }
    catch (std::exception const& e)
    {
        logError(e.what());
    }
    return nullptr;
}

char const* SpecSamplePluginCreator::getPluginName() const noexcept
{
    return kSAMPLE_NAME;
}

nvinfer1::IPluginV3* SpecSamplePluginCreator::createPlugin(
    char const* /*name*/, PluginFieldCollection const* /*fc*/, nvinfer1::TensorRTPhase /*phase*/) noexcept
{
    try
    {
        return new SpecSamplePlugin();
    }
    catch (std::exception const& e)
    {
        logError(e.what());
    }
    return nullptr;
}

// Static registration, as for SpecAccept (spec_accept_plugin.cpp); getCreators() there returns these
// creators as well.
#ifndef SPECCOMPILE_NO_STATIC_REGISTRATION
REGISTER_TENSORRT_PLUGIN(SpecTransformPluginCreator);
REGISTER_TENSORRT_PLUGIN(SpecSamplePluginCreator);
#endif

} // namespace speccompile
