// Model configurations that ship inside rlloop, so a fresh machine can train without downloading weights.
// Their weights are a seeded random initialisation; the demo trains them from scratch.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "model_config.hpp"

namespace rlloop::engine {

// "rlloop-tiny" (tests), "rlloop-small" (the CPU demo's default), "rlloop-100m" (benchmarks), "rlloop-tiny-moe"
// (tests of the sparse layers: qwen3_moe). All byte-level.
std::optional<ModelConfig> builtin_model(const std::string& name);
std::vector<std::string> builtin_model_names();

// `dense` as Qwen3-MoE (qwen3_moe): its attention with q/k norms, every layer sparse with `experts` SwiGLU experts of
// width `width`, `per_token` of them per token, their weights renormalised (as the released models route).
ModelConfig with_experts(ModelConfig dense, std::int64_t experts, std::int64_t per_token, std::int64_t width);

}  // namespace rlloop::engine
