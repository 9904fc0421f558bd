// Gemma 2 (gemma-2-2b, -9b, -27b and their -it; transformers' Gemma2ForCausalLM): a dense decoder with
//   - sandwich norms: attention's and the MLP's outputs RMS-normed before their residual adds
//     (post_attention_layernorm, post_feedforward_layernorm), the MLP's input by pre_feedforward_layernorm;
//   - RMSNorm scaling by (1 + w), the checkpoints' norms zero at identity;
//   - GeGLU (hidden_activation gelu_pytorch_tanh) and the embeddings scaled by sqrt(hidden_size);
//   - attention scaled by query_pre_attn_scalar^-1/2 and its logits soft-capped at attn_logit_softcapping, the
//     output logits at final_logit_softcapping (cap * tanh(x / cap));
//   - sliding-window attention on the layers layer_types names (transformers' default: every other layer from
//     layer 0, a window of sliding_window = 4096).
// A config.json without one of these keys takes Gemma2Config's default, as transformers does. Tied embeddings by
// default. No GGUF architecture yet (llama.cpp's "gemma2" stores its norms with the one added and derives the
// attention scale from the model's size). Chat format: Gemma's turns ("gemma").
#include <cmath>

#include <nlohmann/json.hpp>

#include <rlloop/error.hpp>

#include "model/model_config.hpp"
#include "model/families/families.hpp"

namespace rlloop::engine::families {

// (A namespace of its own: the engine compiles its files in unity batches, where file-local names of two families
// would meet in one translation unit.)
namespace gemma2_keys {

// A positive number, Gemma2Config's default when absent, 0 (none) when null.
double positive_or_default(const nlohmann::json& j, const char* key, double fallback) {
  const auto it = j.find(key);
  if (it == j.end()) return fallback;
  if (it->is_null()) return 0;
  if (!it->is_number() || !(it->get<double>() > 0))
    throw invalid_argument(std::string("model config: gemma2's ") + key + " must be a positive number or null, got " +
                           it->dump());
  return it->get<double>();
}

void read_config(const nlohmann::json& j, ModelConfig& c) {
  if (!j.contains("hidden_activation") && !j.contains("hidden_act"))
    c.hidden_activation = ModelConfig::Activation::gelu_tanh;
  if (!j.contains("tie_word_embeddings")) c.tie_word_embeddings = true;
  if (j.contains("use_bidirectional_attention") && j["use_bidirectional_attention"].is_boolean() &&
      j["use_bidirectional_attention"].get<bool>())
    throw unsupported("model config: gemma2's use_bidirectional_attention=true is not supported (causal only)");
  c.query_pre_attn_scalar = positive_or_default(j, "query_pre_attn_scalar", 256);
  if (c.query_pre_attn_scalar == 0)
    throw invalid_argument("model config: gemma2's query_pre_attn_scalar must be a positive number");
  c.attn_logit_softcapping = positive_or_default(j, "attn_logit_softcapping", 50.0);
  c.final_logit_softcapping = positive_or_default(j, "final_logit_softcapping", 30.0);
  const auto window = j.find("sliding_window");
  if (window != j.end() && !window->is_null() && !window->is_number_integer())
    throw invalid_argument("model config: gemma2's sliding_window must be an integer or null, got " + window->dump());
  c.sliding_window = window == j.end() ? 4096 : window->is_null() ? 0 : window->get<std::int64_t>();
  try {
    if (auto it = j.find("layer_types"); it != j.end() && !it->is_null()) {
      c.layer_types = it->get<std::vector<std::string>>();
    } else if (c.sliding_window > 0) {  // Gemma2Config's default: sliding, full, sliding, ...
      for (std::int64_t i = 0; i < c.num_hidden_layers; ++i)
        c.layer_types.push_back(i % 2 == 0 ? "sliding_attention" : "full_attention");
    }
  } catch (const nlohmann::json::exception& e) {
    throw invalid_argument(std::string("model config: gemma2's layer_types must be a list of strings: ") + e.what());
  }
}

void write_config(const ModelConfig& c, nlohmann::json& j) {
  j["hidden_activation"] = j["hidden_act"];
  auto nullable = [](double v) { return v > 0 ? nlohmann::json(v) : nlohmann::json(nullptr); };
  // (An integer where it is one: transformers' Gemma2Config takes no float there.)
  const double scalar = c.query_pre_attn_scalar;
  const bool whole = scalar == std::floor(scalar) && scalar < 1e15;
  j["query_pre_attn_scalar"] = whole ? nlohmann::json(static_cast<std::int64_t>(scalar)) : nlohmann::json(scalar);
  j["attn_logit_softcapping"] = nullable(c.attn_logit_softcapping);
  j["final_logit_softcapping"] = nullable(c.final_logit_softcapping);
  j["sliding_window"] = c.sliding_window > 0 ? nlohmann::json(c.sliding_window) : nlohmann::json(nullptr);
  if (!c.layer_types.empty()) j["layer_types"] = c.layer_types;
}

}  // namespace gemma2_keys

ModelFamily gemma2() {
  ModelFamily f;
  f.model_type = "gemma2";
  f.hf_architecture = "Gemma2ForCausalLM";
  f.attention_bias_default = false;
  f.o_proj_bias = true;
  f.sandwich_norms = true;
  f.norm_adds_one = true;
  f.scale_embeddings = true;
  f.names.post_norm = "pre_feedforward_layernorm";
  f.names.attn_out_norm = "post_attention_layernorm";
  f.names.mlp_out_norm = "post_feedforward_layernorm";
  f.chat_renderer = "gemma";
  f.read_config = gemma2_keys::read_config;
  f.write_config = gemma2_keys::write_config;
  return f;
}

}  // namespace rlloop::engine::families
