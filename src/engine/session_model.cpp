#include "session_model.hpp"

#include <filesystem>

#include "builtin_models.hpp"
#include "gguf_model.hpp"
#include "model_io.hpp"

namespace rlloop::engine {

std::shared_ptr<Transformer> load_base(const std::string& resolved, const DeviceChoice& dev, bool shared) {
  const std::string prefix = "builtin:";
  if (resolved.rfind(prefix, 0) == 0) {
    auto cfg = builtin_model(resolved.substr(prefix.size()));
    return init_model(*cfg, 0, dev.device, dev.dtype);
  }
  return load_model(resolved, dev.device, dev.dtype, shared && dev.quantized_base);
}

std::string base_key(const std::string& resolved, const DeviceChoice& dev) {
  return resolved + " on " + device_name(dev.device) + " as " + std::string(c10::toString(dev.dtype));
}

SessionModel make_session_model(BaseModelRegistry& bases, const std::string& resolved, const DeviceChoice& dev,
                                const SessionOptions& options) {
  SessionModel out;
  if (options.lora) {
    out.shared_base = bases.base(base_key(resolved, dev), [&] {
      auto base = load_base(resolved, dev, /*shared=*/true);
      for (auto& p : base->parameters()) p.set_requires_grad(false);  // frozen before anyone shares it
      return base;
    });
    out.model = Transformer::sharing_base(*out.shared_base->model);
    out.model->enable_lora(*options.lora, options.seed);
  } else {
    out.model = load_base(resolved, dev, /*shared=*/false);
  }
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

std::unique_ptr<AdamW> make_optimizer(Transformer& model) {
  std::vector<NamedParameter> params;
  for (auto& [name, t] : model.named_trainable_parameters())
    params.push_back({name, t, name.find("lora_B") != std::string::npos});
  return std::make_unique<AdamW>(std::move(params));
}

}  // namespace rlloop::engine
