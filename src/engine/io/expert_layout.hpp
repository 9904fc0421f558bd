// The layout of a sparse layer's experts in a checkpoint's files against rlloop's: families whose files stack the
// experts (ExpertStyle::stacked_interleaved, gpt-oss) are converted where model files are read and written
// (load_model, save_model), so that the model itself keeps one Linear per expert and projection.
#pragma once
#include "model/model_config.hpp"
#include "model/transformer.hpp"

namespace rlloop::engine {

// A checkpoint's stacked expert tensors ("mlp.experts.gate_up_proj" [E, H, 2I] with gate and up interleaved,
// "gate_up_proj_bias" [E, 2I], "down_proj" [E, I, H], "down_proj_bias" [E, H]) replaced by each expert's
// projections under ModelFamily::expert_module's names ([out, in] weights and their biases). The two matrices may
// come in MXFP4 instead ("gate_up_proj_blocks" / "gate_up_proj_scales", as OpenAI ships gpt-oss): dequantized
// (dequantize_mxfp4). Nothing for other families; a stacked tensor of the wrong shape is an invalid_argument naming it.
void experts_to_model_layout(const ModelConfig& cfg, TensorMap& tensors);

// MXFP4 (OCP microscaling) to bf16, which holds its values exactly: each byte of `blocks` [..., G, 16] holds two FP4
// (E2M1) values, the low nibble first; each block of 32 values shares the power of two 2^(s - 127) of its byte s in
// `scales` [..., G] (E8M0). Returns [..., G * 32]. invalid_argument for other dtypes or shapes.
torch::Tensor dequantize_mxfp4(const torch::Tensor& blocks, const torch::Tensor& scales);

// Takes projection `p`'s `suffix` tensor (".weight", ".bias") of every expert of sparse layer `layer` out of
// `tensors` (expert_module's names) and stacks them in expert order: [E, ...]. Each must be there (logic_error).
torch::Tensor take_expert_stack(const ModelConfig& cfg, TensorMap& tensors, std::int64_t layer, Projection p,
                                const std::string& suffix);

// The inverse: each expert's projections stacked back into the checkpoint's tensors.
void experts_to_file_layout(const ModelConfig& cfg, TensorMap& tensors);

}  // namespace rlloop::engine
