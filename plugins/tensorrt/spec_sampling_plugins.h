/*
 * TensorRT IPluginV3s for the `SpecTransform` and `SpecSample` ONNX nodes
 * (speccompile/compiler/spec_accept.py).
 *
 * Like SpecAccept, the nodes live in the `speccompile` domain and carry plugin_namespace =
 * "speccompile", plugin_version = "1" and mode = "default"; TensorRT's ONNX parser serves them with the
 * creators ("SpecTransform", "1", "speccompile") and ("SpecSample", "1", "speccompile"). `mode` is
 * accepted and ignored: neither op has variants.
 *
 *   SpecTransform: logits f32 [B, R, V], temperature f32 [B], top_k i64 [B], top_p f32 [B]
 *                  -> probs f32 [B, R, V]
 *   SpecSample:    probs f32 [B, V], uniform f32 [B] -> token i64 [B]
 *
 * SpecTransform's ONNX body sorts with TopK(K = V), which TensorRT's parser refuses for K >= 3840, so a
 * sampling graph over a real vocabulary builds only with these plugins. The work is done by the C ABI
 * in plugins/kernels/spec_accept_kernels.h (speccompile_transform, speccompile_sample).
 */
#ifndef SPECCOMPILE_SPEC_SAMPLING_PLUGINS_H
#define SPECCOMPILE_SPEC_SAMPLING_PLUGINS_H

#include <NvInferRuntime.h>

#include <cstdint>

namespace speccompile
{

//! What SpecTransform and SpecSample share: fixed input and output types (linear layout), no workspace,
//! one ignored `mode` field that is serialized as "default". A subclass names the op and supplies the
//! shape rule and the launch.
class SpecSamplingPlugin : public nvinfer1::IPluginV3,
                           public nvinfer1::IPluginV3OneCore,
                           public nvinfer1::IPluginV3OneBuild,
                           public nvinfer1::IPluginV3OneRuntime
{
public:
    SpecSamplingPlugin(SpecSamplingPlugin const&) = delete; // mFields points into this object: clone() instead
    SpecSamplingPlugin& operator=(SpecSamplingPlugin const&) = delete;
    ~SpecSamplingPlugin() override = default;

    // IPluginV3 (clone() is the subclass's)
    nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override;

    // IPluginV3OneCore (getPluginName() is the subclass's)
    char const* getPluginVersion() const noexcept override;
    char const* getPluginNamespace() const noexcept override;

    // IPluginV3OneBuild (getOutputShapes() is the subclass's)
    int32_t getNbOutputs() const noexcept override;
    int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
        nvinfer1::DataType const* inputTypes, int32_t nbInputs) const noexcept override;
    bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
        int32_t nbOutputs) noexcept override;
    int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override;

    // IPluginV3OneRuntime (onShapeChange() and enqueue() are the subclass's)
    nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext* context) noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override;

protected:
    //! `inputs` and `outputs` are static tables of the dtypes in ONNX order.
    SpecSamplingPlugin(nvinfer1::DataType const* inputs, int32_t nbInputs, nvinfer1::DataType const* outputs,
        int32_t nbOutputs);
    bool hasArity(int32_t nbInputs, int32_t nbOutputs) const noexcept;

private:
    nvinfer1::DataType const* mInputTypes;
    int32_t mNbInputs;
    nvinfer1::DataType const* mOutputTypes;
    int32_t mNbOutputs;
    nvinfer1::PluginField mModeField; // mode = "default"
    nvinfer1::PluginFieldCollection mFields;
};

class SpecTransformPlugin final : public SpecSamplingPlugin
{
public:
    SpecTransformPlugin();

    nvinfer1::IPluginV3* clone() noexcept override;
    char const* getPluginName() const noexcept override;
    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs, nvinfer1::DimsExprs const* shapeInputs,
        int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
        nvinfer1::IExprBuilder& exprBuilder) noexcept override;
    int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::PluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;
};

class SpecSamplePlugin final : public SpecSamplingPlugin
{
public:
    SpecSamplePlugin();

    nvinfer1::IPluginV3* clone() noexcept override;
    char const* getPluginName() const noexcept override;
    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs, nvinfer1::DimsExprs const* shapeInputs,
        int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
        nvinfer1::IExprBuilder& exprBuilder) noexcept override;
    int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::PluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;
};

//! What the two creators share: the identity and the one advertised field, `mode`, whose value is ignored.
class SpecSamplingPluginCreator : public nvinfer1::IPluginCreatorV3One
{
public:
    ~SpecSamplingPluginCreator() override = default;

    char const* getPluginVersion() const noexcept override;
    char const* getPluginNamespace() const noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override;

protected:
    SpecSamplingPluginCreator();

private:
    nvinfer1::PluginField mModeField;
    nvinfer1::PluginFieldCollection mFields;
};

class SpecTransformPluginCreator final : public SpecSamplingPluginCreator
{
public:
    char const* getPluginName() const noexcept override;
    nvinfer1::IPluginV3* createPlugin(
        char const* name, nvinfer1::PluginFieldCollection const* fc, nvinfer1::TensorRTPhase phase) noexcept override;
};

class SpecSamplePluginCreator final : public SpecSamplingPluginCreator
{
public:
    char const* getPluginName() const noexcept override;
    nvinfer1::IPluginV3* createPlugin(
        char const* name, nvinfer1::PluginFieldCollection const* fc, nvinfer1::TensorRTPhase phase) noexcept override;
};

} // namespace speccompile

#endif // SPECCOMPILE_SPEC_SAMPLING_PLUGINS_H
