// Model configurations that ship inside rlloop, so a fresh machine can train without downloading weights.
// Their weights are a seeded random initialisation; the demo trains them from scratch.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "model/model_config.hpp"

namespace rlloop::engine {

// "rlloop-tiny" (tests), "rlloop-small" (the CPU demo's default), "rlloop-100m" (benchmarks), "rlloop-tiny-moe" and
// "rlloop-tiny-gpt-oss" (tests of the sparse layers: qwen3_moe, gpt_oss). All byte-level.
std::optional<ModelConfig> builtin_model(const std::string& name);
std::vector<std::string> builtin_model_names();

// `dense` as Qwen3-MoE (qwen3_moe): its attention with q/k norms, every layer sparse with `experts` SwiGLU experts of
// width `width`, `per_token` of them per token, their weights renormalised (as the released models route).
ModelConfig with_experts(ModelConfig dense, std::int64_t experts, std::int64_t per_token, std::int64_t width);

// `dense` as gpt-oss (gpt_oss): attention with biases and sinks, even layers sliding over `window` positions, YaRN
// RoPE; every layer sparse with `experts` clamped-SwiGLU experts of width `width`, `per_token` of them per token.
ModelConfig as_gpt_oss(ModelConfig dense, std::int64_t experts, std::int64_t per_token, std::int64_t width,
                       std::int64_t window);

}  // namespace rlloop::engine
