#include "runtime/session_model.hpp"

#include <filesystem>
#include <optional>

#include <rlloop/error.hpp>

#include "model/builtin_models.hpp"
#include "model/expert_parallel.hpp"
#include "io/gguf_model.hpp"
#include "io/model_io.hpp"

namespace rlloop::engine {

namespace {
// The configuration of a resolved "builtin:NAME" base model; none for a file.
std::optional<ModelConfig> builtin_config(const std::string& resolved) {
  const std::string prefix = "builtin:";
  if (resolved.rfind(prefix, 0) != 0) return std::nullopt;
  return builtin_model(resolved.substr(prefix.size()));
}
}  // namespace

std::shared_ptr<Transformer> load_base(const std::string& resolved, const DeviceChoice& dev, bool shared) {
  if (auto cfg = builtin_config(resolved)) return init_model(*cfg, 0, dev.device, dev.dtype);
  return load_model(resolved, dev.device, dev.dtype, shared && dev.quantized_base);
}

std::string base_key(const std::string& resolved, const DeviceChoice& dev) {
  return resolved + " on " + device_name(dev.device) + " as " + std::string(c10::toString(dev.dtype));
}

namespace {

// `full` with only the experts of this rank of `group` (everything else as it is): what the rank holds under
// expert parallelism. The whole model is read first and dropped once the slice is copied out of it.
std::shared_ptr<Transformer> expert_slice(const Transformer& full, dist::Group& group) {
  const ModelConfig& cfg = full.config();
  const ExpertShard shard = ExpertShard::of(group, cfg.num_experts);
  const TensorMap all = full.hf_state_dict();
  const torch::TensorOptions options = full.parameters().front().options();
  auto slice =
      std::make_shared<Transformer>(cfg, options, QuantizedTensors{}, ExpertRange{shard.first, shard.per_rank});
  TensorMap mine;
  for (const auto& [name, t] : slice->hf_state_dict()) mine[name] = all.at(name);
  slice->load_hf_state_dict(mine);
  return slice;
}

// `resolved` fully sharded over `group` as it is made (a built-in model drawn, a model directory or GGUF file read a
// tensor at a time): no rank ever holds it whole. `hash` receives a hash of every value made, which the ranks compare
// when they open a session.
std::shared_ptr<Transformer> make_sharded_model(const std::string& resolved, const DeviceChoice& dev,
                                                dist::Group& group, ShardedUse use, std::uint64_t& hash) {
  if (const auto cfg = builtin_config(resolved))
    return init_sharded_model(*cfg, 0, dev.device, dev.dtype, group, &hash, use);
  return load_sharded_model(resolved, dev.device, dev.dtype, group, &hash, use);
}

}  // namespace

SessionModel make_session_model(BaseModelRegistry& bases, const std::string& resolved, const DeviceChoice& dev,
                                const SessionOptions& options, dist::Group* expert_group, dist::Group* shard_group,
                                bool sampler) {
  // A base of this rank's experts: dense (a slice is copied out of dense weights; a quantized one is read again,
  // dequantized) and keyed apart from a whole one. A model without experts is loaded as it would be without.
  auto load = [&](bool shared) {
    auto model = load_base(resolved, dev, shared);
    if (!expert_group || model->config().num_experts == 0) return model;
    if (model->quantized_bytes() > 0) model = load_base(resolved, dev, /*shared=*/false);
    return expert_slice(*model, *expert_group);
  };
  SessionModel out;
  if (options.lora) {
    const std::string key = base_key(resolved, dev) + (expert_group ? " (expert-parallel slice)" : "") +
                            (shard_group ? " (fully sharded)" : "");
    out.shared_base = bases.base(key, [&](SharedBase& base) {
      if (shard_group) {  // its hash is of the values read, taken as they are read
        std::uint64_t hash = 0;
        base.model = make_sharded_model(resolved, dev, *shard_group, ShardedUse::frozen_base, hash);
        std::call_once(base.hashed, [&] { base.weights_hash = hash; });
        return;
      }
      base.model = load(/*shared=*/true);
      for (auto& p : base.model->parameters()) p.set_requires_grad(false);  // frozen before anyone shares it
    });
    out.model = Transformer::sharing_base(*out.shared_base->model);
    out.model->enable_lora(*options.lora, options.seed);
  } else if (shard_group && !sampler && !options.value_head) {
    // Full fine-tuning, fully sharded, never whole on a rank. A model with a value head is refused by name when the
    // ranks open the session (the path below).
    std::uint64_t hash = 0;
    out.model = make_sharded_model(resolved, dev, *shard_group, ShardedUse::trained, hash);
    out.weights_hash = hash;
  } else {
    out.model = load(/*shared=*/false);
  }
  if (expert_group && out.model->config().num_experts > 0) out.model->set_expert_parallel(*expert_group);
  if (options.value_head) out.model->enable_value_head(options.seed);
  out.model->set_activation_checkpointing(dev.activation_checkpointing);
  return out;
}

std::string tokenizer_spec(const ModelConfig& cfg, const std::string& resolved) {
  if (!cfg.tokenizer.empty()) return cfg.tokenizer;
  if (resolved.rfind("builtin:", 0) == 0) return "byte";
  if (is_gguf_path(resolved)) return resolved;  // the tokenizer in its metadata (tokenizer.ggml.*)
  return (std::filesystem::path(resolved) / "tokenizer.json").string();
}

void load_trainable(Transformer& model, const TensorMap& weights) {
  torch::NoGradGuard no_grad;
  for (auto& [name, t] : model.named_trainable_parameters()) {
    auto it = weights.find(name);
    if (it == weights.end()) throw io_error("checkpoint lacks weight '" + name + "'");
    if (it->second.sizes() != t.sizes()) throw io_error("checkpoint weight '" + name + "' has the wrong shape");
    t.copy_(it->second);
  }
}

std::unique_ptr<AdamW> make_optimizer(Transformer& model) {
  std::vector<NamedParameter> params;
  for (auto& [name, t] : model.named_trainable_parameters())
    params.push_back({name, t, name.find("lora_B") != std::string::npos});
  return std::make_unique<AdamW>(std::move(params));
}

}  // namespace rlloop::engine
