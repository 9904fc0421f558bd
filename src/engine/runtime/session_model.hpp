// The model a session trains, made the same way by a LocalSession and by every data-parallel worker holding
// its replica: LoRA adapters (seeded) over the shared frozen base, or a private copy of the base for full
// fine-tuning, plus the value head if asked for; and the optimizer over its trainable parameters.
#pragma once
#include <memory>
#include <optional>
#include <string>

#include <rlloop/types.hpp>

#include "runtime/base_models.hpp"
#include "kernels/device.hpp"
#include "runtime/optimizer.hpp"
#include "model/transformer.hpp"

namespace rlloop::engine {

namespace dist {
class Group;
}

// The base's weights as the session starts from them: a built-in model's fixed seeded initialisation (not the
// session's seed: every session on "rlloop-small" starts from the same model, which is what lets them share
// it) or a model directory's or GGUF file's. A `shared` base (frozen, for LoRA sessions) of a GGUF file keeps its
// matrices quantized where DeviceChoice::quantized_base says so; a private one (full fine-tuning) is dense.
std::shared_ptr<Transformer> load_base(const std::string& resolved, const DeviceChoice& dev, bool shared);

// The registry key of a base: the same model on the same device in the same dtype is the same base.
std::string base_key(const std::string& resolved, const DeviceChoice& dev);

struct SessionModel {
  std::shared_ptr<SharedBase> shared_base;  // LoRA: the weights it shares; null with a private model
  std::shared_ptr<Transformer> model;
  // A full fine-tuning model each rank made sharded (drawn, or read from its files): a hash of every value made,
  // which the ranks compare when they open the session (nothing else makes them hold the same weights).
  std::optional<std::uint64_t> weights_hash;
};

// `expert_group`, when given (DataParallelOptions::expert_parallel): a model with experts holds only this rank's
// slice of them (ExpertShard::of) and routes through the group (Transformer::set_expert_parallel); its base is then
// dense, whatever DeviceChoice::quantized_base says. A model without experts is made as without it.
// `shard_group`, when given (DataParallelOptions::shard "full"): a LoRA model shares a base fully sharded over the
// group (dense, kept apart from the unsharded one), and a full fine-tuning session's model is fully sharded, both
// made sharded as they are drawn or read (init_sharded_model, load_sharded_model: no rank holds them whole). A
// `sampler` model (a checkpoint's weights to sample from) of full fine-tuning is made whole, and so is one with a
// value head (which the ranks refuse to shard when they open the session).
SessionModel make_session_model(BaseModelRegistry& bases, const std::string& resolved, const DeviceChoice& dev,
                                const SessionOptions& options, dist::Group* expert_group = nullptr,
                                dist::Group* shard_group = nullptr, bool sampler = false);

// Where a model's tokenizer is (load_tokenizer's argument): the config's own, the byte tokenizer of a built-in
// model, a GGUF file itself, or a model directory's tokenizer.json.
std::string tokenizer_spec(const ModelConfig& cfg, const std::string& resolved);

// Every trainable tensor of `model` from a checkpoint's `weights`, by name (io_error naming one that is missing or
// of another shape). Under expert parallelism each rank takes the experts it holds from a whole model's checkpoint.
void load_trainable(Transformer& model, const TensorMap& weights);

// AdamW over the model's trainable parameters (LoRA B matrices take the LoRA+ learning-rate ratio).
std::unique_ptr<AdamW> make_optimizer(Transformer& model);

}  // namespace rlloop::engine
