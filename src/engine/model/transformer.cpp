// The Llama / Qwen2 / Qwen3 decoder with optional LoRA. The math follows Hugging Face transformers'
// eager implementation step by step (fp32 RMSNorm, rotate_half RoPE, softmax in fp32) so HF weights give
// the same logits.
#include "model/transformer.hpp"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <limits>
#include <mutex>
#include <set>
#include <sstream>
#include <stdexcept>
#include <type_traits>
#include <utility>

#include <rlloop/error.hpp>

#include "kernels/attention.hpp"
#include "kernels/decode_attention.hpp"
#include "model/decoder_layer.hpp"
#include "kernels/device.hpp"
#include "model/expert_parallel.hpp"
#include "model/experts.hpp"
#include "kernels/fused_ops.hpp"
#include "model/linear.hpp"

namespace rlloop::engine {
namespace {

std::string shape_string(at::IntArrayRef s) {
  std::ostringstream os;
  os << "[";
  for (std::size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << "]";
  return os.str();
}

// Module parameter names may not contain '.', HF names are dotted.
std::string module_name(const std::string& hf_name) {
  std::string s = hf_name;
  for (auto& ch : s)
    if (ch == '.') ch = '_';
  return s;
}

struct Layer {
  torch::Tensor input_norm, post_norm, q_norm, k_norm;
  torch::Tensor sinks;  // [heads]: families with attention sinks
  Linear q, k, v, o, gate, up, down;  // a sparse layer has no gate, up and down (not present())
  Linear router;                      // a sparse layer's: [experts, H]
  std::vector<Expert> experts;        // a sparse layer's
  ExpertAdapters expert_lora;         // a sparse layer's adapters on its experts (LoRA)
  bool sparse() const { return !experts.empty(); }
  // Whether the CPU's decoding kernels (cpu_decoder.hpp) implement this layer as it is: decoder_layer's dense form
  // with plain causal attention (`window` 0: none), every tensor fp32 on the CPU (quantized matrices are read from
  // their blocks).
  bool cpu_kernels_apply(std::int64_t window) const {
    if (sparse() || sinks.defined() || window > 0) return false;
    auto fp32_cpu = [](const torch::Tensor& t) {
      return !t.defined() || (t.device().is_cpu() && t.scalar_type() == torch::kFloat32);
    };
    for (const torch::Tensor* t : {&input_norm, &post_norm, &q_norm, &k_norm})
      if (!fp32_cpu(*t)) return false;
    for (const Linear* lin : {&q, &k, &v, &o, &gate, &up, &down})
      for (const torch::Tensor* t : {&lin->weight, &lin->bias, &lin->lora_a, &lin->lora_b})
        if (!fp32_cpu(*t)) return false;
    return true;
  }

  // Every linear the layer has, in a fixed order: the projections present (kProjections' order), then the router
  // and each expert's gate, up and down.
  template <class Self, class L = std::conditional_t<std::is_const_v<Self>, const Linear, Linear>>
  static std::vector<L*> linears_of(Self& self) {
    std::vector<L*> out;
    for (L* lin : {&self.q, &self.k, &self.v, &self.o, &self.gate, &self.up, &self.down})
      if (lin->present()) out.push_back(lin);
    if (self.router.present()) out.push_back(&self.router);
    for (auto& e : self.experts)
      for (L* lin : {&e.gate, &e.up, &e.down}) out.push_back(lin);
    return out;
  }
  std::vector<Linear*> linears() { return linears_of(*this); }
  std::vector<const Linear*> linears() const { return linears_of(*this); }
  Linear& projection(Projection p) { return projection_member(*this, p); }
  const Linear& projection(Projection p) const { return projection_member(*this, p); }
};

// Rows [row0, row0 + rows) of a decoding step of several batches (Transformer::decode_step): one batch of
// sequences, with its own model's adapters (`layers`, `lm_head`: the base weights are every group's); its cache's
// slots and blocks are in the step's layout (LayerInputs::step).
struct RowGroup {
  const std::vector<Layer>* layers;
  const Linear* lm_head;
  std::int64_t row0, rows;
  bool chunk = false;  // rows are consecutive positions of one sequence (a prompt's chunk), not one per sequence
};

// What every layer of one forward shares: the RoPE rows of its positions, the attention scale, the cache (and how
// many positions it held before this forward).
struct LayerInputs {
  torch::Tensor cos, sin;
  double scale;
  KVCache* cache;
  std::int64_t past;
  // With a cache: the pool slots this forward's keys and values go to ([B * T], row-major, on the model's device)
  // and, when the cache held positions before (past > 0), every row's block table [B, blocks] to read them back.
  torch::Tensor slots, tables;
  // A decoding step of several batches: x is [1, rows of every group, H], one new token per row (a new token of a
  // sequence, or a position of a prompt's chunk; the rows sit where one sequence's positions would: RoPE's cos / sin
  // rows are the rows' own positions), and each group's rows attend over its own cache. Empty otherwise.
  std::span<const RowGroup> groups = {};
  // With groups: the step's layout over the caches' one pool (on the host), and its block tables [R, blocks] and key
  // counts [R] on the model's device (slots above are the rows' new positions).
  const DecodeSlots* step = nullptr;
  KVBlockPool* pool = nullptr;
  torch::Tensor lengths;
  // With two or more groups of one token per sequence, for their adapters' batched products (add_stacked_adapters;
  // a prompt's chunk, many rows of one sequence, would pad every other group to its length, and runs its own):
  // stacked group g's rows padded to the largest one's count, rows_max (padded_rows[g * rows_max + i] = the step row
  // of its row i, its last row where it has fewer), where each of their rows lands among them (unpadded_rows), each
  // one's LoRA scale (lora_scales [G], float64), and, in a step with chunks, the step rows they cover
  // (stacked_rows; undefined: every row); all on the model's device. padded_rows undefined: nothing stacked.
  torch::Tensor padded_rows, unpadded_rows, lora_scales, stacked_rows;
  // In a step with prompt chunks, for the attention of its one-token groups in one call: their rows (on the model's
  // device; undefined without chunks) and their longest key count.
  torch::Tensor single_rows;
  std::int64_t single_longest = 0;
  std::int64_t rows_max = 0;
  // Routing replay and recording (hidden_states' `routing`), or null.
  ExpertRouting* routing = nullptr;
};

// Stores keys or values [N, kv_heads, D] at `slots` [N] of a pool's storage, in the storage's dtype.
void store_slots(const torch::Tensor& storage, const torch::Tensor& slots, const torch::Tensor& rows) {
  torch::NoGradGuard no_grad;  // a cache is state, not part of a graph (the pool's tensors never require grad)
  storage.index_copy_(0, slots, rows.detach().to(storage.scalar_type()));
}

// The first `S` positions of rows whose block tables are `tables` [B, blocks], from a pool's storage [slots, kv_heads,
// D]: [B, kv_heads, S, D] in `dtype` (the layout causal_attention reads; the last dimension contiguous).
torch::Tensor gather_positions(const torch::Tensor& storage, const torch::Tensor& tables, std::int64_t S,
                               torch::ScalarType dtype) {
  const std::int64_t B = tables.size(0), blocks = tables.size(1), nkv = storage.size(1), D = storage.size(2);
  torch::Tensor rows = storage.view({-1, kKVBlockTokens, nkv, D})
                           .index_select(0, tables.reshape({B * blocks}))
                           .view({B, blocks * kKVBlockTokens, nkv, D})
                           .narrow(1, 0, S)
                           .transpose(1, 2);
  return rows.scalar_type() == dtype ? rows : rows.to(dtype);
}

// With two or more groups that all adapt this linear at one rank and dtype, their low-rank products run as two
// batched products over the groups' rows (padded to the largest group's count) instead of two products per group,
// so the operators of a step do not grow with its groups (Punica's SGMV, in ATen operators). Adds them to y [1, R,
// out] and returns true; false (nothing done) where it does not apply.
template <class Of>
bool add_stacked_adapters(torch::Tensor& y, const torch::Tensor& h, const LayerInputs& in, Of&& of) {
  if (!in.padded_rows.defined()) return false;
  std::vector<torch::Tensor> a, b;
  for (const RowGroup& g : in.groups) {
    if (g.chunk) continue;  // not stacked (LayerInputs::padded_rows)
    const Linear& adapted = of(g);
    const torch::Tensor& first = a.empty() ? adapted.lora_a : a.front();
    if (!adapted.lora_a.defined() || adapted.lora_a.size(0) != first.size(0) ||
        adapted.lora_a.scalar_type() != first.scalar_type())
      return false;
    a.push_back(adapted.lora_a);
    b.push_back(adapted.lora_b);
  }
  const auto G = static_cast<std::int64_t>(a.size());
  const torch::Tensor x =
      h[0].to(a.front().scalar_type()).index_select(0, in.padded_rows).view({G, in.rows_max, h.size(2)});
  torch::Tensor d = torch::bmm(torch::bmm(x, torch::stack(a).transpose(1, 2)), torch::stack(b).transpose(1, 2));
  d = d * in.lora_scales.to(d.scalar_type()).view({G, 1, 1});  // [G, rows_max, out]
  const torch::Tensor rows = d.view({G * in.rows_max, d.size(2)}).index_select(0, in.unpadded_rows);
  if (in.stacked_rows.defined())
    y[0].index_add_(0, in.stacked_rows, rows.to(y.scalar_type()));
  else
    y[0].add_(rows.to(y.scalar_type()));
  return true;
}

// The linear `of` picks out of a layer (a projection) or of the model (lm_head) applied to h: with row groups,
// the base product once over every row and each group's adapter over its own rows; otherwise the model's own.
template <class Of>
torch::Tensor project(const Linear& own, const torch::Tensor& h, const LayerInputs& in, Of&& of) {
  if (in.groups.empty()) return own.apply(h);
  torch::Tensor y = own.apply_base(h, /*few_rows=*/true);
  const bool stacked = add_stacked_adapters(y, h, in, of);
  for (const RowGroup& g : in.groups) {
    if (stacked && !g.chunk) continue;
    const Linear& adapted = of(g);
    if (!adapted.lora_a.defined()) continue;
    torch::Tensor rows = y.narrow(1, g.row0, g.rows);
    rows.add_(adapted.adapter_delta(h.narrow(1, g.row0, g.rows), y.scalar_type()), adapted.lora_scale);
  }
  return y;
}

}  // namespace

struct Transformer::Impl {
  ModelConfig cfg;
  const ModelFamily* family = nullptr;  // cfg's: the tensor names and the LoRA target modules
  torch::TensorOptions options;
  torch::Tensor embed;  // undefined when embed_quantized holds it
  std::shared_ptr<const QuantizedMatrix> embed_quantized;
  torch::Tensor final_norm;
  std::vector<Layer> layers;
  Linear lm_head;  // weight aliases embed when tied
  std::optional<LoraOptions> lora;
  Linear value_head;  // undefined weight without a value head
  bool checkpoint_layers = false;  // set_activation_checkpointing
  std::shared_ptr<KVPools> kv_pools;  // the base's: every model sharing it draws its caches' blocks from them

  torch::Device device() const { return options.device(); }
  torch::ScalarType dtype() const { return c10::typeMetaToScalarType(options.dtype()); }

  // Layer `li` over x [B, T, H]: attention (extending in.cache when given), then the MLP, each with its residual.
  torch::Tensor layer_forward(std::size_t li, torch::Tensor x, const LayerInputs& in) const;
  // The experts of sparse layer `li` over h [B, T, H] (rows [B * T, H] out): routed by the router, each row through
  // its experts. In a step of several groups whose adapters reach the router or the experts, each model's rows
  // run through its own (its own routes too); otherwise every row through the base's at once.
  torch::Tensor sparse_mlp(std::size_t li, const torch::Tensor& h, const LayerInputs& in) const;
  // Layer li's causal attention: with its sinks and window where the family has them (windowed_attention).
  torch::Tensor attend(std::size_t li, const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                       double scale) const {
    const std::int64_t window = cfg.attention_window(static_cast<std::int64_t>(li));
    const torch::Tensor& sinks = layers[li].sinks;
    if (sinks.defined() || window > 0) return windowed_attention(q, keys, values, scale, sinks, window);
    return causal_attention(q, keys, values, scale);
  }
  // The attention of a step of several groups (LayerInputs::groups): each group's rows extend and read its cache.
  torch::Tensor attend_groups(std::size_t li, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              const LayerInputs& in) const;
  std::int64_t sparse_layers() const {
    std::int64_t n = 0;
    for (const Layer& l : layers) n += l.sparse() ? 1 : 0;
    return n;
  }
  // hidden_states' routing for `tokens` tokens: a model with experts, a mask of [tokens] and a replay of
  // [tokens, sparse layers, k] int64 expert ids in [0, num_experts) when given.
  void check_routing(const ExpertRouting& routing, std::int64_t tokens) const {
    const std::string what = "Transformer::hidden_states: routing replay: ";
    if (cfg.num_experts == 0) throw invalid_argument(what + "this " + cfg.model_type + " model has no experts");
    const torch::Tensor& m = routing.mask;
    if (m.defined() && (m.dim() != 1 || m.size(0) != tokens))
      throw invalid_argument(what + "the token mask must be [" + std::to_string(tokens) + "], got " +
                             shape_string(m.sizes()));
    const torch::Tensor& r = routing.replay;
    if (!r.defined()) return;
    const std::vector<std::int64_t> want = {tokens, sparse_layers(), cfg.num_experts_per_tok};
    if (r.scalar_type() != torch::kLong || r.sizes() != want)
      throw invalid_argument(what + "the routes must be an int64 [tokens, sparse layers, experts per token] = " +
                             shape_string(want) + " tensor, got " + std::string(c10::toString(r.scalar_type())) +
                             " " + shape_string(r.sizes()));
    // Checked where the routes lie on the host (before they are uploaded): on a device, reading them back would make
    // the host wait at every forward; routes there come from a forward's own recording or from a session, which
    // checked them on the host (loss inputs, rlloop/loss.hpp).
    if (!r.device().is_cpu()) return;
    const torch::Tensor ids = r.contiguous();
    const std::int64_t* id = ids.data_ptr<std::int64_t>();
    const std::int64_t k = cfg.num_experts_per_tok;
    for (std::int64_t i = 0; i < ids.numel(); ++i) {
      if (id[i] < 0 || id[i] >= cfg.num_experts)
        throw invalid_argument(what + "expert id " + std::to_string(id[i]) + " is outside [0, " +
                               std::to_string(cfg.num_experts) + ")");
      // run_experts lays out one row per token per expert at most.
      for (std::int64_t j = i - i % k; j < i; ++j)
        if (id[j] == id[i])
          throw invalid_argument(what + "expert " + std::to_string(id[i]) + " is given twice at token " +
                                 std::to_string(i / (k * sparse_layers())) + ", sparse layer " +
                                 std::to_string(i / k % sparse_layers()));
    }
  }
  // Whether any weight, norm or adapter of layer `li` requires grad.
  bool layer_trains(std::size_t li) const {
    const Layer& l = layers[li];
    for (const torch::Tensor* t : {&l.input_norm, &l.post_norm, &l.q_norm, &l.k_norm, &l.sinks})
      if (t->defined() && t->requires_grad()) return true;
    for (const Linear* lin : l.linears())
      for (const torch::Tensor* t : {&lin->weight, &lin->bias, &lin->lora_a, &lin->lora_b})
        if (t->defined() && t->requires_grad()) return true;
    const ExpertAdapters& e = l.expert_lora;
    for (const torch::Tensor* t : {&e.gate_up_a, &e.gate_up_b, &e.down_a, &e.down_b})
      if (t->defined() && t->requires_grad()) return true;
    return false;
  }
  class CheckpointedLayer;
  class AtenOps;  // decoder_layer's operations over ATen tensors

  // Every dense base weight (parameter) under its HF name, in a fixed order (init_model draws from one generator
  // in this order); quantized matrices are for_each_quantized's.
  template <class F>
  void for_each_base(F&& f) const {
    const WeightNames& n = family->names;
    if (embed.defined()) f(n.embed + ".weight", embed);
    for (std::size_t i = 0; i < layers.size(); ++i) {
      const Layer& l = layers[i];
      const auto li = static_cast<std::int64_t>(i);
      f(family->layer_tensor(li, n.input_norm) + ".weight", l.input_norm);
      for (const Linear* lin : l.linears()) {
        if (lin->weight.defined()) f(lin->name + ".weight", lin->weight);
        if (lin->bias.defined()) f(lin->name + ".bias", lin->bias);
      }
      if (cfg.qk_norm) {
        f(family->layer_tensor(li, n.q_norm) + ".weight", l.q_norm);
        f(family->layer_tensor(li, n.k_norm) + ".weight", l.k_norm);
      }
      if (l.sinks.defined()) f(family->layer_tensor(li, n.sinks), l.sinks);
      f(family->layer_tensor(li, n.post_norm) + ".weight", l.post_norm);
    }
    f(n.final_norm + ".weight", final_norm);
    if (!cfg.tie_word_embeddings && lm_head.weight.defined()) f(n.lm_head + ".weight", lm_head.weight);
  }
  // The quantized matrices under their HF names.
  template <class F>
  void for_each_quantized(F&& f) const {
    if (embed_quantized) f(family->names.embed + ".weight", *embed_quantized);
    for (const auto& l : layers)
      for (const Linear* lin : l.linears())
        if (lin->quantized) f(lin->name + ".weight", *lin->quantized);
    if (!cfg.tie_word_embeddings && lm_head.quantized) f(family->names.lm_head + ".weight", *lm_head.quantized);
  }

  template <class F>
  void for_each_linear(F&& f) {
    for (auto& l : layers)
      for (Linear* lin : l.linears()) f(*lin);
    f(lm_head);
  }
  template <class F>
  void for_each_linear(F&& f) const {
    for (const auto& l : layers)
      for (const Linear* lin : l.linears()) f(*lin);
    f(lm_head);
  }

  static std::string peft_prefix(const Linear& lin) { return "base_model.model." + lin.name; }

  // Every adapter tensor under its PEFT name, with whether it is an A: the linears' adapters, then each sparse
  // layer's stacked expert adapters, named as PEFT names its ParamWrappers on the experts: gate_up_proj's wrapper
  // inside down_proj's, so gate_up's tensors are under "experts.base_layer" when both are there.
  template <class F>
  void for_each_adapter(F&& f) const {
    for_each_linear([&](const Linear& lin) {
      if (!lin.lora_a.defined()) return;
      f(peft_prefix(lin) + ".lora_A.weight", lin.lora_a, true);
      f(peft_prefix(lin) + ".lora_B.weight", lin.lora_b, false);
    });
    for (std::size_t i = 0; i < layers.size(); ++i) {
      const ExpertAdapters& e = layers[i].expert_lora;
      const std::string prefix =
          "base_model.model." + family->layer_tensor(static_cast<std::int64_t>(i), family->names.experts);
      if (e.gate_up_a.defined()) {
        const std::string inner = prefix + (e.down_a.defined() ? ".base_layer" : "");
        f(inner + ".lora_A.weight", e.gate_up_a, true);
        f(inner + ".lora_B.weight", e.gate_up_b, false);
      }
      if (e.down_a.defined()) {
        f(prefix + ".lora_A.weight", e.down_a, true);
        f(prefix + ".lora_B.weight", e.down_b, false);
      }
    }
  }

  // Expert parallelism (set_expert_parallel): the group and this rank's slice of the experts; no group: none.
  ExpertShard expert_shard;

  // RoPE cos/sin for every position, computed once (per device and dtype) instead of on every forward call;
  // rows are what HF computes for those positions: inv_freq and angles in fp32, then cast.
  std::mutex rope_mutex;
  std::pair<torch::Tensor, torch::Tensor> rope;

  std::pair<torch::Tensor, torch::Tensor> rope_tables(torch::Device device, torch::ScalarType dtype) {
    std::lock_guard lock(rope_mutex);
    if (rope.first.defined() && rope.first.device() == device && rope.first.scalar_type() == dtype) return rope;
    // Normal tensors even when first called by the sampler: inference tensors cannot be saved for backward.
    c10::InferenceMode not_inference(false);
    torch::NoGradGuard no_grad;
    const std::int64_t D = cfg.head_dim;
    auto i64 = torch::TensorOptions().device(device).dtype(torch::kLong);
    const torch::Tensor wavelengths = torch::pow(cfg.rope_theta, torch::arange(0, D, 2, i64).to(torch::kFloat32) / D);
    torch::Tensor inv_freq = torch::reciprocal(wavelengths);
    double scaling = 1.0;
    if (cfg.yarn) std::tie(inv_freq, scaling) = yarn_frequencies(wavelengths);
    torch::Tensor positions = torch::arange(0, cfg.max_position_embeddings, i64).to(torch::kFloat32);
    torch::Tensor angles = positions.unsqueeze(1) * inv_freq.unsqueeze(0);
    torch::Tensor emb = torch::cat({angles, angles}, -1);
    torch::Tensor cos = emb.cos(), sin = emb.sin();
    if (scaling != 1.0) {
      cos = cos * scaling;
      sin = sin * scaling;
    }
    rope = {cos.to(dtype), sin.to(dtype)};
    return rope;
  }

  // YaRN's frequencies from RoPE's (`wavelengths` [D / 2] fp32: theta^(2i / D)) and the factor cos and sin are
  // scaled by, step for step as transformers' _compute_yarn_parameters: the dimensions that turn fewer than
  // beta_slow times over the original context are interpolated (divided by `factor`), those that turn more than
  // beta_fast times kept, a linear ramp between.
  std::pair<torch::Tensor, double> yarn_frequencies(const torch::Tensor& wavelengths) const {
    const ModelConfig::Yarn& y = *cfg.yarn;
    const double D = static_cast<double>(cfg.head_dim), base = cfg.rope_theta;
    const double original = static_cast<double>(y.original_max_position_embeddings);
    auto correction_dim = [&](double rotations) {
      return D * std::log(original / (rotations * 2 * M_PI)) / (2 * std::log(base));
    };
    double low = correction_dim(y.beta_fast), high = correction_dim(y.beta_slow);
    if (y.truncate) {
      low = std::floor(low);
      high = std::ceil(high);
    }
    low = std::max(low, 0.0);
    high = std::min(high, D - 1);
    if (low == high) high += 0.001;  // transformers' guard against a zero-width ramp
    const torch::Tensor ramp =
        ((torch::arange(wavelengths.size(0), wavelengths.options()) - low) / (high - low)).clamp(0, 1);
    const torch::Tensor extrapolation = 1 - ramp;
    const torch::Tensor interpolated = torch::reciprocal(wavelengths * y.factor);
    const torch::Tensor frequencies =
        interpolated * (1 - extrapolation) + torch::reciprocal(wavelengths) * extrapolation;
    const double scaling = y.attention_factor ? *y.attention_factor
                                              : (y.factor <= 1 ? 1.0 : 0.1 * std::log(y.factor) + 1.0);
    return {frequencies, scaling};
  }
};

// ------------------------------------------------------------------------------------------ Transformer

Transformer::Transformer() : impl_(std::make_shared<Impl>()) {}

Transformer::Transformer(const ModelConfig& cfg) : Transformer(cfg, torch::TensorOptions().dtype(torch::kFloat32)) {}

Transformer::Transformer(const ModelConfig& cfg, torch::TensorOptions options)
    : Transformer(cfg, options, QuantizedTensors{}) {}

Transformer::Transformer(const ModelConfig& cfg, torch::TensorOptions options, const QuantizedTensors& quantized,
                         ExpertRange experts)
    : impl_(std::make_shared<Impl>()) {
  cfg.validate();
  if (experts.count == -1 && experts.first == 0) experts.count = cfg.num_experts;  // the default: all of them
  if (experts.first < 0 || experts.count < (cfg.num_experts > 0 ? 1 : 0) ||
      experts.first + experts.count > cfg.num_experts)
    throw invalid_argument("Transformer: experts [" + std::to_string(experts.first) + ", " +
                           std::to_string(experts.first + experts.count) + ") are not within the model's " +
                           std::to_string(cfg.num_experts));
  const bool cpu_fp32 = options.device().is_cpu() && c10::typeMetaToScalarType(options.dtype()) == torch::kFloat32;
  if (!quantized.empty() && !cpu_fp32)
    throw invalid_argument("Transformer: quantized weights need an fp32 model on the CPU");
  impl_->cfg = cfg;
  impl_->options = options;
  impl_->kv_pools = std::make_shared<KVPools>(cfg, options.device());
  const std::int64_t H = cfg.hidden_size, I = cfg.intermediate_size, D = cfg.head_dim;
  const std::int64_t q_dim = cfg.num_attention_heads * D, kv_dim = cfg.num_key_value_heads * D;

  auto param = [&](const std::string& name, std::vector<std::int64_t> shape, bool ones) {
    auto t = ones ? torch::ones(shape, options) : torch::zeros(shape, options);
    return register_parameter(module_name(name), t, /*requires_grad=*/true);
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
  const ModelFamily& family = cfg.family();
  const WeightNames& names = family.names;
  impl_->family = &family;
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
  impl_->embed_quantized = quantized_matrix(embed_name, cfg.vocab_size, H);
  if (!impl_->embed_quantized) impl_->embed = param(embed_name, {cfg.vocab_size, H}, false);
  for (std::int64_t i = 0; i < cfg.num_hidden_layers; ++i) {
    Layer l;
    l.input_norm = param(family.layer_tensor(i, names.input_norm) + ".weight", {H}, true);
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
      const std::string target = cfg.num_experts > 0 && mlp ? "" : family.target_module(proj);
      l.projection(proj) = linear(family.projection_module(i, proj), target, outs[j], ins[j], biases[j]);
    }
    if (sparse) {
      // The experts' linears take no adapter of their own (an empty short name): their adapters are the layer's
      // stacked ones (expert_lora).
      const ExpertStyle& style = family.expert_style;
      l.router = linear(family.layer_tensor(i, names.router), family.router_target_module(), cfg.num_experts, H,
                        style.router_bias);
      const std::int64_t E_I = cfg.moe_intermediate_size;
      for (std::int64_t e = experts.first; e < experts.first + experts.count; ++e) {
        Expert x;
        x.gate = linear(family.expert_module(i, e, Projection::gate), "", E_I, H, style.biases);
        x.up = linear(family.expert_module(i, e, Projection::up), "", E_I, H, style.biases);
        x.down = linear(family.expert_module(i, e, Projection::down), "", H, E_I, style.biases);
        l.experts.push_back(std::move(x));
      }
    }
    if (cfg.qk_norm) {
      l.q_norm = param(family.layer_tensor(i, names.q_norm) + ".weight", {D}, true);
      l.k_norm = param(family.layer_tensor(i, names.k_norm) + ".weight", {D}, true);
    }
    if (family.attention_sinks) l.sinks = param(family.layer_tensor(i, names.sinks), {cfg.num_attention_heads}, false);
    l.post_norm = param(family.layer_tensor(i, names.post_norm) + ".weight", {H}, true);
    impl_->layers.push_back(std::move(l));
  }
  impl_->final_norm = param(names.final_norm + ".weight", {H}, true);
  impl_->lm_head.name = names.lm_head;
  impl_->lm_head.short_name = "lm_head";  // LoRA's name for the unembedding, whatever the family calls it
  if (cfg.tie_word_embeddings) {
    impl_->lm_head.weight = impl_->embed;
    impl_->lm_head.quantized = impl_->embed_quantized;
  } else {
    const std::string lm_head_name = names.lm_head + ".weight";
    impl_->lm_head.quantized = quantized_matrix(lm_head_name, cfg.vocab_size, H);
    if (!impl_->lm_head.quantized) impl_->lm_head.weight = param(lm_head_name, {cfg.vocab_size, H}, false);
  }
  for (const auto& [name, matrix] : quantized)
    if (!quantized_used.count(name))
      throw invalid_argument("Transformer: no matrix of this " + cfg.model_type + " model is named '" + name + "'");
}

const ModelConfig& Transformer::config() const { return impl_->cfg; }

const std::shared_ptr<KVPools>& Transformer::kv_pools() const { return impl_->kv_pools; }

std::shared_ptr<Transformer> Transformer::sharing_base(Transformer& base) {
  const Impl& from = *base.impl_;
  if (from.lora || base.has_value_head())
    throw conflict("Transformer::sharing_base: the base model has adapters or a value head of its own");
  if (from.expert_shard.group)
    throw conflict("Transformer::sharing_base: the base model is expert-parallel (its sessions would not share it)");
  for (auto& p : base.parameters())
    if (p.requires_grad()) p.set_requires_grad(false);  // written once: later users only read the flag
  auto shared = std::shared_ptr<Transformer>(new Transformer());
  Impl& to = *shared->impl_;
  to.cfg = from.cfg;
  to.family = from.family;
  to.options = from.options;
  to.embed = from.embed;
  to.embed_quantized = from.embed_quantized;
  to.final_norm = from.final_norm;
  to.layers = from.layers;
  to.lm_head = from.lm_head;
  to.kv_pools = from.kv_pools;
  to.for_each_base([&](const std::string& name, const torch::Tensor& t) {
    shared->register_parameter(module_name(name), t, /*requires_grad=*/false);
  });
  return shared;
}

// A layer under activation checkpointing: forward keeps only the layer's input (and the RoPE rows), backward runs
// the layer again with its graph and differentiates it at once, as PyTorch's reentrant torch.utils.checkpoint does.
// A training step then holds one [B, T, H] tensor per layer plus one layer's activations, instead of every
// layer's (the MLP's [B, T, intermediate] products and the attention's inputs and outputs), for a second forward's
// compute. The layer's parameters are not inputs: the inner backward accumulates their gradients itself. `anchor`
// is a 0-element tensor that requires grad, so that the layer is part of the graph when its adapters train but its
// input does not (the first layer of a LoRA model); a layer with neither runs plainly. The model must outlive the
// graph, as for target_logprobs. A sparse layer's recompute replays the routes its forward took (hidden_states
// always records them under checkpointing), so that the gradients are those of the forward's routing even where
// the recompute's arithmetic could differ in the last bits.
class Transformer::Impl::CheckpointedLayer : public torch::autograd::Function<CheckpointedLayer> {
 public:
  static torch::Tensor run(const Impl& impl, std::size_t li, const torch::Tensor& x, const LayerInputs& in) {
    // Nothing to differentiate (a frozen layer whose input needs no gradient): the plain forward, no graph.
    if (!x.requires_grad() && !impl.layer_trains(li)) return impl.layer_forward(li, x, in);
    const torch::Tensor anchor = torch::empty({0}, x.options()).requires_grad_(!x.requires_grad());
    return apply(x, in.cos, in.sin, anchor, &impl, static_cast<std::int64_t>(li), in.scale, in.routing);
  }

  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor x, torch::Tensor cos,
                               torch::Tensor sin, torch::Tensor anchor, const Impl* impl, std::int64_t li,
                               double scale, ExpertRouting* routing) {
    (void)anchor;
    ctx->save_for_backward({x, cos, sin});
    // saved_data holds IValues: the model's address (see above), the layer and the scale; the forward's routes
    // (every layer's, filled in as the forward goes on: kept here by reference, not as a saved variable, whose
    // version autograd would check).
    ctx->saved_data["impl"] = static_cast<std::int64_t>(reinterpret_cast<std::intptr_t>(impl));
    ctx->saved_data["layer"] = li;
    ctx->saved_data["scale"] = scale;
    if (routing) ctx->saved_data["routes"] = routing->recorded;
    LayerInputs in{cos, sin, scale, nullptr, 0};
    in.routing = routing;
    return impl->layer_forward(static_cast<std::size_t>(li), x, in);
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto* impl = reinterpret_cast<const Impl*>(static_cast<std::intptr_t>(ctx->saved_data["impl"].toInt()));
    const auto li = static_cast<std::size_t>(ctx->saved_data["layer"].toInt());
    LayerInputs in{saved[1], saved[2], ctx->saved_data["scale"].toDouble(), nullptr, 0};
    ExpertRouting replay;
    if (ctx->saved_data.count("routes")) {
      replay.replay = ctx->saved_data["routes"].toTensor();
      replay.recorded = torch::empty_like(replay.replay);
      in.routing = &replay;
    }
    const bool x_needs_grad = ctx->needs_input_grad(0);
    torch::AutoGradMode enable(true);
    const torch::Tensor x = saved[0].detach().requires_grad_(x_needs_grad);
    const torch::Tensor out = impl->layer_forward(li, x, in);
    torch::Tensor grad_x;
    if (out.requires_grad()) {
      torch::autograd::backward({out}, {grads[0]});
      if (x_needs_grad) grad_x = x.grad();
    }
    return {grad_x,          torch::Tensor(), torch::Tensor(), torch::Tensor(),
            torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

// decoder_layer's operations over ATen tensors ([B, T, width]): every device and dtype, autograd, the caches of a
// prefill and the row groups of a decoding step (LayerInputs), sparse layers.
class Transformer::Impl::AtenOps {
 public:
  using Rows = torch::Tensor;
  AtenOps(const Impl& impl, std::size_t li, const LayerInputs& in)
      : impl_(impl), cfg_(impl.cfg), layer_(impl.layers[li]), li_(li), in_(in) {}

  bool qk_norm() const { return cfg_.qk_norm; }
  bool sparse() const { return layer_.sparse(); }
  Rows norm(const Rows& x, LayerNormOf which) const {
    return rms_norm(x, which == LayerNormOf::input ? layer_.input_norm : layer_.post_norm, cfg_.rms_norm_eps);
  }
  Rows head_norm(const Rows& x, LayerNormOf which) const {  // [B, T, heads, D]
    return rms_norm(heads(x), which == LayerNormOf::q ? layer_.q_norm : layer_.k_norm, cfg_.rms_norm_eps);
  }
  template <class... P>
  std::array<Rows, sizeof...(P)> project(const Rows& h, P... p) const {
    return {one_projection(p, h)...};
  }
  Rows rope(const Rows& x) const { return engine::rope(heads(x), in_.cos, in_.sin); }  // [B, heads, T, D]
  Rows attend(const Rows& q, const Rows& k, const Rows& v) const;  // q, k as rope returns them; [B, T, nh * D]
  Rows add_projection(const Rows& x, Projection p, const Rows& h) const { return x + one_projection(p, h); }
  Rows swiglu(const Rows& gate, const Rows& up) const { return engine::swiglu(gate, up); }
  Rows add_experts(const Rows& x, const Rows& h) const { return x + impl_.sparse_mlp(li_, h, in_).view(x.sizes()); }

 private:
  // [B, T, heads * D] (or already [B, T, heads, D]) -> [B, T, heads, D].
  // (The head count is explicit: an expert-parallel rank's idle forward has B = 0, which a -1 cannot size.)
  Rows heads(const Rows& x) const {
    return x.dim() == 4 ? x : x.view({x.size(0), x.size(1), x.size(2) / cfg_.head_dim, cfg_.head_dim});
  }
  // The layer's own projection or, in a step of row groups, the base's over every row and each group's adapter.
  Rows one_projection(Projection p, const Rows& h) const {
    return engine::project(layer_.projection(p), h, in_, [&](const RowGroup& g) -> const Linear& {
      return (*g.layers)[li_].projection(p);
    });
  }

  const Impl& impl_;
  const ModelConfig& cfg_;
  const Layer& layer_;
  std::size_t li_;
  const LayerInputs& in_;
};

torch::Tensor Transformer::Impl::AtenOps::attend(const Rows& q, const Rows& k, const Rows& v_rows) const {
  const torch::Tensor v = heads(v_rows).transpose(1, 2);  // [B, nkv, T, D], as rope lays out q and k
  const std::int64_t B = v.size(0), T = v.size(2), D = cfg_.head_dim, nkv = cfg_.num_key_value_heads;
  if (!in_.groups.empty()) return impl_.attend_groups(li_, q, k, v, in_);
  if (!in_.cache) return impl_.attend(li_, q, k, v, in_.scale);
  const KVBlockPool& pool = in_.cache->pool();
  store_slots(pool.keys(li_), in_.slots, k.transpose(1, 2).reshape({B * T, nkv, D}));
  store_slots(pool.values(li_), in_.slots, v.transpose(1, 2).reshape({B * T, nkv, D}));
  // Nothing cached before: the new keys and values are all there is, at the model's dtype.
  if (in_.past == 0) return impl_.attend(li_, q, k, v, in_.scale);
  // Read back from the pool, so no gradient reaches them: a forward with a cache is inference only.
  const std::int64_t S = in_.past + T;
  return impl_.attend(li_, q, gather_positions(pool.keys(li_), in_.tables, S, q.scalar_type()),
                      gather_positions(pool.values(li_), in_.tables, S, q.scalar_type()), in_.scale);
}

torch::Tensor Transformer::Impl::layer_forward(std::size_t li, torch::Tensor x, const LayerInputs& in) const {
  AtenOps ops(*this, li, in);
  return decoder_layer(ops, std::move(x));
}

torch::Tensor Transformer::Impl::sparse_mlp(std::size_t li, const torch::Tensor& h, const LayerInputs& in) const {
  const torch::Tensor rows = h.reshape({-1, h.size(2)});
  const bool step = !in.groups.empty();  // a decoding step: few rows
  // This layer's place among the sparse ones: its slice of the routing's [tokens, sparse layers, k].
  std::int64_t sparse_index = 0;
  for (std::size_t i = 0; i < li; ++i) sparse_index += layers[i].sparse() ? 1 : 0;
  if (!expert_shard.group && static_cast<std::int64_t>(layers[li].experts.size()) != cfg.num_experts)
    throw invalid_argument("Transformer: this model holds a slice of the experts; set_expert_parallel names the group "
                           "that holds the others");
  ExpertRouting* routing = in.routing;
  const bool replay = routing && routing->replay.defined();
  const ExpertStyle& style = family->expert_style;
  const ExpertActivation activation{style.clamped_swiglu, cfg.swiglu_limit, cfg.swiglu_alpha};
  // Rows [row0, row0 + x's rows) through `layer`'s router and experts.
  auto through = [&](const Layer& layer, const torch::Tensor& x, std::int64_t row0) {
    const torch::Tensor logits = layer.router.apply(x, step);
    const Routes routes = replay ? route_given(logits, routing->replay.select(1, sparse_index), cfg.norm_topk_prob,
                                               x.scalar_type(), style.softmax_after_top_k)
                                 : route_top_k(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob, x.scalar_type(),
                                               style.softmax_after_top_k);
    if (routing) {
      routing->recorded.select(1, sparse_index).narrow(0, row0, x.size(0)).copy_(routes.experts);
      if (routing->totals) add_router_totals(*routing->totals, logits, routes, routing->mask, replay);
    }
    if (expert_shard.group) {
      // Every rank holds every expert's adapters (they are small: replicated, summed and stepped like the dense
      // weights) and applies those of its own experts.
      const ExpertAdapters& all = layer.expert_lora;
      const ExpertAdapters own =
          all.any() ? all.slice(expert_shard.first, expert_shard.per_rank, cfg.num_experts) : ExpertAdapters{};
      return run_experts_parallel(x, routes, layer.experts, own.any() ? &own : nullptr, expert_shard, activation);
    }
    return run_experts(x, routes, layer.experts, layer.expert_lora.any() ? &layer.expert_lora : nullptr, step,
                       activation);
  };
  bool adapted = false;
  for (const RowGroup& g : in.groups) {
    const Layer& own = (*g.layers)[li];
    adapted = adapted || own.expert_lora.any() || own.router.lora_a.defined();
  }
  // Without adapters anywhere: any group's layer is the base's (this model's own may have adapters of its own).
  if (!adapted) return through(in.groups.empty() ? layers[li] : (*in.groups.front().layers)[li], rows, 0);
  // Consecutive groups over the same layers (one session's requests: their rows are consecutive too) go through them
  // at once: one pass of the experts per model in the step and, under expert parallelism, one exchange, as every
  // rank's step makes (an expert-parallel step's groups are all of one model: sample_lockstep_share).
  std::vector<torch::Tensor> out;
  for (std::size_t i = 0, j = 0; i < in.groups.size(); i = j) {
    std::int64_t n = 0;
    for (j = i; j < in.groups.size() && in.groups[j].layers == in.groups[i].layers; ++j) n += in.groups[j].rows;
    out.push_back(through((*in.groups[i].layers)[li], rows.narrow(0, in.groups[i].row0, n), in.groups[i].row0));
  }
  return out.size() == 1 ? out.front() : torch::cat(out);
}

torch::Tensor Transformer::Impl::attend_groups(std::size_t li, const torch::Tensor& q, const torch::Tensor& k,
                                               const torch::Tensor& v, const LayerInputs& in) const {
  // q [1, nh, R, D], k and v [1, nkv, R, D]: row r is its sequence's new position. Every row's key and value go to
  // its slot, then every row attends over its own blocks: a fixed number of operators for any number of groups.
  const std::int64_t R = q.size(2), nh = q.size(1), nkv = k.size(1), D = q.size(3);
  KVBlockPool& pool = *in.pool;
  store_slots(pool.keys(li), in.slots, k[0].transpose(0, 1));
  store_slots(pool.values(li), in.slots, v[0].transpose(0, 1));
  const torch::ScalarType cache = pool.dtype();
  const std::int64_t window = cfg.attention_window(static_cast<std::int64_t>(li));
  const torch::Tensor& sinks = layers[li].sinks;
  if (q.device().is_cpu() && q.scalar_type() == torch::kFloat32 && !sinks.defined() && window == 0 &&
      (cache == torch::kFloat32 || cache == torch::kBFloat16)) {
    // The CPU decoder's attention kernel over the blocks in place (one definition of decode attention on the CPU).
    const torch::Tensor rows = q[0].transpose(0, 1).contiguous();  // [R, nh, D]
    torch::Tensor out = torch::empty({R, nh * D}, q.options());
    const DecodeSlots& step = *in.step;
    const PagedRows paged{step.tables.data(), step.max_blocks, step.lengths.data(), R};
    const auto scale = static_cast<float>(in.scale);
    if (cache == torch::kFloat32)
      attend_paged(rows.data_ptr<float>(), pool.keys(li).data_ptr<float>(), pool.values(li).data_ptr<float>(), paged,
                   nh, nkv, D, scale, out.data_ptr<float>());
    else
      attend_paged(rows.data_ptr<float>(), static_cast<const std::uint16_t*>(pool.keys(li).data_ptr()),
                   static_cast<const std::uint16_t*>(pool.values(li).data_ptr()), paged, nh, nkv, D, scale,
                   out.data_ptr<float>());
    return out.view({1, R, nh * D});
  }
  // Elsewhere (CUDA, bf16, sinks or a window): every row's blocks gathered (padded to the longest table) and masked
  // past its length (and before its window).
  // Why every layer, every step, even when the batch's layout has not changed: each layer reads its own keys and
  // values, so a gather per layer is the price of reading paged blocks without a paged-attention kernel (ATen has
  // none). Keeping each layer's padded copy between steps and appending the new position would skip it, but holds a
  // second, unshared copy of every row's cache (the samples of a request share their prompt's blocks; a padded copy
  // would not), so that the pool's memory budget no longer bounds the step's. The gather writes and reads as many
  // bytes as the attention reads after it: at most 3x attention's traffic, itself a small share of a short-context
  // step's (the weights dominate). A reason from the bytes, not yet a measurement: no GPU run has happened.
  // q_rows [rows, nh, 1, D] over the blocks of `tables` [rows, blocks], each up to its key count in `lengths`.
  auto one_token_rows = [&](const torch::Tensor& q_rows, const torch::Tensor& tables, const torch::Tensor& lengths) {
    const std::int64_t S = tables.size(1) * kKVBlockTokens;
    const torch::Tensor keys = gather_positions(pool.keys(li), tables, S, q.scalar_type());
    const torch::Tensor values = gather_positions(pool.values(li), tables, S, q.scalar_type());
    return decode_attention(q_rows, keys, values, lengths, in.scale, sinks, window).view({q_rows.size(0), nh * D});
  };
  if (!in.single_rows.defined()) return one_token_rows(q[0].transpose(0, 1).unsqueeze(2), in.tables, in.lengths)
                                      .view({1, R, nh * D});
  // A step with prompt chunks: its one-token rows as above, in one call over their own blocks (a chunk may have
  // made the tables longer); a chunk's rows as a prefill attends (causally over its sequence's blocks, so a chunk
  // never holds [rows, keys] per row).
  torch::Tensor out = torch::empty({1, R, nh * D}, q.options());
  if (in.single_rows.numel() > 0) {
    const std::int64_t blocks = (in.single_longest + kKVBlockTokens - 1) / kKVBlockTokens;
    const torch::Tensor& rows = in.single_rows;
    out[0].index_copy_(0, rows,
                       one_token_rows(q[0].index_select(1, rows).transpose(0, 1).unsqueeze(2),
                                      in.tables.index_select(0, rows).narrow(1, 0, blocks),
                                      in.lengths.index_select(0, rows)));
  }
  for (const RowGroup& g : in.groups) {
    if (!g.chunk) continue;
    const std::int64_t S = in.step->lengths[g.row0 + g.rows - 1];
    const torch::Tensor table = in.tables.narrow(0, g.row0, 1);
    out.narrow(1, g.row0, g.rows)
        .copy_(attend(li, q.narrow(2, g.row0, g.rows), gather_positions(pool.keys(li), table, S, q.scalar_type()),
                      gather_positions(pool.values(li), table, S, q.scalar_type()), in.scale));
  }
  return out;
}

void Transformer::set_activation_checkpointing(bool on) { impl_->checkpoint_layers = on; }

bool Transformer::activation_checkpointing() const { return impl_->checkpoint_layers; }

bool Transformer::expert_parallel() const { return impl_->expert_shard.group != nullptr; }

bool Transformer::is_expert_tensor(const std::string& name) const {
  const ModelFamily& f = *impl_->family;
  // Most names are not an expert's: one search rejects them before the layers' prefixes are built.
  if (name.find("." + f.names.experts + ".") == std::string::npos) return false;
  for (std::size_t i = 0; i < impl_->layers.size(); ++i) {
    if (!impl_->layers[i].sparse()) continue;
    if (name.starts_with(f.layer_tensor(static_cast<std::int64_t>(i), f.names.experts) + ".")) return true;
  }
  return false;
}

int Transformer::expert_rank_of(const std::string& name) const {
  const ExpertShard& shard = impl_->expert_shard;
  if (!shard.group || !is_expert_tensor(name)) return -1;
  // The expert's index follows the experts' name (stacked adapters of every expert have none).
  const std::string experts = "." + impl_->family->names.experts + ".";
  std::size_t at = name.find(experts) + experts.size();
  std::int64_t e = 0;
  const std::size_t first = at;
  for (; at < name.size() && name[at] >= '0' && name[at] <= '9'; ++at) e = e * 10 + (name[at] - '0');
  if (at == first || at == name.size() || name[at] != '.') return -1;
  return static_cast<int>(e / shard.per_rank);
}

void Transformer::set_expert_parallel(dist::Group& group) {
  const ModelConfig& cfg = impl_->cfg;
  if (cfg.num_experts == 0)
    throw invalid_argument("expert parallelism: this " + cfg.model_type + " model has no experts");
  const ExpertShard shard = ExpertShard::of(group, cfg.num_experts);
  for (std::size_t i = 0; i < impl_->layers.size(); ++i) {
    const Layer& l = impl_->layers[i];
    if (!l.sparse()) continue;
    const std::string first = impl_->family->expert_module(static_cast<std::int64_t>(i), shard.first, Projection::gate);
    if (static_cast<std::int64_t>(l.experts.size()) != shard.per_rank || l.experts.front().gate.name != first)
      throw invalid_argument("expert parallelism: rank " + std::to_string(shard.first / shard.per_rank) + " of " +
                             std::to_string(cfg.num_experts / shard.per_rank) + " holds experts [" +
                             std::to_string(shard.first) + ", " +
                             std::to_string(shard.first + shard.per_rank) +
                             "); build its model with that ExpertRange");
  }
  impl_->expert_shard = shard;
}

torch::Tensor Transformer::hidden_states(const torch::Tensor& input_ids, KVCache* cache, ExpertRouting* routing) {
  const ModelConfig& cfg = impl_->cfg;
  if (input_ids.dim() != 2 || input_ids.scalar_type() != torch::kLong)
    throw invalid_argument("Transformer::hidden_states: input_ids must be an int64 [batch, tokens] tensor, got " +
                           std::string(c10::toString(input_ids.scalar_type())) + " " + shape_string(input_ids.sizes()));
  const std::int64_t B = input_ids.size(0), T = input_ids.size(1);
  // No sequences at all only for an expert-parallel rank without datums: it still takes part in every exchange.
  if ((B == 0 && !(impl_->expert_shard.group && !cache)) || T == 0)
    throw invalid_argument("Transformer::hidden_states: empty input " + shape_string(input_ids.sizes()));
  // Ids on the host are checked there, before they are uploaded. Ids already on a device are not read back (that
  // would make the host wait at every prefill and training forward): they come from the sampler (inside the
  // vocabulary by construction) or from a session, which checked its datums' and prompts' tokens on the host.
  if (input_ids.device().is_cpu()) {
    const torch::Tensor host = input_ids.contiguous();
    const std::int64_t* id = host.data_ptr<std::int64_t>();
    for (std::int64_t i = 0; i < host.numel(); ++i)
      if (id[i] < 0 || id[i] >= cfg.vocab_size)
        throw invalid_argument("Transformer::hidden_states: token id " + std::to_string(id[i]) +
                               " is outside the vocabulary [0, " + std::to_string(cfg.vocab_size) + ")");
  }
  const std::int64_t past = cache ? cache->length : 0;
  if (cache) {
    if (!cache->fits(cfg) || cache->batch() != B)
      throw invalid_argument("Transformer::hidden_states: the KV cache has " + std::to_string(cache->layers()) +
                             " layers, batch " + std::to_string(cache->batch()) + " and " +
                             std::to_string(cache->kv_heads()) + " KV heads of " +
                             std::to_string(cache->head_dim()) + ", the model " +
                             std::to_string(cfg.num_hidden_layers) + " layers and " +
                             std::to_string(cfg.num_key_value_heads) + " of " + std::to_string(cfg.head_dim) +
                             ", the input batch " + std::to_string(B));
    if (cache->device() != impl_->device())
      throw invalid_argument("Transformer::hidden_states: the KV cache is on " + cache->device().str() +
                             ", the model on " + impl_->device().str());
    if (past + T > cache->capacity)
      throw invalid_argument("Transformer::hidden_states: KV cache capacity " + std::to_string(cache->capacity) +
                             " exceeded (" + std::to_string(past) + " cached + " + std::to_string(T) + " new tokens)");
  }
  const std::int64_t S = past + T;  // key length
  const std::int64_t D = cfg.head_dim;
  const auto device = impl_->device();
  const auto dtype = impl_->dtype();
  torch::Tensor ids = input_ids.device() == device ? input_ids : input_ids.to(device);

  // [T, D] rows of the RoPE tables, broadcast over batch and heads.
  const auto [cos_table, sin_table] = impl_->rope_tables(device, dtype);
  torch::Tensor cos = cos_table.narrow(0, past, T), sin = sin_table.narrow(0, past, T);

  const double scale = 1.0 / std::sqrt(static_cast<double>(D));

  torch::Tensor x =
      impl_->embed_quantized ? impl_->embed_quantized->rows_of(ids) : torch::embedding(impl_->embed, ids);
  LayerInputs in{cos, sin, scale, cache, past};
  if (cache) {
    cache->prepare_append(T);
    std::vector<std::int64_t> slots, tables;
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t t = 0; t < T; ++t) slots.push_back(cache->slot(b, past + t));
    in.slots = to_device(torch::tensor(slots, torch::kLong), device);
    if (past > 0) {
      for (std::int64_t b = 0; b < B; ++b)
        tables.insert(tables.end(), cache->blocks(b).begin(), cache->blocks(b).end());
      in.tables = to_device(torch::tensor(tables, torch::kLong), device).view({B, -1});
    }
  }
  // Checkpointed layers keep only their input for backward and recompute the rest there (training, no cache).
  const bool checkpoint = impl_->checkpoint_layers && !cache && torch::GradMode::is_enabled();
  // Under checkpointing a sparse layer's recompute replays its forward's routes (CheckpointedLayer): they are
  // recorded even when the caller asked for none.
  ExpertRouting own_routing;
  if (!routing && checkpoint && cfg.num_experts > 0) routing = &own_routing;
  if (routing) {
    impl_->check_routing(*routing, B * T);
    if (routing->replay.defined() && routing->replay.device() != device) routing->replay = routing->replay.to(device);
    if (routing->mask.defined() && routing->mask.device() != device) routing->mask = routing->mask.to(device);
    routing->recorded = torch::empty({B * T, impl_->sparse_layers(), cfg.num_experts_per_tok},
                                     torch::TensorOptions().dtype(torch::kLong).device(device));
    in.routing = routing;
  }
  for (std::size_t li = 0; li < impl_->layers.size(); ++li)
    x = checkpoint ? Impl::CheckpointedLayer::run(*impl_, li, x, in) : impl_->layer_forward(li, x, in);
  if (cache) cache->length = S;
  return rms_norm(x, impl_->final_norm, cfg.rms_norm_eps);
}

torch::Tensor Transformer::logits(const torch::Tensor& hidden) { return impl_->lm_head.apply(hidden); }

bool Transformer::shares_base(const Transformer& other) const {
  const Impl& a = *impl_;
  const Impl& b = *other.impl_;
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
        !same(x.k_norm, y.k_norm) || !same(x.sinks, y.sinks))
      return false;
    const auto xs = x.linears(), ys = y.linears();
    if (xs.size() != ys.size()) return false;
    for (std::size_t j = 0; j < xs.size(); ++j)
      if (!same_linear(*xs[j], *ys[j])) return false;
  }
  return true;
}

namespace {

// The layout add_stacked_adapters reads for a step's row groups (LayerInputs::padded_rows): over the groups of one
// token per sequence, when there are two or more; each group's LoRA scale in `scales`.
void set_stacked_layout(LayerInputs& in, std::span<const RowGroup> rows, const std::vector<double>& scales,
                        torch::Device device) {
  in.groups = rows;
  in.padded_rows = in.unpadded_rows = in.lora_scales = in.stacked_rows = torch::Tensor();
  in.rows_max = 0;
  std::vector<std::size_t> stacked;
  for (std::size_t gi = 0; gi < rows.size(); ++gi)
    if (!rows[gi].chunk) stacked.push_back(gi);
  if (stacked.size() < 2) return;
  std::vector<std::int64_t> padded, unpadded, covered;
  std::vector<double> stacked_scales;
  for (std::size_t gi : stacked) in.rows_max = std::max(in.rows_max, rows[gi].rows);
  for (std::size_t s = 0; s < stacked.size(); ++s) {
    const RowGroup& g = rows[stacked[s]];
    for (std::int64_t i = 0; i < in.rows_max; ++i) padded.push_back(g.row0 + std::min(i, g.rows - 1));
    for (std::int64_t i = 0; i < g.rows; ++i) {
      unpadded.push_back(static_cast<std::int64_t>(s) * in.rows_max + i);
      covered.push_back(g.row0 + i);
    }
    stacked_scales.push_back(scales[stacked[s]]);
  }
  in.padded_rows = to_device(torch::tensor(padded, torch::kLong), device);
  in.unpadded_rows = to_device(torch::tensor(unpadded, torch::kLong), device);
  in.lora_scales = to_device(torch::tensor(stacked_scales, torch::kFloat64), device);
  if (stacked.size() < rows.size()) in.stacked_rows = to_device(torch::tensor(covered, torch::kLong), device);
}

}  // namespace

torch::Tensor Transformer::decode_step(std::span<const DecodeGroup> groups, torch::Tensor* routes) {
  const ModelConfig& cfg = impl_->cfg;
  if (groups.empty()) throw invalid_argument("Transformer::decode_step: no groups");
  if (routes && cfg.num_experts == 0)
    throw invalid_argument("Transformer::decode_step: routes asked of a " + cfg.model_type + " model without experts");
  c10::InferenceMode inference;
  const auto device = impl_->device();
  std::vector<RowGroup> rows;
  std::vector<torch::Tensor> tokens;
  std::vector<KVCache*> caches;
  std::vector<std::int64_t> new_tokens;
  std::vector<double> scales;  // each group's LoRA scale
  std::int64_t R = 0;
  for (const DecodeGroup& g : groups) {
    if (!g.model || !g.tokens || !g.cache) throw invalid_argument("Transformer::decode_step: a group lacks a member");
    if (!shares_base(*g.model))
      throw invalid_argument("Transformer::decode_step: a group's model does not share this model's base weights");
    KVCache& c = *g.cache;
    const std::int64_t n = g.tokens->numel();
    if (!c.fits(cfg))
      throw invalid_argument("Transformer::decode_step: a group's KV cache has " + std::to_string(c.layers()) +
                             " layers of " + std::to_string(c.kv_heads()) + " KV heads, the model " +
                             std::to_string(cfg.num_hidden_layers) + " of " + std::to_string(cfg.num_key_value_heads));
    if (g.tokens->dim() != 1 || g.tokens->scalar_type() != torch::kLong || n == 0 ||
        (c.batch() != n && c.batch() != 1))
      throw invalid_argument("Transformer::decode_step: a group's tokens must be [rows] int64, one per cache row or a "
                             "chunk of a cache of batch 1, got " + shape_string(g.tokens->sizes()) +
                             " for a cache of batch " + std::to_string(c.batch()));
    if (g.tokens->device() != device || c.device() != device)
      throw invalid_argument("Transformer::decode_step: a group's tokens and cache must be on the model's device (" +
                             device.str() + ")");
    const bool chunk = c.batch() != n;
    const std::int64_t last = c.length + (chunk ? n : 1) - 1;  // the last position the group feeds
    // The RoPE tables end there (and an index past them would be a device-side assert on CUDA).
    if (last >= cfg.max_position_embeddings)
      throw invalid_argument("Transformer::decode_step: position " + std::to_string(last) +
                             " is past the model's context (max_position_embeddings " +
                             std::to_string(cfg.max_position_embeddings) + ")");
    if (last >= c.capacity)
      throw invalid_argument("Transformer::decode_step: KV cache capacity " + std::to_string(c.capacity) +
                             (chunk ? " exceeded (" + std::to_string(c.length) + " cached + " + std::to_string(n) +
                                          " new tokens)"
                                    : std::string(" is full")));
    const Impl& own = *g.model->impl_;
    rows.push_back({&own.layers, &own.lm_head, R, n, chunk});
    tokens.push_back(*g.tokens);
    caches.push_back(&c);
    new_tokens.push_back(n);
    scales.push_back(own.lora ? static_cast<double>(own.lora->alpha) / own.lora->rank : 0.0);
    R += n;
  }
  const DecodeSlots step = prepare_decode_step(caches, new_tokens, "Transformer::decode_step");
  // The rows of the one-token groups, in a step with prompt chunks (LayerInputs::single_rows).
  std::vector<std::int64_t> single;
  std::int64_t single_longest = 0;
  bool chunks = false;
  for (const RowGroup& g : rows) chunks = chunks || g.chunk;
  for (const RowGroup& g : rows) {
    if (!chunks || g.chunk) continue;
    for (std::int64_t r = g.row0; r < g.row0 + g.rows; ++r) {
      single.push_back(r);
      single_longest = std::max(single_longest, step.lengths[r]);
    }
  }
  // The step's layout in one copy to the device: every row's slot, key count and block table (and those rows).
  std::vector<std::int64_t> layout(step.slots);
  layout.insert(layout.end(), step.lengths.begin(), step.lengths.end());
  layout.insert(layout.end(), step.tables.begin(), step.tables.end());
  layout.insert(layout.end(), single.begin(), single.end());
  const torch::Tensor on_device = to_device(torch::tensor(layout, torch::kLong), device);
  // The rows as the positions of one sequence ([1, R]): norms, products and RoPE run over all of them at once.
  const torch::Tensor ids = torch::cat(tokens).view({1, R});
  const auto [cos_table, sin_table] = impl_->rope_tables(device, impl_->dtype());
  LayerInputs in{{}, {}, 1.0 / std::sqrt(static_cast<double>(cfg.head_dim)), nullptr, 0};
  set_stacked_layout(in, rows, scales, device);
  in.step = &step;
  in.pool = &caches.front()->pool();
  in.slots = on_device.narrow(0, 0, R);
  in.lengths = on_device.narrow(0, R, R);
  in.tables = on_device.narrow(0, 2 * R, R * step.max_blocks).view({R, step.max_blocks});
  if (chunks) {
    in.single_rows = on_device.narrow(0, 2 * R + R * step.max_blocks, static_cast<std::int64_t>(single.size()));
    in.single_longest = single_longest;
  }
  const torch::Tensor positions = in.lengths - 1;
  in.cos = cos_table.index_select(0, positions);
  in.sin = sin_table.index_select(0, positions);
  ExpertRouting routing;
  if (routes) {
    routing.recorded = torch::empty({R, impl_->sparse_layers(), cfg.num_experts_per_tok},
                                    torch::TensorOptions().dtype(torch::kLong).device(device));
    in.routing = &routing;
  }
  torch::Tensor x = impl_->embed_quantized ? impl_->embed_quantized->rows_of(ids) : torch::embedding(impl_->embed, ids);
  for (std::size_t li = 0; li < impl_->layers.size(); ++li) x = impl_->layer_forward(li, x, in);
  for (std::size_t i = 0; i < caches.size(); ++i) caches[i]->length += step.advance[i];
  if (routes) *routes = routing.recorded;
  torch::Tensor h = rms_norm(x, impl_->final_norm, cfg.rms_norm_eps);

  // The unembedding of the rows asked for only: a chunk's earlier rows predict tokens the prompt already has.
  std::vector<RowGroup> wanted;
  std::vector<std::int64_t> kept;
  std::vector<double> wanted_scales;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    if (!groups[i].logits) continue;
    const RowGroup& g = rows[i];
    const std::int64_t first = g.chunk ? g.row0 + g.rows - 1 : g.row0;
    wanted.push_back({g.layers, g.lm_head, static_cast<std::int64_t>(kept.size()), g.row0 + g.rows - first});
    for (std::int64_t r = first; r < g.row0 + g.rows; ++r) kept.push_back(r);
    wanted_scales.push_back(scales[i]);
  }
  if (kept.empty()) return torch::empty({0, cfg.vocab_size}, h.options());
  if (static_cast<std::int64_t>(kept.size()) != R) {
    h = h.index_select(1, to_device(torch::tensor(kept, torch::kLong), device));
    set_stacked_layout(in, wanted, wanted_scales, device);
  }
  return project(impl_->lm_head, h, in, [](const RowGroup& g) -> const Linear& { return *g.lm_head; })[0];
}

// ------------------------------------------------------------------------------------------ state dicts

TensorMap Transformer::hf_state_dict() const {
  TensorMap out;
  impl_->for_each_base([&](const std::string& name, const torch::Tensor& t) { out[name] = t.detach(); });
  impl_->for_each_quantized([&](const std::string& name, const QuantizedMatrix& q) { out[name] = q.dequantize(); });
  return out;
}

void Transformer::load_hf_state_dict(const TensorMap& tensors) {
  std::map<std::string, torch::Tensor> expected;
  impl_->for_each_base([&](const std::string& name, const torch::Tensor& t) { expected[name] = t; });
  std::vector<std::string> unexpected;
  for (const auto& [name, t] : tensors) {
    if (expected.count(name)) continue;
    // Old HF checkpoints store the RoPE frequencies as a buffer; we recompute them.
    if (name.size() >= 19 && name.compare(name.size() - 19, 19, "rotary_emb.inv_freq") == 0) continue;
    const WeightNames& names = impl_->family->names;
    if (name == names.lm_head + ".weight" && impl_->cfg.tie_word_embeddings) {
      // Some tied checkpoints store the duplicate; one that differs means the config is wrong.
      auto it = tensors.find(names.embed + ".weight");
      if (it != tensors.end() && !torch::equal(it->second.to(t.scalar_type()).cpu(), t.cpu()))
        throw invalid_argument("load_hf_state_dict: " + name + " differs from " + it->first +
                               " but the config ties them (set tie_word_embeddings to false)");
      continue;
    }
    unexpected.push_back(name);
  }
  if (!unexpected.empty()) {
    std::string list;
    for (std::size_t i = 0; i < unexpected.size() && i < 5; ++i) list += (i ? ", " : "") + unexpected[i];
    if (unexpected.size() > 5) list += ", ...";
    throw invalid_argument("load_hf_state_dict: " + std::to_string(unexpected.size()) +
                           " unexpected tensor(s) for this " + impl_->cfg.model_type + " config: " + list);
  }
  for (const auto& [name, param] : expected) {
    auto it = tensors.find(name);
    if (it == tensors.end()) throw invalid_argument("load_hf_state_dict: missing tensor '" + name + "'");
    if (it->second.sizes() != param.sizes())
      throw invalid_argument("load_hf_state_dict: tensor '" + name + "' has shape " + shape_string(it->second.sizes()) +
                             ", the model expects " + shape_string(param.sizes()));
  }
  torch::NoGradGuard no_grad;
  for (auto& [name, param] : expected) param.copy_(tensors.at(name));
}

// ------------------------------------------------------------------------------------------------- LoRA

void Transformer::enable_lora(const LoraOptions& options, std::int64_t seed) {
  if (impl_->lora) throw conflict("Transformer::enable_lora: the model already has LoRA adapters");
  if (options.rank <= 0)
    throw invalid_argument("LoraOptions.rank must be positive, got " + std::to_string(options.rank));
  if (options.alpha <= 0)
    throw invalid_argument("LoraOptions.alpha must be positive, got " + std::to_string(options.alpha));
  const ModelFamily& family = *impl_->family;
  const bool has_experts = impl_->cfg.num_experts > 0;
  // PEFT's all-linear reaches only attention on a model whose experts are stacked parameters in every layer and
  // whose router is no nn.Linear (gpt-oss); its experts and router are adapted when named (PEFT's
  // target_parameters).
  const bool stacked = has_experts && family.expert_style.stacked_interleaved;
  const std::vector<std::string> known = family.lora_target_modules();
  std::set<std::string> targets;
  for (const auto& m : options.target_modules) {
    if (m == "all-linear") {
      for (Projection p : kProjections)
        if (!stacked || p < Projection::gate) targets.insert(family.target_module(p));
      if (has_experts && !stacked) targets.insert(family.router_target_module());  // PEFT's all-linear: the router
    } else if (std::find(known.begin(), known.end(), m) != known.end()) {
      targets.insert(m);
    } else {
      std::string list;
      for (const std::string& k : known) list += (list.empty() ? "" : ", ") + k;
      throw invalid_argument("LoraOptions.target_modules: unknown module '" + m + "' (" + family.model_type +
                             " models have " + list + ")");
    }
  }
  if (targets.empty()) throw invalid_argument("LoraOptions.target_modules is empty");
  // The experts' gate and up projections are one stacked weight in transformers (gate_up_proj), adapted as one.
  const std::string gate = family.target_module(Projection::gate), up = family.target_module(Projection::up);
  const bool gate_up = targets.count(gate) && targets.count(up);
  if (has_experts && targets.count(gate) != targets.count(up))
    throw invalid_argument("LoraOptions.target_modules: '" + (targets.count(gate) ? gate : up) + "' needs '" +
                           (targets.count(gate) ? up : gate) + "' too on " + family.model_type +
                           " models: the experts' gate and up projections are one stacked weight, adapted as one");
  const bool down = targets.count(family.target_module(Projection::down)) > 0;

  for (auto& p : parameters()) p.set_requires_grad(false);
  // A is drawn on the CPU in fp32 from its own generator so the init is the same on every device.
  auto gen = at::detail::createCPUGenerator(static_cast<std::uint64_t>(seed));
  const double scale = static_cast<double>(options.alpha) / options.rank;
  const auto base_dtype = impl_->dtype();
  // Adapters stay fp32 unless the base is fp64 (PEFT keeps adapters in fp32 over bf16 weights).
  const auto lora_dtype = base_dtype == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
  const auto device = impl_->device();
  // A [rows, in] as PEFT initialises it (kaiming_uniform_(a=sqrt(5)) => U(-1/sqrt(in), 1/sqrt(in))), B zero.
  auto pair = [&](const std::string& name, std::int64_t rows, std::int64_t in, std::int64_t out) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(in));
    auto a = torch::empty({rows, in}, torch::kFloat32).uniform_(-bound, bound, gen);
    return std::pair{
        register_parameter(module_name(name) + "_lora_A", a.to(device, lora_dtype), true),
        register_parameter(module_name(name) + "_lora_B",
                           torch::zeros({out, rows}, torch::TensorOptions().device(device).dtype(lora_dtype)), true)};
  };
  impl_->for_each_linear([&](Linear& lin) {
    if (!targets.count(lin.short_name)) return;
    std::tie(lin.lora_a, lin.lora_b) = pair(lin.name, options.rank, lin.in_features(), lin.out_features());
    lin.lora_scale = scale;
  });
  const std::int64_t E = impl_->cfg.num_experts, I = impl_->cfg.moe_intermediate_size, H = impl_->cfg.hidden_size;
  for (std::size_t i = 0; i < impl_->layers.size(); ++i) {
    Layer& l = impl_->layers[i];
    if (!l.sparse() || !(gate_up || down)) continue;
    const std::string experts = family.layer_tensor(static_cast<std::int64_t>(i), family.names.experts);
    // PEFT doubles the fused gate_up's rank and alpha: the same scale, the capacity of the two adapters it replaces.
    ExpertAdapters& adapters = l.expert_lora;
    const std::int64_t r = options.rank;
    if (gate_up) std::tie(adapters.gate_up_a, adapters.gate_up_b) = pair(experts + ".gate_up", E * 2 * r, H, 2 * I);
    if (down) std::tie(adapters.down_a, adapters.down_b) = pair(experts + ".down", E * r, I, H);
    adapters.scale = scale;
  }
  impl_->lora = options;
}

bool Transformer::has_lora() const { return impl_->lora.has_value(); }

const std::optional<LoraOptions>& Transformer::lora_options() const { return impl_->lora; }

std::vector<torch::Tensor> Transformer::lora_a_parameters() {
  std::vector<torch::Tensor> out;
  impl_->for_each_adapter([&](const std::string&, const torch::Tensor& t, bool a) {
    if (a) out.push_back(t);
  });
  return out;
}

std::vector<torch::Tensor> Transformer::lora_b_parameters() {
  std::vector<torch::Tensor> out;
  impl_->for_each_adapter([&](const std::string&, const torch::Tensor& t, bool a) {
    if (!a) out.push_back(t);
  });
  return out;
}

namespace {
// gpt-oss's checkpoint interleaves each expert's gate and up columns (gate_up_proj [E, H, 2I]: gate at even, up at
// odd), and PEFT's B of the stacked adapter has its rows in that order; rlloop's gate_up B has the gate's I rows,
// then the up's. Nothing else of the layout differs (PEFT reads the transposed stack as [E, in, out]).
torch::Tensor interleave_gate_up_rows(const torch::Tensor& b) {
  const std::int64_t I = b.size(0) / 2;
  return torch::stack({b.narrow(0, 0, I), b.narrow(0, I, I)}, 1).reshape(b.sizes());
}
torch::Tensor deinterleave_gate_up_rows(const torch::Tensor& b) {
  return torch::cat({b.slice(0, 0, b.size(0), 2), b.slice(0, 1, b.size(0), 2)});
}
}  // namespace

TensorMap Transformer::peft_state_dict() const {
  if (!impl_->lora) throw conflict("Transformer::peft_state_dict: the model has no LoRA adapters");
  std::set<const void*> interleaved;  // gpt-oss's gate_up Bs
  if (impl_->family->expert_style.stacked_interleaved)
    for (const Layer& l : impl_->layers)
      if (l.expert_lora.gate_up_b.defined()) interleaved.insert(l.expert_lora.gate_up_b.unsafeGetTensorImpl());
  TensorMap out;
  impl_->for_each_adapter([&](const std::string& name, const torch::Tensor& t, bool) {
    out[name] = interleaved.count(t.unsafeGetTensorImpl()) ? interleave_gate_up_rows(t.detach()) : t.detach();
  });
  return out;
}

void Transformer::load_peft_state_dict(const TensorMap& tensors) {
  if (!impl_->lora)
    throw conflict("Transformer::load_peft_state_dict: the model has no LoRA adapters (enable_lora first)");
  std::map<std::string, torch::Tensor> expected;
  impl_->for_each_adapter([&](const std::string& name, const torch::Tensor& t, bool) { expected[name] = t; });
  for (const auto& [name, t] : tensors)
    if (!expected.count(name))
      throw invalid_argument("load_peft_state_dict: unexpected adapter tensor '" + name +
                             "' (not a LoRA target of this model)");
  for (const auto& [name, param] : expected) {
    auto it = tensors.find(name);
    if (it == tensors.end()) throw invalid_argument("load_peft_state_dict: missing adapter tensor '" + name + "'");
    if (it->second.sizes() != param.sizes())
      throw invalid_argument("load_peft_state_dict: adapter tensor '" + name + "' has shape " +
                             shape_string(it->second.sizes()) + ", the model expects " + shape_string(param.sizes()));
  }
  torch::NoGradGuard no_grad;
  for (auto& [name, param] : expected) param.copy_(tensors.at(name));
  if (impl_->family->expert_style.stacked_interleaved)
    for (Layer& l : impl_->layers)
      if (l.expert_lora.gate_up_b.defined())
        l.expert_lora.gate_up_b.copy_(deinterleave_gate_up_rows(l.expert_lora.gate_up_b));
}

TensorMap Transformer::merged_hf_state_dict() const {
  TensorMap out = hf_state_dict();
  if (!impl_->lora) return out;
  torch::NoGradGuard no_grad;
  impl_->for_each_linear([&](const Linear& lin) {
    if (!lin.lora_a.defined()) return;
    // A tied model with an lm_head adapter gets an untied lm_head.weight (save_model unties the config).
    out[lin.name + ".weight"] = lin.merged_weight();
  });
  // Each expert's weights with its share of the stacked adapters, accumulated as merged_weight accumulates.
  for (const Layer& l : impl_->layers) {
    const ExpertAdapters& adapters = l.expert_lora;
    const auto E = static_cast<std::int64_t>(l.experts.size());
    auto merge = [&](const Linear& lin, const torch::Tensor& a, const torch::Tensor& b) {
      const torch::Tensor w = lin.dense_weight();
      const auto acc = a.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
      out[lin.name + ".weight"] =
          (w.to(acc) + adapters.scale * torch::matmul(b.to(acc), a.to(acc))).to(w.scalar_type());
    };
    for (std::int64_t e = 0; e < E; ++e) {
      const Expert& expert = l.experts[static_cast<std::size_t>(e)];
      if (adapters.gate_up_a.defined()) {
        const auto [a, b] = ExpertAdapters::factors(adapters.gate_up_a, adapters.gate_up_b, e, E);
        const std::int64_t I = b.size(0) / 2;
        merge(expert.gate, a, b.narrow(0, 0, I));
        merge(expert.up, a, b.narrow(0, I, I));
      }
      if (adapters.down_a.defined()) {
        const auto [a, b] = ExpertAdapters::factors(adapters.down_a, adapters.down_b, e, E);
        merge(expert.down, a, b);
      }
    }
  }
  return out;
}

bool Transformer::cpu_kernels_decode() const {
  const Impl& m = *impl_;
  for (std::size_t i = 0; i < m.layers.size(); ++i)
    if (!m.layers[i].cpu_kernels_apply(m.cfg.attention_window(static_cast<std::int64_t>(i)))) return false;
  auto fp32_cpu = [](const torch::Tensor& t) {
    return !t.defined() || (t.device().is_cpu() && t.scalar_type() == torch::kFloat32);
  };
  const Linear& head = m.lm_head;
  return fp32_cpu(m.embed) && fp32_cpu(m.final_norm) && fp32_cpu(head.weight) && fp32_cpu(head.bias) &&
         fp32_cpu(head.lora_a) && fp32_cpu(head.lora_b);
}

InferenceWeights Transformer::inference_weights() {
  torch::NoGradGuard no_grad;
  auto linear = [](const Linear& lin) {
    LinearWeights w;
    if (lin.weight.defined()) w.weight = lin.weight.detach();
    w.quantized = lin.quantized;
    if (lin.bias.defined()) w.bias = lin.bias.detach();
    if (lin.lora_a.defined()) {
      w.lora_a = lin.lora_a.detach();
      w.lora_b = lin.lora_b.detach();
      w.lora_scale = lin.lora_scale;
    }
    return w;
  };
  InferenceWeights out;
  if (impl_->embed.defined()) out.embed = impl_->embed.detach();
  out.quantized_embed = impl_->embed_quantized;
  out.final_norm = impl_->final_norm.detach();
  for (const Layer& l : impl_->layers) {
    LayerWeights w;
    w.input_norm = l.input_norm.detach();
    w.post_norm = l.post_norm.detach();
    if (impl_->cfg.qk_norm) {
      w.q_norm = l.q_norm.detach();
      w.k_norm = l.k_norm.detach();
    }
    w.q = linear(l.q), w.k = linear(l.k), w.v = linear(l.v), w.o = linear(l.o);
    w.gate = linear(l.gate), w.up = linear(l.up), w.down = linear(l.down);
    out.layers.push_back(std::move(w));
  }
  out.lm_head = linear(impl_->lm_head);
  std::tie(out.rope_cos, out.rope_sin) = impl_->rope_tables(impl_->device(), impl_->dtype());
  return out;
}

std::int64_t Transformer::quantized_bytes() const {
  std::int64_t bytes = 0;
  impl_->for_each_quantized([&](const std::string&, const QuantizedMatrix& q) { bytes += q.bytes(); });
  return bytes;
}

std::int64_t Transformer::quantized_values() const {
  std::int64_t values = 0;
  impl_->for_each_quantized([&](const std::string&, const QuantizedMatrix& q) { values += q.rows() * q.cols(); });
  return values;
}

std::vector<std::pair<std::string, torch::Tensor>> Transformer::named_trainable_parameters() {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  if (impl_->lora) {
    impl_->for_each_adapter([&](const std::string& name, const torch::Tensor& t, bool) { out.emplace_back(name, t); });
  } else {
    if (quantized_bytes() > 0)
      throw conflict("full fine-tuning needs dense weights: this model keeps its base quantized (train LoRA adapters, "
                     "or load the model dequantized)");
    impl_->for_each_base([&](const std::string& name, const torch::Tensor& t) { out.emplace_back(name, t); });
  }
  if (has_value_head()) {
    out.emplace_back("value_head.weight", impl_->value_head.weight);
    out.emplace_back("value_head.bias", impl_->value_head.bias);
  }
  return out;
}

void Transformer::enable_value_head(std::int64_t seed) {
  if (has_value_head()) throw conflict("enable_value_head: the model already has a value head");
  const std::int64_t H = impl_->cfg.hidden_size;
  // The head stays fp32 whatever the base dtype: it is tiny and its regression targets need the precision.
  auto f32 = impl_->options.dtype(torch::kFloat32);
  auto gen = at::detail::createCPUGenerator(static_cast<std::uint64_t>(seed) ^ 0x5eedULL);
  auto w = at::normal(0.0, 0.02, {1, H}, gen).to(f32.device());
  impl_->value_head.name = "value_head";
  impl_->value_head.short_name = "value_head";
  impl_->value_head.weight = register_parameter("value_head_weight", w, true);
  impl_->value_head.bias = register_parameter("value_head_bias", torch::zeros({1}, f32), true);
}

bool Transformer::has_value_head() const { return impl_->value_head.weight.defined(); }

torch::Tensor Transformer::values(const torch::Tensor& hidden) {
  if (!has_value_head()) throw invalid_argument("Transformer::values: the model has no value head");
  return impl_->value_head.apply(hidden.to(torch::kFloat32)).squeeze(-1);
}

}  // namespace rlloop::engine
