/*
 * TensorRT IPluginV3 for the `SpecAccept` ONNX node (speccompile/compiler/spec_accept.py).
 *
 * The node lives in the `speccompile` domain and carries plugin_namespace = "speccompile",
 * plugin_version = "1" and mode = "greedy" | "sample" | "tree" | "tree_typical"; TensorRT's ONNX parser
 * serves it with the creator whose (name, version, namespace) is ("SpecAccept", "1", "speccompile"),
 * passing `mode`.
 *
 *   greedy: target_logits f32 [B, γ+1, V], draft_tokens i64 [B, γ], draft_len i64 [B], past_len i64 [B]
 *   sample: target_probs f32 [B, γ+1, V], draft_probs f32 [B, γ, V], draft_tokens i64 [B, γ],
 *           draft_len i64 [B], u_accept f32 [B, γ], u_sample f32 [B], past_len i64 [B]
 *   outputs (both modes): accepted, next_token, new_len, i64 [B]
 *
 *   tree:         target_logits f32 [B, N, V], tree_tokens i64 [B, N], draft_len i64 [B], past_len i64 [B],
 *                 tree_parents i64 [N], tree_depths i64 [N], tree_mask bool [N, N]
 *   tree_typical: the same, then epsilon f32 [B], delta f32 [B]
 *   outputs (tree modes): accepted, next_token, new_len, best_node, i64 [B]
 *
 * draft_len[b] (0..γ): how many of row b's γ draft slots hold real drafts; the rest are padding. In a
 * tree (N nodes, the root included, N <= SPECCOMPILE_MAX_TREE_NODES) nodes 0..draft_len[b] are verified.
 *
 * The work is done by the C ABI in plugins/kernels/spec_accept_kernels.h.
 */
#ifndef SPECCOMPILE_SPEC_ACCEPT_PLUGIN_H
#define SPECCOMPILE_SPEC_ACCEPT_PLUGIN_H

#include <NvInferRuntime.h>

#include <cstdint>
#include <string>

namespace speccompile
{

//! The acceptance rule a node runs, fixed by its `mode` attribute.
enum class AcceptMode : int32_t
{
    kGREEDY = 0,
    kSAMPLE = 1,
    kTREE = 2,
    kTREE_TYPICAL = 3,
};

class SpecAcceptPlugin final : public nvinfer1::IPluginV3,
                               public nvinfer1::IPluginV3OneCore,
                               public nvinfer1::IPluginV3OneBuild,
                               public nvinfer1::IPluginV3OneRuntime
{
public:
    explicit SpecAcceptPlugin(AcceptMode mode);
    SpecAcceptPlugin(SpecAcceptPlugin const&) = delete; // mFields points into this object: clone() instead
    SpecAcceptPlugin& operator=(SpecAcceptPlugin const&) = delete;
    ~SpecAcceptPlugin() override = default;

    // IPluginV3
    nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override;
    nvinfer1::IPluginV3* clone() noexcept override;

    // IPluginV3OneCore
    char const* getPluginName() const noexcept override;
    char const* getPluginVersion() const noexcept override;
    char const* getPluginNamespace() const noexcept override;

    // IPluginV3OneBuild
    int32_t getNbOutputs() const noexcept override;
    int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
        nvinfer1::DataType const* inputTypes, int32_t nbInputs) const noexcept override;
    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs, nvinfer1::DimsExprs const* shapeInputs,
        int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
        nvinfer1::IExprBuilder& exprBuilder) noexcept override;
    bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
        int32_t nbOutputs) noexcept override;
    int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override;

    // IPluginV3OneRuntime
    int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::PluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;
    nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext* context) noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override;

private:
    AcceptMode mMode;
    std::string mModeName;            // the node's `mode`: the one serialized field
    nvinfer1::PluginField mModeField;  // points at mModeName
    nvinfer1::PluginFieldCollection mFields;
};

class SpecAcceptPluginCreator final : public nvinfer1::IPluginCreatorV3One
{
public:
    SpecAcceptPluginCreator();
    ~SpecAcceptPluginCreator() override = default;

    char const* getPluginName() const noexcept override;
    char const* getPluginVersion() const noexcept override;
    char const* getPluginNamespace() const noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override;
    nvinfer1::IPluginV3* createPlugin(
        char const* name, nvinfer1::PluginFieldCollection const* fc, nvinfer1::TensorRTPhase phase) noexcept override;

private:
    nvinfer1::PluginField mModeField;
    nvinfer1::PluginFieldCollection mFields;
};

//! Report an error through the logger TensorRT handed to setLoggerFinder (stderr before that); shared by
//! all the plugins of this library.
void logError(char const* message) noexcept;

} // namespace speccompile

#endif // SPECCOMPILE_SPEC_ACCEPT_PLUGIN_H
