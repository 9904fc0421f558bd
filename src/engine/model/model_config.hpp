// Decoder-only transformer configuration read from a Hugging Face config.json (the families of model_family.hpp).
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include <rlloop/types.hpp>

#include "model/model_family.hpp"

namespace rlloop::engine {

struct ModelConfig {
  std::string model_type = "llama";  // a registered family's (model_family.hpp): "llama", "qwen2", "qwen3", ...
  std::int64_t vocab_size = 0;
  std::int64_t hidden_size = 0;
  std::int64_t intermediate_size = 0;
  std::int64_t num_hidden_layers = 0;
  std::int64_t num_attention_heads = 0;
  std::int64_t num_key_value_heads = 0;  // grouped-query attention; defaults to num_attention_heads
  std::int64_t head_dim = 0;             // defaults to hidden_size / num_attention_heads
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  std::int64_t max_position_embeddings = 2048;
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // QKV bias: true for qwen2 unless config says otherwise
  bool qk_norm = false;         // per-head RMSNorm on q and k: qwen3
  // The MLP's gated activation, config.json's hidden_activation (or hidden_act): silu(gate) * up ("silu": SwiGLU)
  // or gelu_tanh(gate) * up ("gelu_pytorch_tanh": GeGLU, Gemma).
  enum class Activation { silu, gelu_tanh };
  Activation hidden_activation = Activation::silu;
  // The family's layer parts (ModelFamily::sandwich_norms, norm_adds_one, scale_embeddings), copied as qk_norm is.
  bool sandwich_norms = false;
  bool norm_adds_one = false;
  bool scale_embeddings = false;
  // Gemma 2's attention and output (a family's read_config sets them; 0: absent): the attention logits scaled by
  // query_pre_attn_scalar^-1/2 in place of head_dim^-1/2, and soft-capped, s -> cap * tanh(s / cap), before the
  // mask, as are the output logits with final_logit_softcapping.
  double query_pre_attn_scalar = 0;
  double attn_logit_softcapping = 0;
  double final_logit_softcapping = 0;
  // Mixture of experts (families with `experts`, e.g. qwen3_moe): in a sparse layer (sparse_layer) a router picks
  // num_experts_per_tok of num_experts SwiGLU experts of width moe_intermediate_size for each token, weighted by its
  // softmax probabilities (renormalised over the chosen ones with norm_topk_prob). num_experts 0: every layer dense.
  std::int64_t num_experts = 0;
  std::int64_t num_experts_per_tok = 0;
  std::int64_t moe_intermediate_size = 0;
  bool norm_topk_prob = false;
  std::int64_t decoder_sparse_step = 1;      // every step-th layer is sparse (HF: (layer + 1) % step == 0)
  std::vector<std::int64_t> mlp_only_layers;  // layers kept dense whatever the step
  // gpt-oss's clamped SwiGLU (ExpertStyle::clamped_swiglu): the clamp and the sigmoid's gain.
  double swiglu_limit = 7.0;
  double swiglu_alpha = 1.702;
  // Sliding-window attention: the layers layer_types names "sliding_attention" see the last sliding_window positions
  // (their own included); the others all. Empty layer_types: every layer sees all.
  std::int64_t sliding_window = 0;
  std::vector<std::string> layer_types;
  // YaRN's RoPE scaling (rope_type "yarn" in rope_parameters / rope_scaling), as transformers computes it:
  // frequencies interpolated by `factor` below the correction range [beta_slow, beta_fast] rotations within
  // original_max_position_embeddings, kept above it, ramped between; cos and sin scaled by attention_factor
  // (default 0.1 ln(factor) + 1).
  struct Yarn {
    double factor = 1.0;
    double beta_fast = 32.0, beta_slow = 1.0;
    std::int64_t original_max_position_embeddings = 0;
    bool truncate = true;
    std::optional<double> attention_factor;
  };
  std::optional<Yarn> yarn;
  std::optional<std::int64_t> bos_token_id;
  std::optional<std::int64_t> eos_token_id;
  // rlloop extension key "rlloop_tokenizer": "byte" for byte-level models; empty = tokenizer.json beside config.
  std::string tokenizer;

  // Parses HF config.json content; missing required fields and inconsistent sizes throw invalid_argument.
  static ModelConfig from_json(const nlohmann::json& j);
  static ModelConfig load(const std::string& config_json_path);
  nlohmann::json to_json() const;
  void validate() const;
  std::int64_t num_parameters() const;  // without LoRA
  // Parameters a token computes with: num_parameters less the experts it is not routed to.
  std::int64_t active_parameters() const;
  // Whether layer `layer` has a router and experts in place of the dense MLP.
  bool sparse_layer(std::int64_t layer) const;
  // What routes must fit (all zero for a dense model).
  ExpertShape expert_shape() const;
  // The attention window of layer `layer`: sliding_window for a "sliding_attention" layer, 0 (all) otherwise.
  std::int64_t attention_window(std::int64_t layer) const;
  // What the attention logits q.k are multiplied by: query_pre_attn_scalar^-1/2, else head_dim^-1/2.
  double attention_scale() const;
  // What the embeddings are multiplied by: sqrt(hidden_size) with scale_embeddings, else 1.
  double embedding_multiplier() const;
  // The family of model_type (model_family.hpp); invalid_argument naming the supported ones for another.
  const ModelFamily& family() const;
  // HF puts a bias on o_proj too when attention_bias is set, except Qwen2 (q/k/v biases only).
  bool o_proj_bias() const { return attention_bias && family().o_proj_bias; }
};

}  // namespace rlloop::engine
