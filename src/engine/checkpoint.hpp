// Checkpoint directories: <dir>/weights.safetensors, optional <dir>/optimizer.safetensors, <dir>/state.json
// (written last). A save builds the whole directory under a temporary name, fsyncs it, then swaps it in with
// one atomic rename. A process killed at any moment leaves either the previous or the new checkpoint under that
// name, never a half-written one.
#pragma once
#include <string>

#include <nlohmann/json.hpp>

#include "transformer.hpp"

namespace rlloop::engine {

struct StateContents {
  TensorMap weights;
  TensorMap optimizer;  // empty when not saved or not requested
  nlohmann::json meta;
};

void write_state_dir(const std::string& dir, const TensorMap& weights, const TensorMap* optimizer,
                     const nlohmann::json& meta);
// Reads the checkpoint directory `path`. Throws not_found / io_error naming the path.
StateContents read_state_dir(const std::string& path, bool with_optimizer);

}  // namespace rlloop::engine
