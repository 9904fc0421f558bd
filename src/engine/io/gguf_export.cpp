#include "io/gguf_export.hpp"

#include <cctype>
#include <span>

#include <rlloop/error.hpp>

#include "io/expert_layout.hpp"
#include "io/gguf_model.hpp"

namespace rlloop::engine {
namespace {

// llama.cpp's name of the model's architecture.
std::string gguf_architecture(const ModelConfig& config, const std::string& what) {
  const std::string& arch = config.family().gguf_architecture;
  if (arch.empty()) throw unsupported(what + ": llama.cpp has no '" + config.model_type + "' models");
  return arch;
}

// A [rows, cols] (or [n], or [experts, rows, cols]) tensor as GGUF stores it: its values in `type`, its shape fastest
// dimension first.
gguf::TensorData tensor_data(const std::string& name, const torch::Tensor& t, gguf::TensorType type) {
  const auto values = t.detach().to(torch::kCPU, torch::kFloat32).contiguous();
  std::vector<std::int64_t> shape(values.sizes().rbegin(), values.sizes().rend());
  const std::span<const float> flat(values.data_ptr<float>(), static_cast<std::size_t>(values.numel()));
  return {name, shape, type, gguf::quantize(type, flat)};
}

std::string gguf_name_of(const ModelConfig& config, const std::string& hf_name, const std::string& what) {
  const auto name = gguf_tensor_name(config.family(), hf_name);
  if (!name) throw unsupported(what + ": tensor '" + hf_name + "' has no name in llama.cpp's models");
  return *name;
}

// llama.cpp's general.file_type (enum llama_ftype) for a model of `type` matrices.
std::uint32_t file_type(gguf::TensorType type) {
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wswitch-enum"  // the types rlloop writes; the others are refused by name
  switch (type) {
    case gguf::TensorType::f32: return 0;
    case gguf::TensorType::f16: return 1;
    case gguf::TensorType::q8_0: return 7;
    case gguf::TensorType::q4_k: return 14;  // LLAMA_FTYPE_MOSTLY_Q4_K_S: Q4_K where rows allow
    case gguf::TensorType::q6_k: return 18;
    case gguf::TensorType::bf16: return 32;
    default:
      throw unsupported("GGUF export: models are written as F32, F16, BF16, Q8_0, Q4_K or Q6_K, not " +
                        gguf::to_string(type));
  }
#pragma GCC diagnostic pop
}

// The keys llama.cpp reads for the architecture, from the configuration.
std::map<std::string, gguf::Value> architecture_metadata(const ModelConfig& c) {
  const std::string& arch = c.family().gguf_architecture;  // gguf_architecture() checked it
  const std::string a = arch + ".";
  auto u32 = [](std::int64_t v) { return gguf::Value{static_cast<std::uint32_t>(v)}; };
  const std::int64_t head_dim = c.head_dim ? c.head_dim : c.hidden_size / c.num_attention_heads;
  return {
      {"general.architecture", {arch}},
      {a + "context_length", u32(c.max_position_embeddings)},
      {a + "embedding_length", u32(c.hidden_size)},
      {a + "block_count", u32(c.num_hidden_layers)},
      {a + "feed_forward_length", u32(c.intermediate_size)},
      {a + "attention.head_count", u32(c.num_attention_heads)},
      {a + "attention.head_count_kv", u32(c.num_key_value_heads ? c.num_key_value_heads : c.num_attention_heads)},
      {a + "attention.key_length", u32(head_dim)},
      {a + "attention.value_length", u32(head_dim)},
      {a + "rope.dimension_count", u32(head_dim)},
      {a + "attention.layer_norm_rms_epsilon", {static_cast<float>(c.rms_norm_eps)}},
      {a + "rope.freq_base", {static_cast<float>(c.rope_theta)}},
      {a + "vocab_size", u32(c.vocab_size)},
  };
}

// A model with experts: the keys of its experts (as llama.cpp's converter writes them for qwen3moe).
void add_expert_metadata(const ModelConfig& c, std::map<std::string, gguf::Value>& metadata) {
  if (c.num_experts == 0) return;
  const std::string a = c.family().gguf_architecture + ".";
  auto u32 = [](std::int64_t v) { return gguf::Value{static_cast<std::uint32_t>(v)}; };
  metadata[a + "expert_count"] = u32(c.num_experts);
  metadata[a + "expert_used_count"] = u32(c.num_experts_per_tok);
  metadata[a + "expert_feed_forward_length"] = u32(c.moe_intermediate_size);
}

// YaRN RoPE, as llama.cpp's converter writes it (llama.cpp reads the type, factor and original context length; the
// betas it takes when present).
void add_rope_scaling_metadata(const ModelConfig& c, std::map<std::string, gguf::Value>& metadata) {
  if (!c.yarn) return;
  if (c.yarn->attention_factor)
    throw unsupported("GGUF export: a YaRN attention_factor has no key llama.cpp reads as transformers does");
  const std::string a = c.family().gguf_architecture + ".rope.scaling.";
  metadata[a + "type"] = gguf::Value{std::string("yarn")};
  metadata[a + "factor"] = gguf::Value{static_cast<float>(c.yarn->factor)};
  metadata[a + "original_context_length"] =
      gguf::Value{static_cast<std::uint32_t>(c.yarn->original_max_position_embeddings)};
  metadata[a + "yarn_beta_fast"] = gguf::Value{static_cast<float>(c.yarn->beta_fast)};
  metadata[a + "yarn_beta_slow"] = gguf::Value{static_cast<float>(c.yarn->beta_slow)};
}

// Each sparse layer's experts as llama.cpp stacks them, one [E, out, in] tensor per projection
// ("blk.N.ffn_gate_exps.weight"), and their biases' [E, out] (gpt-oss), taken out of `tensors` (the per-expert
// Hugging Face names).
std::vector<std::pair<std::string, torch::Tensor>> take_expert_stacks(const ModelConfig& c, TensorMap& tensors) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (std::int64_t layer = 0; layer < c.num_hidden_layers; ++layer)
    if (c.sparse_layer(layer))
      for (Projection p : {Projection::gate, Projection::up, Projection::down}) {
        out.emplace_back(gguf_expert_stack_name(layer, p), take_expert_stack(c, tensors, layer, p, ".weight"));
        if (c.family().expert_style.biases)
          out.emplace_back(gguf_expert_stack_name(layer, p, ".bias"), take_expert_stack(c, tensors, layer, p, ".bias"));
      }
  return out;
}

}  // namespace

gguf::TensorType gguf_export_type(const std::string& name) {
  std::string upper = name;
  for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  for (auto t : {gguf::TensorType::f32, gguf::TensorType::f16, gguf::TensorType::bf16, gguf::TensorType::q8_0})
    if (gguf::to_string(t) == upper) return t;
  throw invalid_argument("GGUF model export: type '" + name + "' is not one of F32, F16, BF16, Q8_0");
}

void save_gguf_adapter(const Transformer& model, const std::string& path) {
  const std::string what = "GGUF adapter export";
  if (!model.has_lora()) throw conflict(what + ": the model has no LoRA adapters");
  const ModelConfig& config = model.config();
  const std::string arch = gguf_architecture(config, what);
  const auto& lora = *model.lora_options();
  std::vector<gguf::TensorData> tensors;
  const std::string prefix = "base_model.model.", a_suffix = ".lora_A.weight", b_suffix = ".lora_B.weight";
  const TensorMap adapters = model.peft_state_dict();
  for (const auto& [name, a] : adapters) {
    if (!name.ends_with(a_suffix)) continue;
    const std::string module = name.substr(prefix.size(), name.size() - prefix.size() - a_suffix.size());
    if (module.find("." + config.family().names.experts) != std::string::npos)
      throw unsupported(what + ": adapters on the experts (" + module + ") have no llama.cpp layout rlloop writes; "
                        "export the merged model instead");
    if (module == config.family().names.lm_head && config.tie_word_embeddings)
      throw unsupported(what + ": an lm_head adapter on a model with tied embeddings (llama.cpp's model has no "
                        "output matrix to adapt; export the merged model instead)");
    const std::string target = gguf_name_of(config, module + ".weight", what);
    const torch::Tensor& b = adapters.at(prefix + module + b_suffix);
    tensors.push_back(tensor_data(target + ".lora_a", a, gguf::TensorType::f32));
    tensors.push_back(tensor_data(target + ".lora_b", to_gguf_layout(config, target, b), gguf::TensorType::f32));
  }
  const std::map<std::string, gguf::Value> metadata = {
      {"general.architecture", {arch}},
      {"general.type", {std::string("adapter")}},
      {"adapter.type", {std::string("lora")}},
      {"adapter.lora.alpha", {static_cast<float>(lora.alpha)}},
  };
  gguf::write(path, metadata, tensors);
}

void save_gguf_model(const Transformer& model, const std::string& path, gguf::TensorType type,
                     const std::map<std::string, gguf::Value>& carried) {
  const std::string what = "GGUF model export";
  const ModelConfig& config = model.config();
  const std::string arch = gguf_architecture(config, what);
  auto metadata = architecture_metadata(config);
  add_expert_metadata(config, metadata);
  add_rope_scaling_metadata(config, metadata);
  if (config.family().write_gguf_config) config.family().write_gguf_config(config, metadata);
  metadata["general.file_type"] = gguf::Value{file_type(type)};
  if (gguf::block_layout(type)->elements > 1)
    metadata["general.quantization_version"] = gguf::Value{std::uint32_t{2}};
  // The base's keys for what this file does not describe otherwise (the tokenizer, the chat template, names);
  // not its layout, its quantization or architecture keys, which the configuration above states.
  for (const auto& [key, value] : carried)
    if (key != "general.alignment" && key != "general.file_type" && key != "general.quantization_version" &&
        !key.starts_with(arch + "."))
      metadata.emplace(key, value);

  std::vector<gguf::TensorData> tensors;
  auto add = [&](const std::string& name, const torch::Tensor& t) {
    // As llama.cpp's converter: vectors, whatever is not a ".weight" (gpt-oss's [E, out] expert biases, which
    // llama.cpp adds as F32 only) and the router stay F32.
    const bool f32 = t.dim() == 1 || !name.ends_with(".weight") || name.ends_with(".ffn_gate_inp.weight");
    gguf::TensorType stored = f32 ? gguf::TensorType::f32 : type;
    // Rows that are not whole blocks: a K-quant's (256 values) fall back to Q8_0 (llama.cpp's quantizer to Q5_0 or
    // Q8_0, which rlloop writes the one of), Q8_0's to F16.
    if (t.size(-1) % gguf::block_layout(stored)->elements != 0 && stored != gguf::TensorType::q8_0)
      stored = gguf::TensorType::q8_0;
    if (stored == gguf::TensorType::q8_0 && t.size(-1) % 32 != 0) stored = gguf::TensorType::f16;
    tensors.push_back(tensor_data(name, to_gguf_layout(config, name, t), stored));
  };
  TensorMap weights = model.has_lora() ? model.merged_hf_state_dict() : model.hf_state_dict();
  for (const auto& [name, t] : take_expert_stacks(config, weights)) add(name, t);
  for (const auto& [hf, t] : weights) add(gguf_name_of(config, hf, what), t);
  gguf::write(path, metadata, tensors);
}

}  // namespace rlloop::engine
