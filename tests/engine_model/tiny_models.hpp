// What the engine-model tests build their models and caches from.
#pragma once
#include <string>

#include <nlohmann/json.hpp>

#include "model/model_config.hpp"
#include "model/transformer.hpp"

namespace rlloop::engine::test_models {

// A 2-layer config of the given family: hidden 32, 4 query heads over 2 key/value heads (GQA), vocabulary 64.
inline ModelConfig tiny_config(const std::string& model_type, bool tied = false, int max_positions = 256) {
  const nlohmann::json j = {{"model_type", model_type},
                            {"vocab_size", 64},
                            {"hidden_size", 32},
                            {"intermediate_size", 48},
                            {"num_hidden_layers", 2},
                            {"num_attention_heads", 4},
                            {"num_key_value_heads", 2},
                            {"tie_word_embeddings", tied},
                            {"max_position_embeddings", max_positions},
                            {"rope_theta", 10000.0},
                            {"rms_norm_eps", 1e-6}};
  return ModelConfig::from_json(j);
}

// tiny_config's Qwen3-MoE: both layers sparse, 6 experts of width 24, two per token, weights renormalised.
inline ModelConfig tiny_moe_config() {
  nlohmann::json j = tiny_config("qwen3").to_json();
  j["model_type"] = "qwen3_moe";
  j["num_experts"] = 6;
  j["num_experts_per_tok"] = 2;
  j["moe_intermediate_size"] = 24;
  j["norm_topk_prob"] = true;
  return ModelConfig::from_json(j);
}

}  // namespace rlloop::engine::test_models
