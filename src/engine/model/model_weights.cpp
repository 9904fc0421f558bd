#include "model/model_weights.hpp"

#include <set>
#include <sstream>

#include <rlloop/error.hpp>

namespace rlloop::engine {

std::string shape_string(at::IntArrayRef s) {
  std::ostringstream os;
  os << "[";
  for (std::size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << "]";
  return os.str();
}

std::string module_name(const std::string& hf_name) {
  std::string s = hf_name;
  for (auto& ch : s)
    if (ch == '.') ch = '_';
  return s;
}

namespace {
bool fp32_cpu(const torch::Tensor& t) {
  return !t.defined() || (t.device().is_cpu() && t.scalar_type() == torch::kFloat32);
}
}  // namespace

bool Layer::cpu_kernels_apply(std::int64_t window) const {
  if (sparse() || sinks.defined() || window > 0) return false;
  for (const torch::Tensor* t : {&input_norm, &post_norm, &q_norm, &k_norm})
    if (!fp32_cpu(*t)) return false;
  for (const Linear* lin : {&q, &k, &v, &o, &gate, &up, &down})
    for (const torch::Tensor* t : {&lin->weight, &lin->bias, &lin->lora_a, &lin->lora_b})
      if (!fp32_cpu(*t)) return false;
  return true;
}

bool Layer::trains() const {
  for (const torch::Tensor* t : {&input_norm, &post_norm, &q_norm, &k_norm, &attn_out_norm, &mlp_out_norm, &sinks})
    if (t->defined() && t->requires_grad()) return true;
  for (const Linear* lin : linears())
    for (const torch::Tensor* t : {&lin->weight, &lin->bias, &lin->lora_a, &lin->lora_b})
      if (t->defined() && t->requires_grad()) return true;
  for (const torch::Tensor* t : {&expert_lora.gate_up_a, &expert_lora.gate_up_b, &expert_lora.down_a,
                                 &expert_lora.down_b})
    if (t->defined() && t->requires_grad()) return true;
  return false;
}

void ModelWeights::build(const ModelConfig& config, torch::TensorOptions opts, const QuantizedTensors& quantized,
                         std::int64_t first_expert, std::int64_t expert_count,
                         const RegisterParameter& register_param) {
  cfg = config;
  options = opts;
  family = &cfg.family();
  const WeightNames& names = family->names;
  const std::int64_t H = cfg.hidden_size;
  // A norm starts as the identity: weights of one, or of zero where the norm scales by (1 + w).
  auto param = [&](const std::string& name, std::vector<std::int64_t> shape, bool norm) {
    const bool ones = norm && !cfg.norm_adds_one;
    return register_param(module_name(name), ones ? torch::ones(shape, options) : torch::zeros(shape, options));
  };
  std::set<std::string> quantized_used;
  // The matrix `name` from `quantized` (checked against its shape), or null when it is not there.
  auto quantized_matrix = [&](const std::string& name, std::int64_t rows, std::int64_t cols) {
    auto it = quantized.find(name);
    if (it == quantized.end()) return std::shared_ptr<const QuantizedMatrix>();
    if (it->second->rows() != rows || it->second->cols() != cols)
      throw invalid_argument("Transformer: tensor '" + name + "' has shape [" + std::to_string(it->second->rows()) +
                             ", " + std::to_string(it->second->cols()) + "], the model expects [" +
                             std::to_string(rows) + ", " + std::to_string(cols) + "]");
    quantized_used.insert(name);
    return it->second;
  };
  auto linear = [&](const std::string& name, const std::string& short_name, std::int64_t out, std::int64_t in,
                    bool bias) {
    Linear l;
    l.name = name;
    l.short_name = short_name;
    l.quantized = quantized_matrix(name + ".weight", out, in);
    if (!l.quantized) l.weight = param(name + ".weight", {out, in}, false);
    if (bias) l.bias = param(name + ".bias", {out}, false);
    return l;
  };

  const std::string embed_name = names.embed + ".weight";
  embed_quantized = quantized_matrix(embed_name, cfg.vocab_size, H);
  if (!embed_quantized) embed = param(embed_name, {cfg.vocab_size, H}, false);
  for (std::int64_t i = 0; i < cfg.num_hidden_layers; ++i)
    layers.push_back(build_layer(i, first_expert, expert_count, linear, param));
  final_norm = param(names.final_norm + ".weight", {H}, true);
  lm_head.name = names.lm_head;
  lm_head.short_name = "lm_head";  // LoRA's name for the unembedding, whatever the family calls it
  if (cfg.tie_word_embeddings) {
    lm_head.weight = embed;
    lm_head.quantized = embed_quantized;
  } else {
    const std::string lm_head_name = names.lm_head + ".weight";
    lm_head.quantized = quantized_matrix(lm_head_name, cfg.vocab_size, H);
    if (!lm_head.quantized) lm_head.weight = param(lm_head_name, {cfg.vocab_size, H}, false);
  }
  for (const auto& [name, matrix] : quantized)
    if (!quantized_used.count(name))
      throw invalid_argument("Transformer: no matrix of this " + cfg.model_type + " model is named '" + name + "'");
}

Layer ModelWeights::build_layer(
    std::int64_t i, std::int64_t first_expert, std::int64_t expert_count,
    const std::function<Linear(const std::string&, const std::string&, std::int64_t, std::int64_t, bool)>& linear,
    const std::function<torch::Tensor(const std::string&, std::vector<std::int64_t>, bool)>& param) const {
  const WeightNames& names = family->names;
  const std::int64_t H = cfg.hidden_size, I = cfg.intermediate_size, D = cfg.head_dim;
  const std::int64_t q_dim = cfg.num_attention_heads * D, kv_dim = cfg.num_key_value_heads * D;
  Layer l;
  l.input_norm = param(family->layer_tensor(i, names.input_norm) + ".weight", {H}, true);
  // Each projection's [out, in] and bias, in kProjections' order (q, k, v, o, gate, up, down).
  const std::int64_t outs[] = {q_dim, kv_dim, kv_dim, H, I, I, H};
  const std::int64_t ins[] = {H, H, H, q_dim, H, H, I};
  const bool biases[] = {cfg.attention_bias, cfg.attention_bias, cfg.attention_bias, cfg.o_proj_bias(),
                         false, false, false};
  const bool sparse = cfg.sparse_layer(i);
  for (Projection proj : kProjections) {
    const auto j = static_cast<std::size_t>(proj);
    const bool mlp = j >= static_cast<std::size_t>(Projection::gate);
    if (sparse && mlp) break;  // the experts replace the dense MLP
    // In a model with experts PEFT takes the MLP's names for the experts' (ExpertAdapters): the dense MLP of its
    // mlp_only_layers is no LoRA target (an empty short name).
    const std::string target = cfg.num_experts > 0 && mlp ? "" : family->target_module(proj);
    l.projection(proj) = linear(family->projection_module(i, proj), target, outs[j], ins[j], biases[j]);
  }
  if (sparse) {
    // The experts' linears take no adapter of their own (an empty short name): their adapters are the layer's
    // stacked ones (expert_lora).
    const ExpertStyle& style = family->expert_style;
    l.router = linear(family->layer_tensor(i, names.router), family->router_target_module(), cfg.num_experts, H,
                      style.router_bias);
    const std::int64_t E_I = cfg.moe_intermediate_size;
    for (std::int64_t e = first_expert; e < first_expert + expert_count; ++e) {
      Expert x;
      x.gate = linear(family->expert_module(i, e, Projection::gate), "", E_I, H, style.biases);
      x.up = linear(family->expert_module(i, e, Projection::up), "", E_I, H, style.biases);
      x.down = linear(family->expert_module(i, e, Projection::down), "", H, E_I, style.biases);
      l.experts.push_back(std::move(x));
    }
  }
  if (cfg.qk_norm) {
    l.q_norm = param(family->layer_tensor(i, names.q_norm) + ".weight", {D}, true);
    l.k_norm = param(family->layer_tensor(i, names.k_norm) + ".weight", {D}, true);
  }
  if (family->attention_sinks) l.sinks = param(family->layer_tensor(i, names.sinks), {cfg.num_attention_heads}, false);
  l.post_norm = param(family->layer_tensor(i, names.post_norm) + ".weight", {H}, true);
  if (cfg.sandwich_norms) {
    l.attn_out_norm = param(family->layer_tensor(i, names.attn_out_norm) + ".weight", {H}, true);
    l.mlp_out_norm = param(family->layer_tensor(i, names.mlp_out_norm) + ".weight", {H}, true);
  }
  return l;
}

bool ModelWeights::same_base(const ModelWeights& b) const {
  const ModelWeights& a = *this;
  if (&a == &b) return true;
  auto same = [](const torch::Tensor& x, const torch::Tensor& y) {
    return x.defined() == y.defined() && (!x.defined() || x.is_same(y));
  };
  auto same_linear = [&](const Linear& x, const Linear& y) {
    return x.quantized == y.quantized && same(x.weight, y.weight) && same(x.bias, y.bias);
  };
  if (a.layers.size() != b.layers.size() || !same(a.embed, b.embed) || a.embed_quantized != b.embed_quantized ||
      !same(a.final_norm, b.final_norm) || !same_linear(a.lm_head, b.lm_head))
    return false;
  for (std::size_t i = 0; i < a.layers.size(); ++i) {
    const Layer& x = a.layers[i];
    const Layer& y = b.layers[i];
    if (!same(x.input_norm, y.input_norm) || !same(x.post_norm, y.post_norm) || !same(x.q_norm, y.q_norm) ||
        !same(x.k_norm, y.k_norm) || !same(x.sinks, y.sinks) || !same(x.attn_out_norm, y.attn_out_norm) ||
        !same(x.mlp_out_norm, y.mlp_out_norm))
      return false;
    const auto xs = x.linears(), ys = y.linears();
    if (xs.size() != ys.size()) return false;
    for (std::size_t j = 0; j < xs.size(); ++j)
      if (!same_linear(*xs[j], *ys[j])) return false;
  }
  return true;
}

bool ModelWeights::cpu_kernels_decode() const {
  for (std::size_t i = 0; i < layers.size(); ++i)
    if (!layers[i].cpu_kernels_apply(cfg.attention_window(static_cast<std::int64_t>(i)))) return false;
  // (Gemma's parts are the ATen backend's only: CpuOps implements none of them.)
  if (cfg.sandwich_norms || cfg.norm_adds_one || cfg.scale_embeddings || cfg.attn_logit_softcapping > 0 ||
      cfg.final_logit_softcapping > 0 || cfg.hidden_activation != ModelConfig::Activation::silu)
    return false;
  const Linear& head = lm_head;
  return fp32_cpu(embed) && fp32_cpu(final_norm) && fp32_cpu(head.weight) && fp32_cpu(head.bias) &&
         fp32_cpu(head.lora_a) && fp32_cpu(head.lora_b);
}

}  // namespace rlloop::engine
