// The layout of a sparse layer's experts in a checkpoint's files against rlloop's: families whose files stack the
// experts (ExpertStyle::stacked_interleaved, gpt-oss) are converted where model files are read and written
// (load_model, save_model), so that the model itself keeps one Linear per expert and projection.
#pragma once
#include "model_config.hpp"
#include "transformer.hpp"

namespace rlloop::engine {

// A checkpoint's stacked expert tensors ("mlp.experts.gate_up_proj" [E, H, 2I] with gate and up interleaved,
// "gate_up_proj_bias" [E, 2I], "down_proj" [E, I, H], "down_proj_bias" [E, H]) replaced by each expert's
// projections under ModelFamily::expert_module's names ([out, in] weights and their biases). Nothing for other
// families; a stacked tensor of the wrong shape is an invalid_argument naming it.
void experts_to_model_layout(const ModelConfig& cfg, TensorMap& tensors);

// The inverse: each expert's projections stacked back into the checkpoint's tensors.
void experts_to_file_layout(const ModelConfig& cfg, TensorMap& tensors);

}  // namespace rlloop::engine
