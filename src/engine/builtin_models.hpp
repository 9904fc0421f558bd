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

}  // namespace rlloop::engine
