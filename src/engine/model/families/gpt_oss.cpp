// gpt-oss (gpt-oss-20b, gpt-oss-120b): every layer sparse, with
//   - attention with q/k/v/o biases, a learned sink logit per head (self_attn.sinks) in every softmax, and
//     alternating sliding-window ("sliding_attention", the last sliding_window positions) and full layers
//     (layer_types);
//   - YaRN RoPE (rope_parameters; read by every family, gpt-oss's checkpoints always carry it);
//   - a router with a bias ("mlp.router") whose top num_experts_per_tok logits are softmaxed into the weights;
//   - experts with biases and a clamped SwiGLU ((up + 1) * gate * sigmoid(1.702 gate), both clamped at 7), stored
//     stacked and interleaved in the checkpoint (ExpertStyle::stacked_interleaved).
// Checkpoints as transformers saves them and OpenAI's own, whose experts are MXFP4 (gate_up_proj_blocks / _scales,
// expert_layout.cpp), load, and llama.cpp's GGUF files ("gpt-oss": attn_sinks, post_attention_norm, the router's
// bias, stacked experts with biases, MXFP4 or not). A config.json without the sliding window or RoPE keys takes
// transformers' defaults (GptOssConfig: a window of 128, theta 150000 with YaRN x32 over 4096 positions). Chat
// format: harmony (its tokenizer: tokenizer.json with o200k's split, or o200k_harmony.tiktoken).
#include <map>

#include <nlohmann/json.hpp>

#include <rlloop/error.hpp>
#include <rlloop/gguf.hpp>

#include "model/model_config.hpp"
#include "model/families/families.hpp"

namespace rlloop::engine::families {

namespace {

void read_config(const nlohmann::json& j, ModelConfig& c) {
  try {
    c.swiglu_limit = j.value("swiglu_limit", 7.0);
    c.swiglu_alpha = j.value("swiglu_alpha", 1.702);
    c.sliding_window = j.contains("sliding_window") && !j["sliding_window"].is_null()
                           ? j["sliding_window"].get<std::int64_t>()
                           : 128;
    if (auto it = j.find("layer_types"); it != j.end() && !it->is_null()) {
      c.layer_types = it->get<std::vector<std::string>>();
    } else {  // transformers' default: sliding, full, sliding, ...
      for (std::int64_t i = 0; i < c.num_hidden_layers; ++i)
        c.layer_types.push_back(i % 2 == 0 ? "sliding_attention" : "full_attention");
    }
  } catch (const nlohmann::json::exception& e) {
    throw invalid_argument(std::string("model config: a gpt_oss key has the wrong type: ") + e.what());
  }
  const bool rope_stated = j.contains("rope_parameters") || j.contains("rope_scaling") || j.contains("rope_theta");
  if (!rope_stated) {  // GptOssConfig's defaults
    c.rope_theta = 150000.0;
    c.yarn = ModelConfig::Yarn{.factor = 32.0, .original_max_position_embeddings = 4096, .truncate = false};
  }
  if (!(c.swiglu_limit > 0)) throw invalid_argument("model config: swiglu_limit must be positive");
}

// llama.cpp's gpt-oss files (arch "gpt-oss"): every other layer slides from layer 0 (set_swa_pattern(2): layer i
// slides when i % pattern < pattern - 1), the experts' width is expert_feed_forward_length.
void read_gguf_config(const gguf::File& file, nlohmann::json& j) {
  const std::string a = "gpt-oss.";
  const std::int64_t pattern = file.find(a + "attention.sliding_window_pattern")
                                   ? file.integer(a + "attention.sliding_window_pattern")
                                   : 2;
  if (pattern < 1)
    throw invalid_argument(a + "attention.sliding_window_pattern must be at least 1, got " + std::to_string(pattern));
  j["sliding_window"] = file.integer(a + "attention.sliding_window");
  j["layer_types"] = nlohmann::json::array();
  for (std::int64_t i = 0; i < j["num_hidden_layers"].get<std::int64_t>(); ++i)
    j["layer_types"].push_back(i % pattern < pattern - 1 ? "sliding_attention" : "full_attention");
  j["intermediate_size"] = file.integer(a + "expert_feed_forward_length");
  // gpt-oss's YaRN as its config.json states it (truncate: false, the correction range not rounded to whole
  // dimensions); llama.cpp rounds it (8 and 18 where gpt-oss-20b's are 8.09 and 17.4).
  if (j.contains("rope_parameters")) j["rope_parameters"]["truncate"] = false;
}

void write_gguf_config(const ModelConfig& c, std::map<std::string, gguf::Value>& metadata) {
  if (c.swiglu_limit != 7.0 || c.swiglu_alpha != 1.702)
    throw unsupported("GGUF export: llama.cpp's gpt-oss clamps its SwiGLU at 7 with alpha 1.702, this model at " +
                      std::to_string(c.swiglu_limit) + " with " + std::to_string(c.swiglu_alpha));
  if (static_cast<std::int64_t>(c.layer_types.size()) != c.num_hidden_layers)
    throw unsupported("GGUF export: llama.cpp's gpt-oss needs a type for each of the " +
                      std::to_string(c.num_hidden_layers) + " layers");
  for (std::size_t i = 0; i < c.layer_types.size(); ++i)
    if (c.layer_types[i] != (i % 2 == 0 ? "sliding_attention" : "full_attention"))
      throw unsupported("GGUF export: llama.cpp's gpt-oss slides every other layer from layer 0; layer " +
                        std::to_string(i) + " is " + c.layer_types[i]);
  metadata["gpt-oss.attention.sliding_window"] = gguf::Value{static_cast<std::uint32_t>(c.sliding_window)};
}

void write_config(const ModelConfig& c, nlohmann::json& j) {
  j["num_local_experts"] = c.num_experts;
  j.erase("num_experts");
  j.erase("moe_intermediate_size");
  j.erase("norm_topk_prob");
  j.erase("decoder_sparse_step");
  j.erase("mlp_only_layers");
  j["swiglu_limit"] = c.swiglu_limit;
  j["swiglu_alpha"] = c.swiglu_alpha;
  j["sliding_window"] = c.sliding_window;
  j["layer_types"] = c.layer_types;
}

}  // namespace

ModelFamily gpt_oss() {
  ModelFamily f;
  f.model_type = "gpt_oss";
  f.hf_architecture = "GptOssForCausalLM";
  f.gguf_architecture = "gpt-oss";
  f.gguf_post_norm = "post_attention_norm";
  f.attention_bias_default = true;
  f.o_proj_bias = true;
  f.experts = true;
  f.attention_sinks = true;
  f.expert_style.softmax_after_top_k = true;
  f.expert_style.router_bias = true;
  f.expert_style.biases = true;
  f.expert_style.clamped_swiglu = true;
  f.expert_style.stacked_interleaved = true;
  f.expert_style.width_key = "intermediate_size";
  f.names.router = "mlp.router";
  f.chat_renderer = "harmony";
  f.read_config = read_config;
  f.read_gguf_config = read_gguf_config;
  f.write_gguf_config = write_gguf_config;
  f.write_config = write_config;
  return f;
}

}  // namespace rlloop::engine::families
