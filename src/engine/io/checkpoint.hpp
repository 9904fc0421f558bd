// Checkpoint directories: <dir>/weights.safetensors, optional <dir>/optimizer.safetensors and
// <dir>/gradients.safetensors (an accumulation pending at the save: forward_backward without optim_step yet),
// <dir>/state.json (written last). A save builds the whole directory under a temporary name, fsyncs it, then swaps it in with
// one atomic rename. A process killed at any moment leaves either the previous or the new checkpoint under that
// name, never a half-written one.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <rlloop/types.hpp>

#include "model/transformer.hpp"

namespace rlloop::engine {

// state.json's "format"; a directory without it is not an rlloop checkpoint.
inline constexpr const char* kCheckpointFormat = "rlloop-state-v1";

// What state.json records besides the tensors: what the session was created with (a checkpoint is only
// meaningful over the same base, adapters and head) and its run state.
struct CheckpointMeta {
  std::string base_model;               // SessionOptions::base_model, as the session named it
  std::optional<LoraOptions> lora;      // nullopt: full fine-tuning
  bool value_head = false;              // SessionOptions::value_head
  std::int64_t seed = 0;                // SessionOptions::seed
  std::int64_t step = 0;                // optimizer steps taken
  std::vector<std::uint8_t> rng_state;  // the session's sampling generator
  bool has_optimizer = false;           // optimizer.safetensors is there (false: saved for sampling only)
  bool has_gradients = false;           // gradients.safetensors is there
  bool operator==(const CheckpointMeta&) const = default;
};

// The one codec of state.json, used by every save, load and open_sampler. The reader takes every state.json of
// kCheckpointFormat; a missing or mistyped key is an io_error naming `path` and the key.
nlohmann::json checkpoint_meta_to_json(const CheckpointMeta& meta);
CheckpointMeta checkpoint_meta_from_json(const nlohmann::json& j, const std::string& path);

struct StateContents {
  TensorMap weights;
  TensorMap optimizer;  // empty when not saved or not requested
  TensorMap gradients;  // pending gradients by parameter name; read with the optimizer, empty when none were saved
  CheckpointMeta meta;
};

// Writes a checkpoint; meta.has_optimizer and meta.has_gradients are taken from `optimizer` and `gradients`
// (null: not saved).
void write_state_dir(const std::string& dir, const TensorMap& weights, const TensorMap* optimizer, CheckpointMeta meta,
                     const TensorMap* gradients = nullptr);
// The metadata of the checkpoint directory `path` alone (its state.json). Throws not_found / io_error naming it.
CheckpointMeta read_checkpoint_meta(const std::string& path);
// Reads the checkpoint directory `path`. Throws not_found / io_error naming the path, invalid_argument when
// the optimizer state is asked for and the checkpoint has none.
StateContents read_state_dir(const std::string& path, bool with_optimizer);

}  // namespace rlloop::engine
