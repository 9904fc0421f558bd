// ModelConfig <-> Hugging Face config.json.
#include "model/model_config.hpp"

#include <cmath>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include <rlloop/error.hpp>

namespace rlloop::engine {
namespace {

using nlohmann::json;

std::int64_t required_int(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null())
    throw invalid_argument(std::string("model config: missing required field '") + key + "'");
  if (!it->is_number_integer())
    throw invalid_argument(std::string("model config: field '") + key + "' must be an integer, got " + it->dump());
  return it->get<std::int64_t>();
}

template <class T>
T optional_value(const json& j, const char* key, T fallback) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  try {
    return it->get<T>();
  } catch (const json::exception&) {
    throw invalid_argument(std::string("model config: field '") + key + "' has the wrong type: " + it->dump());
  }
}

// HF allows a list of ids for bos/eos (Llama 3 lists several EOS ids); the first one is the canonical one.
std::optional<std::int64_t> optional_token_id(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::nullopt;
  if (it->is_number_integer()) return it->get<std::int64_t>();
  if (it->is_array() && !it->empty() && (*it)[0].is_number_integer()) return (*it)[0].get<std::int64_t>();
  if (it->is_array() && it->empty()) return std::nullopt;
  throw invalid_argument(std::string("model config: field '") + key + "' must be a token id or a list of ids, got " +
                         it->dump());
}

// Reads the RoPE scaling of `params`, the value of the key `where` ("rope_scaling" or "rope_parameters"): plain
// RoPE, or YaRN into `yarn`; others (llama3, linear, dynamic, longrope, ...) are refused, as is a per-layer-type
// object ({"full_attention": {...}, ...}), whose types and thetas sit one level down out of sight of a plain
// reading, and DeepSeek's mscale variant of YaRN.
void read_rope_scaling(const json& params, const std::string& where, std::optional<ModelConfig::Yarn>& yarn) {
  if (!params.is_object())
    throw invalid_argument("model config: field '" + where + "' must be an object, got " + params.dump());
  for (const auto& [key, value] : params.items())
    if (value.is_object())
      throw unsupported("model config: per-layer-type " + where + " ('" + key + "') is not supported");
  auto type = optional_value<std::string>(params, "rope_type", optional_value<std::string>(params, "type", "default"));
  if (type == "default") return;
  if (type != "yarn") throw unsupported("model config: " + where + " type '" + type + "' is not supported");
  if (params.contains("mscale") || params.contains("mscale_all_dim"))
    throw unsupported("model config: " + where + ": YaRN's mscale / mscale_all_dim are not supported");
  ModelConfig::Yarn y;
  y.factor = optional_value<double>(params, "factor", 0.0);
  y.beta_fast = optional_value<double>(params, "beta_fast", 32.0);
  y.beta_slow = optional_value<double>(params, "beta_slow", 1.0);
  y.original_max_position_embeddings = optional_value<std::int64_t>(params, "original_max_position_embeddings", 0);
  y.truncate = optional_value<bool>(params, "truncate", true);
  if (auto it = params.find("attention_factor"); it != params.end() && !it->is_null())
    y.attention_factor = optional_value<double>(params, "attention_factor", 1.0);
  if (!(y.factor >= 1.0))
    throw invalid_argument("model config: " + where + ".factor must be >= 1 for YaRN, got " +
                           params.value("factor", json()).dump());
  if (y.original_max_position_embeddings <= 0)
    throw invalid_argument("model config: " + where + ".original_max_position_embeddings must be positive for YaRN");
  if (!(y.beta_fast > 0 && y.beta_slow > 0))
    throw invalid_argument("model config: " + where + ".beta_fast and beta_slow must be positive");
  yarn = y;
}

std::optional<double> optional_rope_theta(const json& j, const std::string& where) {
  auto it = j.find("rope_theta");
  if (it == j.end() || it->is_null()) return std::nullopt;
  if (!it->is_number())
    throw invalid_argument("model config: field '" + where + "' must be a number, got " + it->dump());
  return it->get<double>();
}

// transformers 4.x writes the RoPE base as top-level "rope_theta" (scaled variants in "rope_scaling"); 5.x writes
// "rope_parameters": {"rope_theta": ..., "rope_type": ...}. Either is read. A file stating two different thetas
// is refused rather than resolved by guessing which one its writer meant.
double read_rope(const json& j, std::optional<ModelConfig::Yarn>& yarn) {
  std::optional<double> theta = optional_rope_theta(j, "rope_theta");
  if (auto it = j.find("rope_scaling"); it != j.end() && !it->is_null()) read_rope_scaling(*it, "rope_scaling", yarn);
  if (auto it = j.find("rope_parameters"); it != j.end() && !it->is_null()) {
    read_rope_scaling(*it, "rope_parameters", yarn);
    std::optional<double> nested = optional_rope_theta(*it, "rope_parameters.rope_theta");
    if (theta && nested && *theta != *nested) {
      std::ostringstream msg;
      msg.precision(17);
      msg << "model config: rope_theta " << *theta << " and rope_parameters.rope_theta " << *nested
          << " disagree; remove one of them";
      throw invalid_argument(msg.str());
    }
    if (nested) theta = nested;
  }
  return theta.value_or(10000.0);
}

// The expert keys of a family with experts (Qwen2-MoE's names, which Qwen3-MoE shares; the width's key is the
// family's).
void read_expert_keys(const json& j, ModelConfig& c, const ExpertStyle& style) {
  // transformers 5 writes num_local_experts (its attribute map's name for num_experts); 4.x wrote num_experts.
  const bool local = j.contains("num_local_experts") && !j.contains("num_experts");
  c.num_experts = required_int(j, local ? "num_local_experts" : "num_experts");
  if (!local && j.contains("num_local_experts") && j["num_local_experts"] != j["num_experts"])
    throw invalid_argument("model config: num_experts " + j["num_experts"].dump() + " and num_local_experts " +
                           j["num_local_experts"].dump() + " disagree; remove one of them");
  c.num_experts_per_tok = required_int(j, "num_experts_per_tok");
  c.moe_intermediate_size = required_int(j, style.width_key.c_str());
  c.norm_topk_prob = optional_value<bool>(j, "norm_topk_prob", false);
  c.decoder_sparse_step = optional_value<std::int64_t>(j, "decoder_sparse_step", 1);
  c.mlp_only_layers = optional_value<std::vector<std::int64_t>>(j, "mlp_only_layers", {});
  // Qwen2-MoE's shared expert (beside the routed ones) is a layer part of its own: refused rather than dropped.
  if (optional_value<std::int64_t>(j, "shared_expert_intermediate_size", 0) > 0)
    throw unsupported("model config: shared experts (shared_expert_intermediate_size) are not supported");
}

// hidden_activation where the config states it (Gemma's name; its hidden_act may say otherwise), else hidden_act.
ModelConfig::Activation read_activation(const json& j) {
  const char* key = j.contains("hidden_activation") && !j["hidden_activation"].is_null() ? "hidden_activation"
                                                                                          : "hidden_act";
  const std::string act = optional_value<std::string>(j, key, "silu");
  if (act == "silu") return ModelConfig::Activation::silu;
  if (act == "gelu_pytorch_tanh") return ModelConfig::Activation::gelu_tanh;
  throw unsupported("model config: " + std::string(key) + " '" + act +
                    "' is not supported (silu, gelu_pytorch_tanh)");
}

}  // namespace

ModelConfig ModelConfig::from_json(const nlohmann::json& j) {
  if (!j.is_object()) throw invalid_argument("model config: expected a JSON object, got " + std::string(j.type_name()));
  ModelConfig c;
  c.model_type = optional_value<std::string>(j, "model_type", "llama");
  const ModelFamily& family = c.family();
  c.vocab_size = required_int(j, "vocab_size");
  c.hidden_size = required_int(j, "hidden_size");
  c.intermediate_size = required_int(j, "intermediate_size");
  c.num_hidden_layers = required_int(j, "num_hidden_layers");
  c.num_attention_heads = required_int(j, "num_attention_heads");
  c.num_key_value_heads = optional_value<std::int64_t>(j, "num_key_value_heads", c.num_attention_heads);
  // Qwen3 states head_dim explicitly and it need not be hidden_size / heads (Qwen3-0.6B: 1024 / 16 heads, 128).
  c.head_dim = optional_value<std::int64_t>(j, "head_dim",
                                            c.num_attention_heads > 0 ? c.hidden_size / c.num_attention_heads : 0);
  c.rms_norm_eps = optional_value<double>(j, "rms_norm_eps", 1e-6);
  c.rope_theta = read_rope(j, c.yarn);  // refuses RoPE scalings other than YaRN
  c.max_position_embeddings = optional_value<std::int64_t>(j, "max_position_embeddings", 2048);
  c.tie_word_embeddings = optional_value<bool>(j, "tie_word_embeddings", false);
  // Qwen2 always has q/k/v biases (its config has no attention_bias key); Llama and Qwen3 default to none.
  c.attention_bias = optional_value<bool>(j, "attention_bias", family.attention_bias_default);
  c.qk_norm = family.qk_norm;
  c.sandwich_norms = family.sandwich_norms;
  c.norm_adds_one = family.norm_adds_one;
  c.scale_embeddings = family.scale_embeddings;
  c.hidden_activation = read_activation(j);
  c.bos_token_id = optional_token_id(j, "bos_token_id");
  c.eos_token_id = optional_token_id(j, "eos_token_id");
  c.tokenizer = optional_value<std::string>(j, "rlloop_tokenizer", "");

  // Features we do not implement must not load silently with the wrong math.
  if (optional_value<bool>(j, "mlp_bias", false)) throw unsupported("model config: mlp_bias=true is not supported");
  if (optional_value<bool>(j, "use_sliding_window", false))
    throw unsupported("model config: use_sliding_window=true is not supported");
  if (family.experts) read_expert_keys(j, c, family.expert_style);
  if (family.read_config) family.read_config(j, c);
  c.validate();
  return c;
}

ModelConfig ModelConfig::load(const std::string& config_json_path) {
  std::ifstream in(config_json_path);
  if (!in) throw io_error("model config: cannot open " + config_json_path);
  json j;
  try {
    j = json::parse(in);
  } catch (const json::exception& e) {
    throw io_error("model config: " + config_json_path + " is not valid JSON: " + e.what());
  }
  try {
    return from_json(j);
  } catch (const invalid_argument& e) {
    throw invalid_argument(std::string(e.what()) + " (in " + config_json_path + ")");
  } catch (const unsupported& e) {
    throw unsupported(std::string(e.what()) + " (in " + config_json_path + ")");
  }
}

namespace {
const char* activation_name(ModelConfig::Activation a) {
  switch (a) {
    case ModelConfig::Activation::silu: return "silu";
    case ModelConfig::Activation::gelu_tanh: return "gelu_pytorch_tanh";
  }
  throw std::logic_error("activation_name: not an activation");
}
}  // namespace

nlohmann::json ModelConfig::to_json() const {
  json j;
  j["architectures"] = json::array({family().hf_architecture});
  j["model_type"] = model_type;
  j["vocab_size"] = vocab_size;
  j["hidden_size"] = hidden_size;
  j["intermediate_size"] = intermediate_size;
  j["num_hidden_layers"] = num_hidden_layers;
  j["num_attention_heads"] = num_attention_heads;
  j["num_key_value_heads"] = num_key_value_heads;
  j["head_dim"] = head_dim;
  j["hidden_act"] = activation_name(hidden_activation);
  j["rms_norm_eps"] = rms_norm_eps;
  j["rope_theta"] = rope_theta;
  j["max_position_embeddings"] = max_position_embeddings;
  j["tie_word_embeddings"] = tie_word_embeddings;
  j["attention_bias"] = attention_bias;
  j["bos_token_id"] = bos_token_id ? json(*bos_token_id) : json(nullptr);
  j["eos_token_id"] = eos_token_id ? json(*eos_token_id) : json(nullptr);
  if (!tokenizer.empty()) j["rlloop_tokenizer"] = tokenizer;
  if (num_experts > 0) {
    j["num_experts"] = num_experts;
    j["num_experts_per_tok"] = num_experts_per_tok;
    j["moe_intermediate_size"] = moe_intermediate_size;
    j["norm_topk_prob"] = norm_topk_prob;
    j["decoder_sparse_step"] = decoder_sparse_step;
    j["mlp_only_layers"] = mlp_only_layers;
  }
  if (yarn) {
    json r = {{"rope_type", "yarn"},
              {"rope_theta", rope_theta},
              {"factor", yarn->factor},
              {"beta_fast", yarn->beta_fast},
              {"beta_slow", yarn->beta_slow},
              {"original_max_position_embeddings", yarn->original_max_position_embeddings},
              {"truncate", yarn->truncate}};
    if (yarn->attention_factor) r["attention_factor"] = *yarn->attention_factor;
    j["rope_parameters"] = r;
  }
  if (family().write_config) family().write_config(*this, j);
  return j;
}

const ModelFamily& ModelConfig::family() const {
  if (const ModelFamily* f = find_model_family(model_type)) return *f;
  throw invalid_argument("model config: unsupported model_type '" + model_type + "' (supported: " +
                         supported_model_types() + ")");
}

void ModelConfig::validate() const {
  auto positive = [](const char* name, std::int64_t v) {
    if (v <= 0)
      throw invalid_argument(std::string("model config: ") + name + " must be positive, got " + std::to_string(v));
  };
  positive("vocab_size", vocab_size);
  positive("hidden_size", hidden_size);
  positive("intermediate_size", intermediate_size);
  positive("num_hidden_layers", num_hidden_layers);
  positive("num_attention_heads", num_attention_heads);
  positive("num_key_value_heads", num_key_value_heads);
  positive("head_dim", head_dim);
  positive("max_position_embeddings", max_position_embeddings);
  if (num_attention_heads % num_key_value_heads != 0)
    throw invalid_argument("model config: num_attention_heads (" + std::to_string(num_attention_heads) +
                           ") must be a multiple of num_key_value_heads (" + std::to_string(num_key_value_heads) + ")");
  if (head_dim % 2 != 0)
    throw invalid_argument("model config: head_dim must be even for rotary embeddings, got " +
                           std::to_string(head_dim));
  if (!(rms_norm_eps > 0)) throw invalid_argument("model config: rms_norm_eps must be positive");
  if (!(rope_theta > 0)) throw invalid_argument("model config: rope_theta must be positive");
  if (qk_norm && !family().qk_norm)
    throw invalid_argument("model config: qk_norm is not part of model_type " + model_type);
  for (auto [name, v] : {std::pair{"query_pre_attn_scalar", query_pre_attn_scalar},
                         std::pair{"attn_logit_softcapping", attn_logit_softcapping},
                         std::pair{"final_logit_softcapping", final_logit_softcapping}})
    if (!(v >= 0) || std::isinf(v))
      throw invalid_argument(std::string("model config: ") + name + " must be a positive number or absent, got " +
                             std::to_string(v));
  if (sandwich_norms && num_experts > 0)
    throw unsupported("model config: sandwich norms around routed experts are not supported");
  if (num_experts > 0 && !family().experts)
    throw invalid_argument("model config: model_type " + model_type + " has no experts (num_experts " +
                           std::to_string(num_experts) + ")");
  if (family().experts) {
    positive("num_experts", num_experts);
    positive("moe_intermediate_size", moe_intermediate_size);
    positive("decoder_sparse_step", decoder_sparse_step);
    if (num_experts_per_tok < 1 || num_experts_per_tok > num_experts)
      throw invalid_argument("model config: num_experts_per_tok must be in [1, num_experts = " +
                             std::to_string(num_experts) + "], got " + std::to_string(num_experts_per_tok));
    for (std::int64_t layer : mlp_only_layers)
      if (layer < 0 || layer >= num_hidden_layers)
        throw invalid_argument("model config: mlp_only_layers names layer " + std::to_string(layer) + " of " +
                               std::to_string(num_hidden_layers));
  }
  if (!layer_types.empty()) {
    if (static_cast<std::int64_t>(layer_types.size()) != num_hidden_layers)
      throw invalid_argument("model config: layer_types lists " + std::to_string(layer_types.size()) +
                             " layers, the model has " + std::to_string(num_hidden_layers));
    for (const auto& t : layer_types) {
      if (t != "sliding_attention" && t != "full_attention")
        throw unsupported("model config: layer type '" + t + "' is not supported (sliding_attention, full_attention)");
      if (t == "sliding_attention" && sliding_window <= 0)
        throw invalid_argument("model config: a sliding_attention layer needs a positive sliding_window");
    }
  }
  for (auto [name, id] : {std::pair{"bos_token_id", bos_token_id}, std::pair{"eos_token_id", eos_token_id}})
    if (id && (*id < 0 || *id >= vocab_size))
      throw invalid_argument(std::string("model config: ") + name + " " + std::to_string(*id) +
                             " is outside the vocabulary [0, " + std::to_string(vocab_size) + ")");
}

std::int64_t ModelConfig::attention_window(std::int64_t layer) const {
  const auto i = static_cast<std::size_t>(layer);
  return i < layer_types.size() && layer_types[i] == "sliding_attention" ? sliding_window : 0;
}

double ModelConfig::attention_scale() const {
  return 1.0 / std::sqrt(query_pre_attn_scalar > 0 ? query_pre_attn_scalar : static_cast<double>(head_dim));
}

double ModelConfig::embedding_multiplier() const {
  return scale_embeddings ? std::sqrt(static_cast<double>(hidden_size)) : 1.0;
}

bool ModelConfig::sparse_layer(std::int64_t layer) const {
  if (num_experts <= 0) return false;
  for (std::int64_t dense : mlp_only_layers)
    if (dense == layer) return false;
  return (layer + 1) % decoder_sparse_step == 0;
}

ExpertShape ModelConfig::expert_shape() const {
  ExpertShape e;
  if (num_experts <= 0) return e;
  e.num_experts = num_experts;
  e.experts_per_token = num_experts_per_tok;
  for (std::int64_t i = 0; i < num_hidden_layers; ++i) e.sparse_layers += sparse_layer(i) ? 1 : 0;
  return e;
}

namespace {
// The parameters of `c` when each sparse layer holds `experts` of its experts (all of them, or those a token uses).
std::int64_t parameters_with(const ModelConfig& c, std::int64_t experts) {
  const std::int64_t H = c.hidden_size, q_dim = c.num_attention_heads * c.head_dim;
  const std::int64_t kv_dim = c.num_key_value_heads * c.head_dim;
  std::int64_t attention = H * q_dim + 2 * H * kv_dim + q_dim * H  // q, k, v, o
                           + (c.sandwich_norms ? 4 : 2) * H;       // the norms
  if (c.attention_bias) attention += q_dim + 2 * kv_dim + (c.family().o_proj_bias ? H : 0);
  if (c.qk_norm) attention += 2 * c.head_dim;
  const ModelFamily& family = c.family();
  if (family.attention_sinks) attention += c.num_attention_heads;
  const std::int64_t I = c.moe_intermediate_size;
  std::int64_t expert = 3 * H * I, router = c.num_experts * H;  // an expert's gate, up and down; the router
  if (family.expert_style.biases) expert += 2 * I + H;
  if (family.expert_style.router_bias) router += c.num_experts;
  std::int64_t total = c.vocab_size * H + H;
  if (!c.tie_word_embeddings) total += c.vocab_size * H;
  for (std::int64_t i = 0; i < c.num_hidden_layers; ++i) {
    total += attention;
    if (c.sparse_layer(i))
      total += router + experts * expert;
    else
      total += 3 * H * c.intermediate_size;  // gate, up, down
  }
  return total;
}
}  // namespace

std::int64_t ModelConfig::num_parameters() const { return parameters_with(*this, num_experts); }

std::int64_t ModelConfig::active_parameters() const { return parameters_with(*this, num_experts_per_tok); }

}  // namespace rlloop::engine
