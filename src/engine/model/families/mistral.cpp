// Mistral (Mistral-7B v0.1-v0.3, Mistral-Nemo, Codestral-22B; transformers' MistralForCausalLM): Llama's dense
// decoder with every layer's attention limited to the last `sliding_window` positions when config.json states one
// (v0.1: 4096; null or absent in the later ones, which attend to everything), and head_dim stated apart from
// hidden_size / heads (Nemo: 128 of 5120 / 32). No biases anywhere.
// GGUF: llama.cpp's converter writes these models as architecture "llama" and runs them without the window, so
// their GGUF files load through the Llama family (same tensors, same q/k row order) and this family exports none.
// Chat format: the tokenizer's own template ([INST] ... [/INST]); without one, Llama 2's, the nearest built in.
#include <nlohmann/json.hpp>

#include <rlloop/error.hpp>

#include "model/model_config.hpp"
#include "model/families/families.hpp"

namespace rlloop::engine::families {

namespace {

void read_config(const nlohmann::json& j, ModelConfig& c) {
  const auto window = j.find("sliding_window");
  if (window == j.end() || window->is_null()) return;
  if (!window->is_number_integer())
    throw invalid_argument("model config: mistral's sliding_window must be an integer or null, got " + window->dump());
  c.sliding_window = window->get<std::int64_t>();
  if (c.sliding_window <= 0)
    throw invalid_argument("model config: mistral's sliding_window must be positive, got " +
                           std::to_string(c.sliding_window));
  c.layer_types.assign(static_cast<std::size_t>(c.num_hidden_layers), "sliding_attention");
}

void write_config(const ModelConfig& c, nlohmann::json& j) {
  j["sliding_window"] = c.sliding_window > 0 ? nlohmann::json(c.sliding_window) : nlohmann::json(nullptr);
}

}  // namespace

ModelFamily mistral() {
  ModelFamily f;
  f.model_type = "mistral";
  f.hf_architecture = "MistralForCausalLM";
  f.attention_bias_default = false;
  f.qk_norm = false;
  f.chat_renderer = "llama2";
  f.read_config = read_config;
  f.write_config = write_config;
  return f;
}

}  // namespace rlloop::engine::families
