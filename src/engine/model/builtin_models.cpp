#include "model/builtin_models.hpp"

#include <rlloop/tokenizer.hpp>

namespace rlloop::engine {
namespace {
ModelConfig byte_level(std::int64_t hidden, std::int64_t layers, std::int64_t heads, std::int64_t kv_heads,
                       std::int64_t intermediate, std::int64_t max_positions) {
  ModelConfig c;
  c.model_type = "llama";
  c.vocab_size = byte_tokens::vocab_size;
  c.hidden_size = hidden;
  c.num_hidden_layers = layers;
  c.num_attention_heads = heads;
  c.num_key_value_heads = kv_heads;
  c.head_dim = hidden / heads;
  c.intermediate_size = intermediate;
  c.max_position_embeddings = max_positions;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 10000.0;
  c.tie_word_embeddings = true;
  c.eos_token_id = byte_tokens::endoftext;
  c.bos_token_id = byte_tokens::im_start;
  c.tokenizer = "byte";
  return c;
}
}  // namespace

std::optional<ModelConfig> builtin_model(const std::string& name) {
  // 1024 positions: room for a prompt beside the 512 new tokens the runtime model's maxTokens asks for at least
  // (RoPE: the position count changes no weight).
  if (name == "rlloop-tiny") return byte_level(32, 2, 4, 2, 64, 1024);
  if (name == "rlloop-small") return byte_level(128, 4, 4, 4, 384, 1024);
  if (name == "rlloop-100m") {
    // ~100M parameters with a 32k vocabulary (the byte tokenizer uses the first 260 ids).
    ModelConfig c = byte_level(768, 12, 12, 12, 2048, 1024);
    c.vocab_size = 32000;
    return c;
  }
  // rlloop-tiny's attention with Qwen3-MoE's sparse layers: 8 experts of width 16, two per token.
  if (name == "rlloop-tiny-moe") return with_experts(byte_level(32, 2, 4, 2, 64, 1024), 8, 2, 16);
  // rlloop-tiny's shapes as gpt-oss: 8 experts of width 16, two per token, a sliding window of 8 on layer 0.
  if (name == "rlloop-tiny-gpt-oss") return as_gpt_oss(byte_level(32, 2, 4, 2, 64, 1024), 8, 2, 16, 8);
  return std::nullopt;
}

ModelConfig as_gpt_oss(ModelConfig c, std::int64_t experts, std::int64_t per_token, std::int64_t width,
                       std::int64_t window) {
  c.model_type = "gpt_oss";
  c.attention_bias = true;
  c.num_experts = experts;
  c.num_experts_per_tok = per_token;
  c.moe_intermediate_size = width;
  c.intermediate_size = width;
  c.sliding_window = window;
  c.layer_types.clear();
  for (std::int64_t i = 0; i < c.num_hidden_layers; ++i)
    c.layer_types.push_back(i % 2 == 0 ? "sliding_attention" : "full_attention");
  c.rope_theta = 150000.0;
  // gpt-oss's YaRN (factor 32 over 4096 positions), scaled down to this context.
  c.yarn = ModelConfig::Yarn{.factor = 4.0,
                             .beta_fast = 32.0,
                             .beta_slow = 1.0,
                             .original_max_position_embeddings = c.max_position_embeddings / 4,
                             .truncate = false};
  return c;
}

ModelConfig with_experts(ModelConfig c, std::int64_t experts, std::int64_t per_token, std::int64_t width) {
  c.model_type = "qwen3_moe";
  c.qk_norm = true;
  c.num_experts = experts;
  c.num_experts_per_tok = per_token;
  c.moe_intermediate_size = width;
  c.norm_topk_prob = true;
  return c;
}

std::vector<std::string> builtin_model_names() {
  return {"rlloop-tiny", "rlloop-small", "rlloop-100m", "rlloop-tiny-moe", "rlloop-tiny-gpt-oss"};
}

}  // namespace rlloop::engine
