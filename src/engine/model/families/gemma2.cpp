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
// default. llama.cpp's GGUF files ("gemma2") read and written: its norms stored as 1 + w (gguf_model.cpp), the
// sandwich norms named post_attention_norm and post_ffw_norm, the attention scale derived from the model's size.
// Chat format: Gemma's turns ("gemma").
#include <cmath>
#include <map>

#include <nlohmann/json.hpp>

#include <rlloop/error.hpp>
#include <rlloop/gguf.hpp>

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

// The query_pre_attn_scalar llama.cpp's gemma2 runs a model with, which its files do not state: it derives the
// attention scale from the model's size as gemma_pytorch's configs do, (hidden / heads)^-1/2 for the 27B (46 layers),
// head_dim^-1/2 for the others (llama-model.cpp).
std::int64_t llama_cpp_query_scalar(std::int64_t layers, std::int64_t hidden, std::int64_t heads,
                                    std::int64_t head_dim) {
  return layers == 46 ? hidden / heads : head_dim;
}

// llama.cpp's gemma2 files: every other layer slides from layer 0 (set_swa_pattern(2)); a window of 4096 and caps of
// 50 (attention) and 30 (output) where the file has no key, as llama.cpp reads them.
void read_gguf_config(const gguf::File& file, nlohmann::json& j) {
  const std::string a = "gemma2.";
  auto number_or = [&](const std::string& key, double fallback) {
    return file.find(key) ? file.number(key) : fallback;
  };
  j["attn_logit_softcapping"] = number_or(a + "attn_logit_softcapping", 50.0);
  j["final_logit_softcapping"] = number_or(a + "final_logit_softcapping", 30.0);
  j["sliding_window"] = file.find(a + "attention.sliding_window") ? file.integer(a + "attention.sliding_window") : 4096;
  const auto layers = j["num_hidden_layers"].get<std::int64_t>();
  j["layer_types"] = nlohmann::json::array();
  for (std::int64_t i = 0; i < layers; ++i)
    j["layer_types"].push_back(i % 2 == 0 ? "sliding_attention" : "full_attention");
  const auto hidden = j["hidden_size"].get<std::int64_t>(), heads = j["num_attention_heads"].get<std::int64_t>();
  if (heads < 1) throw invalid_argument(a + "attention.head_count must be at least 1");
  const std::int64_t head_dim = j.contains("head_dim") ? j["head_dim"].get<std::int64_t>() : hidden / heads;
  j["query_pre_attn_scalar"] = llama_cpp_query_scalar(layers, hidden, heads, head_dim);
}

// Refuses what llama.cpp's gemma2 would run otherwise than this model: another attention scale, no soft-cap, another
// activation or another pattern of sliding layers.
void write_gguf_config(const ModelConfig& c, std::map<std::string, gguf::Value>& metadata) {
  const std::string what = "GGUF export: llama.cpp's gemma2 ";
  const std::int64_t head_dim = c.head_dim ? c.head_dim : c.hidden_size / c.num_attention_heads;
  const std::int64_t scalar = llama_cpp_query_scalar(c.num_hidden_layers, c.hidden_size, c.num_attention_heads,
                                                     head_dim);
  auto text = [](double v) { return nlohmann::json(v).dump(); };  // 24.0 -> "24.0", not "24.000000"
  if (c.query_pre_attn_scalar != static_cast<double>(scalar))
    throw unsupported(what + "scales attention by " + std::to_string(scalar) + "^-1/2 for this model's size (" +
                      std::to_string(c.num_hidden_layers) + " layers), the model by query_pre_attn_scalar " +
                      text(c.query_pre_attn_scalar) + "^-1/2");
  if (!(c.attn_logit_softcapping > 0) || !(c.final_logit_softcapping > 0))
    throw unsupported(what + "soft-caps attention and the output logits always; this model does not (caps " +
                      text(c.attn_logit_softcapping) + " and " + text(c.final_logit_softcapping) + ", 0 for none)");
  if (c.hidden_activation != ModelConfig::Activation::gelu_tanh)
    throw unsupported(what + "runs GeGLU (gelu_pytorch_tanh); this model's MLP is SwiGLU");
  if (!(c.sliding_window > 0) || static_cast<std::int64_t>(c.layer_types.size()) != c.num_hidden_layers)
    throw unsupported(what + "slides a window over every other layer; this model has no window or no layer types");
  for (std::size_t i = 0; i < c.layer_types.size(); ++i)
    if (c.layer_types[i] != (i % 2 == 0 ? "sliding_attention" : "full_attention"))
      throw unsupported(what + "slides every other layer from layer 0; layer " + std::to_string(i) + " is " +
                        c.layer_types[i]);
  const std::string a = "gemma2.";
  metadata[a + "attn_logit_softcapping"] = gguf::Value{static_cast<float>(c.attn_logit_softcapping)};
  metadata[a + "final_logit_softcapping"] = gguf::Value{static_cast<float>(c.final_logit_softcapping)};
  metadata[a + "attention.sliding_window"] = gguf::Value{static_cast<std::uint32_t>(c.sliding_window)};
}

}  // namespace gemma2_keys

ModelFamily gemma2() {
  ModelFamily f;
  f.model_type = "gemma2";
  f.hf_architecture = "Gemma2ForCausalLM";
  f.gguf_architecture = "gemma2";
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
  f.read_gguf_config = gemma2_keys::read_gguf_config;
  f.write_gguf_config = gemma2_keys::write_gguf_config;
  return f;
}

}  // namespace rlloop::engine::families
