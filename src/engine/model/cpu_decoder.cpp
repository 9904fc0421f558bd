#include "model/cpu_decoder.hpp"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <vector>

#include <rlloop/error.hpp>

#include "kernels/bf16.hpp"
#include "kernels/decode_attention.hpp"
#include "model/decoder_layer.hpp"
#include "kernels/fused_ops.hpp"
#include "kernels/small_gemm.hpp"

namespace rlloop::engine {
namespace {

const float* data(const torch::Tensor& t) { return t.data_ptr<float>(); }

// Which projection of which layer, or the unembedding: names the same LinearWeights in any model's weights, so each
// group of a step finds its own adapter.
struct Which {
  std::size_t layer;
  Projection projection;
  bool unembedding = false;
};
constexpr Which kUnembedding{0, Projection::q, true};
const LinearWeights& pick(const InferenceWeights& w, Which which) {
  return which.unembedding ? w.lm_head : w.layers[which.layer].projection(which.projection);
}

// Consecutive rows of a step from one group (one cache, one model's adapters).
struct Segment {
  const InferenceWeights* adapters;
  std::int64_t begin, count;  // rows of this range (decode_rows' r0 is row 0)
};

// One projection of a decoding step: y[rows, out] = x[rows, in] W^T + b (+ scale * (x A^T) B^T with each
// segment's adapter); with `accumulate` the result is added to y (residual connections). `rounded` (bf16 and int8
// precision: the decoder's snapshot of W) replaces W; a quantized W is read from its blocks whatever the
// precision, in integer products at int8 precision where its format has them; adapters and biases stay fp32.
struct StepProduct {
  Which which;
  const Bf16Weight* rounded;
  float* y;
  bool accumulate;
};

// Adapters are applied unmerged, so the step always sees the live adapter weights.
void add_adapter(const float* x, std::int64_t rows, const LinearWeights& w, float* y) {
  if (!w.lora_a.defined()) return;
  const std::int64_t out = w.out_features(), in = w.in_features(), rank = w.lora_a.size(0);
  std::vector<float> down(rows * rank), delta(rows * out);
  linear_rows(x, rows, data(w.lora_a), rank, in, down.data(), false);
  linear_rows(down.data(), rows, data(w.lora_b), out, rank, delta.data(), false);
  const auto scale = static_cast<float>(w.lora_scale);
  for (std::int64_t i = 0; i < rows * out; ++i) y[i] += scale * delta[i];
}

void add_bias(std::int64_t rows, const LinearWeights& w, float* y) {
  if (!w.bias.defined()) return;
  const std::int64_t out = w.out_features();
  const float* b = data(w.bias);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t i = 0; i < out; ++i) y[r * out + i] += b[i];
}

// The projections of one input (q/k/v, gate/up): their base products over every row in one parallel region,
// then each segment's adapters, then the bias (per row in that order, as when a group is stepped alone). The
// base products run in one parallel region per kind of weight (int8, quantized, bf16 snapshot, fp32).
void project_rows(const InferenceWeights& base, std::span<const Segment> segments, const float* x, std::int64_t rows,
                  bool int8, std::initializer_list<StepProduct> group) {
  const std::int64_t in = pick(base, group.begin()->which).in_features();
  std::vector<QuantizedMatrix::Product> integer, quantized;
  std::vector<Bf16Product> rounded;
  std::vector<RowProduct> dense;
  for (const StepProduct& p : group) {
    const LinearWeights& w = pick(base, p.which);
    if (w.quantized && int8 && w.quantized->int8_products())
      integer.push_back({w.quantized.get(), p.y, p.accumulate});
    else if (w.quantized)
      quantized.push_back({w.quantized.get(), p.y, p.accumulate});
    else if (p.rounded)
      rounded.push_back({p.rounded, p.y, p.accumulate});
    else
      dense.push_back({data(w.weight), w.weight.size(0), p.y, p.accumulate});
  }
  if (!integer.empty()) QuantizedMatrix::multiply_group_int8(Int8Rows::quantize(x, rows, in), integer);
  if (!quantized.empty()) QuantizedMatrix::multiply_group(x, rows, quantized);
  if (!rounded.empty()) Bf16Weight::multiply_group(x, rows, rounded);
  if (!dense.empty()) linear_rows_group(x, rows, in, dense);
  for (const StepProduct& p : group) {
    const std::int64_t out = pick(base, p.which).out_features();
    for (const Segment& s : segments)
      add_adapter(x + s.begin * in, s.count, pick(*s.adapters, p.which), p.y + s.begin * out);
    add_bias(rows, pick(base, p.which), p.y);
  }
}

// A KV cache row as stored: fp32 as is, bf16 rounded to nearest.
void store_row(const float* x, float* out, std::int64_t n) { std::copy_n(x, n, out); }
void store_row(const float* x, std::uint16_t* out, std::int64_t n) { to_bf16(x, out, n); }

// Stores the new keys and values (k, v: [A, kv heads, D]) of step rows [r0, r0 + A) at their slots of the pool, then
// attends every query head (q: [A, heads, D]) over each row's positions into attn [A, heads, D]. T is how the pool
// stores values: float, or bf16 bits.
template <class T>
void append_and_attend(const KVBlockPool& pool, std::size_t layer, const DecodeSlots& step, std::int64_t r0,
                       std::int64_t A, const float* k, const float* v, const float* q, std::int64_t nh, float scale,
                       float* attn) {
  const std::int64_t nkv = pool.kv_heads(), D = pool.head_dim(), row = nkv * D;
  T* keys = static_cast<T*>(pool.keys(layer).data_ptr());
  T* values = static_cast<T*>(pool.values(layer).data_ptr());
  for (std::int64_t r = 0; r < A; ++r) {
    const std::int64_t slot = step.slots[r0 + r];
    store_row(k + r * row, keys + slot * row, row);
    store_row(v + r * row, values + slot * row, row);
  }
  const PagedRows rows{step.tables.data() + r0 * step.max_blocks, step.max_blocks, step.lengths.data() + r0, A};
  attend_paged(q, static_cast<const T*>(keys), static_cast<const T*>(values), rows, nh, nkv, D, scale, attn);
}

void rms_norm_rows(const float* x, const torch::Tensor& weight, float* y, std::int64_t rows, std::int64_t width,
                   double eps) {
  for (std::int64_t r = 0; r < rows; ++r) rms_norm_row(x + r * width, data(weight), y + r * width, width, eps);
}

void rope_rows(float* x, std::int64_t rows, std::int64_t D, const float* cos, const float* sin) {
  for (std::int64_t r = 0; r < rows; ++r) rope_row(x + r * D, x + r * D, cos, sin, D);
}

}  // namespace

bool CpuDecoder::supports(Transformer& model) { return model.cpu_kernels_decode(); }

torch::ScalarType CpuDecoder::cache_dtype(DecodePrecision precision) {
  return precision == DecodePrecision::fp32 ? torch::kFloat32 : torch::kBFloat16;
}

namespace {

// The base weights a RoundedWeights snapshot rounds, in a fixed order: the dense ones (quantized matrices are
// read from their blocks at either precision).
template <class Visit>
void for_each_rounded_source(const InferenceWeights& w, Visit visit) {
  for (const LayerWeights& L : w.layers)
    for (const LinearWeights* p : {&L.q, &L.k, &L.v, &L.o, &L.gate, &L.up, &L.down})
      if (p->weight.defined()) visit(p->weight);
  if (w.lm_head.weight.defined()) visit(w.lm_head.weight);
}

}  // namespace

RoundedWeights::RoundedWeights(Transformer& model) {
  if (model.config().num_experts > 0)
    throw invalid_argument("RoundedWeights: the model has experts (it decodes through the model, not the CPU decoder)");
  const InferenceWeights w = model.inference_weights();
  auto round = [](const LinearWeights& lw) {
    return lw.quantized ? Bf16Weight() : Bf16Weight(data(lw.weight), lw.weight.size(0), lw.weight.size(1));
  };
  for (const LayerWeights& L : w.layers)
    layers_.push_back({round(L.q), round(L.k), round(L.v), round(L.o), round(L.gate), round(L.up), round(L.down)});
  lm_head_ = round(w.lm_head);
  for_each_rounded_source(w, [&](const torch::Tensor& t) { sources_.push_back({t, t._version()}); });
}

bool RoundedWeights::current(Transformer& model) const {
  std::size_t i = 0;
  bool same = true;
  for_each_rounded_source(model.inference_weights(), [&](const torch::Tensor& t) {
    same = same && i < sources_.size() && t.storage().is_alias_of(sources_[i].tensor.storage()) &&
           t.data_ptr() == sources_[i].tensor.data_ptr() && t._version() == sources_[i].version;
    ++i;
  });
  return same && i == sources_.size();
}

CpuDecoder::CpuDecoder(Transformer& model, DecodePrecision precision, std::shared_ptr<const RoundedWeights> rounded)
    : model_(model), cfg_(model.config()), precision_(precision), w_(model.inference_weights()) {
  if (!supports(model))
    throw invalid_argument("CpuDecoder: its kernels do not implement every layer of this model (they take dense fp32 "
                           "layers on the CPU without attention sinks or a window)");
  std::int64_t bytes = model.quantized_bytes();
  for (const auto& p : model.parameters()) bytes += p.numel() * static_cast<std::int64_t>(sizeof(float));
  weights_fit_in_cache_ = bytes <= (16 << 20);
  if (precision == DecodePrecision::fp32) return;
  if (rounded && !rounded->current(model)) rounded.reset();  // freed before the new one is made, not after
  rounded_ = rounded ? std::move(rounded) : std::make_shared<const RoundedWeights>(model);
}

torch::Tensor CpuDecoder::step(const torch::Tensor& tokens, KVCache& cache) {
  const Group group{&w_, &tokens, &cache};
  return step(std::span<const Group>(&group, 1));
}

bool CpuDecoder::shares_base(const CpuDecoder& other) const {
  return precision_ == other.precision_ && model_.shares_base(other.model_);
}

torch::Tensor CpuDecoder::step(std::span<const Group> groups) {
  const std::int64_t V = cfg_.vocab_size;
  const torch::ScalarType dtype = cache_dtype(precision_);
  std::vector<Row> rows;
  std::vector<KVCache*> caches;
  std::vector<std::int64_t> new_tokens;
  std::int64_t logit_rows = 0;
  bool chunks = false;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const torch::Tensor& tokens = *groups[g].tokens;
    KVCache& cache = *groups[g].cache;
    const std::int64_t A = tokens.size(0);
    if (tokens.dim() != 1 || !tokens.device().is_cpu() || tokens.scalar_type() != torch::kLong ||
        (A != cache.batch() && cache.batch() != 1))
      throw invalid_argument("CpuDecoder::step: tokens must be an int64 CPU vector with one token per cache row or a "
                             "chunk of a cache of batch 1");
    const bool chunk = A != cache.batch();
    if (cache.length + (chunk ? A : 1) > cache.capacity)
      throw invalid_argument("CpuDecoder::step: KV cache capacity " + std::to_string(cache.capacity) + " exceeded");
    if (!cache.fits(cfg_) || !cache.device().is_cpu())
      throw invalid_argument("CpuDecoder::step: the KV cache does not fit this model (layers, KV heads, head_dim) "
                             "or is not on the CPU");
    if (cache.dtype() != dtype)
      throw invalid_argument(std::string("CpuDecoder::step: the KV cache must hold ") +
                             (dtype == torch::kBFloat16 ? "bf16 (KVCache::convert)" : "fp32") +
                             " for this decoder's precision, not " + c10::toString(cache.dtype()));
    const auto* ids = tokens.data_ptr<std::int64_t>();
    for (std::int64_t r = 0; r < A; ++r) {
      if (ids[r] < 0 || ids[r] >= V)
        throw invalid_argument("CpuDecoder::step: token id " + std::to_string(ids[r]) + " is outside the vocabulary");
      const bool logits = groups[g].logits && (!chunk || r == A - 1);
      rows.push_back({g, ids[r], cache.length + (chunk ? r : 0), logits ? logit_rows++ : -1});
    }
    caches.push_back(&cache);
    new_tokens.push_back(A);
    chunks = chunks || chunk;
  }
  // Every row's slot for its new key and value and its block table, laid out in `rows`' order.
  const DecodeSlots step = prepare_decode_step(caches, new_tokens, "CpuDecoder::step");
  const auto A = static_cast<std::int64_t>(rows.size());
  auto logits = torch::empty({logit_rows, V}, torch::kFloat32);
  const int threads = at::get_num_threads();
  if (threads > 1 && A > 1 && weights_fit_in_cache_ && !chunks) {
    // Sequences are independent: split the rows across threads once per step (one parallel region), not every
    // operation; each thread reads all the weights, which is cheap only while they stay in the caches. (Not with a
    // chunk, whose rows read each other's keys within every layer.)
    at::parallel_for(0, A, (A + threads - 1) / threads, [&](std::int64_t begin, std::int64_t end) {
      decode_rows(rows, groups, step, begin, end, logits.data_ptr<float>());
    });
  } else if (A > 0) {
    decode_rows(rows, groups, step, 0, A, logits.data_ptr<float>());  // the operations split their own work
  }
  for (std::size_t i = 0; i < caches.size(); ++i) caches[i]->length += step.advance[i];
  return logits;
}

namespace {

// decoder_layer's operations over rows [r0, r0 + A) of a decoding step, in host buffers ([A, width] row-major):
// the few-row products (base weights once over every row, each segment's adapters over its own), RMSNorm, RoPE
// and SwiGLU row by row, and the paged attention kernel storing each row's key and value at its slot. Every
// activation has a buffer of its own that the operations write in place (Rows names one).
class CpuOps {
 public:
  struct Rows {
    float* data;
    std::int64_t width;
  };
  CpuOps(const ModelConfig& cfg, const InferenceWeights& w, const RoundedWeights* rounded, bool int8,
         std::span<const Segment> segments, std::span<const std::int64_t> positions, const DecodeSlots& step,
         const KVBlockPool& pool, std::int64_t r0, std::int64_t A)
      : cfg_(cfg), w_(w), rounded_(rounded), int8_(int8), segments_(segments), positions_(positions), step_(step),
        pool_(pool), r0_(r0), A_(A), nh_(cfg.num_attention_heads), nkv_(cfg.num_key_value_heads), D_(cfg.head_dim),
        scale_(static_cast<float>(cfg.attention_scale())),
        x_(A * cfg.hidden_size), h_(A * cfg.hidden_size), q_(A * nh_ * D_), k_(A * nkv_ * D_), v_(A * nkv_ * D_),
        attn_(A * nh_ * D_), gate_(A * cfg.intermediate_size), up_(A * cfg.intermediate_size) {}

  // The residual stream, and the layer the next operations apply.
  Rows residual() { return {x_.data(), cfg_.hidden_size}; }
  void at_layer(std::size_t li) { li_ = li; }
  Rows final_norm() {
    rms_norm_rows(x_.data(), w_.final_norm, h_.data(), A_, cfg_.hidden_size, cfg_.rms_norm_eps);
    return {h_.data(), cfg_.hidden_size};
  }

  bool qk_norm() const { return cfg_.qk_norm; }
  // CpuDecoder::supports: dense layers without Gemma's parts (ModelWeights::cpu_kernels_decode).
  bool sparse() const { return false; }
  bool sandwich_norms() const { return false; }
  ModelConfig::Activation activation() const { return ModelConfig::Activation::silu; }
  Rows norm(const Rows& x, LayerNormOf which) {
    rms_norm_rows(x.data, norm_weight(which), h_.data(), A_, x.width, cfg_.rms_norm_eps);
    return {h_.data(), x.width};
  }
  Rows head_norm(const Rows& x, LayerNormOf which) {
    rms_norm_rows(x.data, norm_weight(which), x.data, A_ * (x.width / D_), D_, cfg_.rms_norm_eps);
    return x;
  }
  template <class... P>
  std::array<Rows, sizeof...(P)> project(const Rows& h, P... p) {
    run(h, {product(p, buffer(p), false)...});
    return {Rows{buffer(p), w_.layers[li_].projection(p).out_features()}...};
  }
  Rows rope(const Rows& x) {
    const std::int64_t heads = x.width / D_;
    for (std::int64_t r = 0; r < A_; ++r)  // each row at its own position
      rope_rows(x.data + r * x.width, heads, D_, data(w_.rope_cos) + positions_[r] * D_,
                data(w_.rope_sin) + positions_[r] * D_);
    return x;
  }
  Rows attend(const Rows& q, const Rows& k, const Rows& v) {
    // Every row of the range at once, each over its own blocks: one parallel region per layer for any number of
    // groups.
    const auto attend_rows = pool_.dtype() == torch::kBFloat16 ? append_and_attend<std::uint16_t>
                                                                : append_and_attend<float>;
    attend_rows(pool_, li_, step_, r0_, A_, k.data, v.data, q.data, nh_, scale_, attn_.data());
    return {attn_.data(), nh_ * D_};
  }
  Rows add_projection(const Rows& x, Projection p, const Rows& h) {
    run(h, {product(p, x.data, true)});
    return x;
  }
  Rows swiglu(const Rows& gate, const Rows& up) {
    // Row by row, so that no value's result depends on how the rows were split between threads (the tail of a row
    // that is not a multiple of 8 takes the scalar path). Vectorised: tens of microseconds at 16 x 2048.
    for (std::int64_t r = 0; r < A_; ++r)
      swiglu_in_place(gate.data + r * gate.width, up.data + r * up.width, gate.width);
    return gate;
  }
  Rows add_experts(const Rows&, const Rows&) { throw std::logic_error("CpuOps: a sparse layer (supports() is false)"); }
  Rows add_normed_projection(const Rows&, Projection, const Rows&, LayerNormOf) {
    throw std::logic_error("CpuOps: sandwich norms (supports() is false)");
  }
  Rows geglu(const Rows&, const Rows&) { throw std::logic_error("CpuOps: GeGLU (supports() is false)"); }

  // The unembedding of the final norm's rows that `keep` marks into consecutive rows of `logits` [., vocab].
  void unembed(const Rows& h, const std::vector<bool>& keep, float* logits) const {
    const StepProduct head{kUnembedding, rounded_ ? &rounded_->lm_head() : nullptr, logits, false};
    if (std::find(keep.begin(), keep.end(), false) == keep.end()) {
      run(h, {head});
      return;
    }
    // Some rows are a prompt chunk's that predict tokens the prompt already has: only the others, gathered.
    std::vector<float> kept;
    std::vector<Segment> segments;
    for (const Segment& s : segments_) {
      Segment own{s.adapters, static_cast<std::int64_t>(kept.size()) / h.width, 0};
      for (std::int64_t r = s.begin; r < s.begin + s.count; ++r)
        if (keep[r]) kept.insert(kept.end(), h.data + r * h.width, h.data + (r + 1) * h.width);
      own.count = static_cast<std::int64_t>(kept.size()) / h.width - own.begin;
      if (own.count > 0) segments.push_back(own);
    }
    if (!kept.empty())
      project_rows(w_, segments, kept.data(), static_cast<std::int64_t>(kept.size()) / h.width, int8_, {head});
  }

 private:
  const torch::Tensor& norm_weight(LayerNormOf which) const {
    const LayerWeights& L = w_.layers[li_];
    switch (which) {
      case LayerNormOf::input: return L.input_norm;
      case LayerNormOf::post: return L.post_norm;
      case LayerNormOf::q: return L.q_norm;
      case LayerNormOf::k: return L.k_norm;
      case LayerNormOf::attn_out:
      case LayerNormOf::mlp_out: break;
    }
    throw std::logic_error("CpuOps: sandwich norms (supports() is false)");
  }
  // The buffer each projection of project() writes.
  float* buffer(Projection p) {
    switch (p) {
      case Projection::q: return q_.data();
      case Projection::k: return k_.data();
      case Projection::v: return v_.data();
      case Projection::gate: return gate_.data();
      case Projection::up: return up_.data();
      case Projection::o:
      case Projection::down: break;
    }
    throw std::logic_error("CpuOps::project: o and down add to the residual (add_projection)");
  }
  StepProduct product(Projection p, float* y, bool accumulate) const {
    return {{li_, p}, rounded_ ? &rounded_->layers()[li_].projection(p) : nullptr, y, accumulate};
  }
  void run(const Rows& h, std::initializer_list<StepProduct> group) const {
    project_rows(w_, segments_, h.data, A_, int8_, group);
  }

  const ModelConfig& cfg_;
  const InferenceWeights& w_;
  const RoundedWeights* rounded_;
  bool int8_;
  std::span<const Segment> segments_;
  std::span<const std::int64_t> positions_;  // each row's
  const DecodeSlots& step_;
  const KVBlockPool& pool_;
  std::int64_t r0_, A_, nh_, nkv_, D_;
  float scale_;
  std::size_t li_ = 0;
  std::vector<float> x_, h_, q_, k_, v_, attn_, gate_, up_;
};
// The CPU backend runs the one layer recipe (decoder_layer.hpp): a missing or mistyped operation fails here.
static_assert(DecoderOps<CpuOps>);

}  // namespace

void CpuDecoder::decode_rows(std::span<const Row> rows, std::span<const Group> groups, const DecodeSlots& step,
                             std::int64_t r0, std::int64_t r1, float* logits) const {
  const std::int64_t A = r1 - r0, H = cfg_.hidden_size;
  std::vector<Segment> segments;
  std::vector<std::int64_t> positions;
  std::vector<bool> keep;
  std::int64_t first_logits = -1;
  for (std::int64_t r = r0; r < r1; ++r) {
    const Row& row = rows[r];
    if (segments.empty() || rows[r - 1].group != row.group)
      segments.push_back({groups[row.group].adapters, r - r0, 0});
    ++segments.back().count;
    positions.push_back(row.pos);
    keep.push_back(row.logits >= 0);
    if (first_logits < 0) first_logits = row.logits;
  }
  const KVBlockPool& pool = groups[rows[r0].group].cache->pool();  // every group's (prepare_decode_step)
  CpuOps ops(cfg_, w_, rounded_.get(), precision_ == DecodePrecision::int8, segments, positions, step, pool, r0, A);
  CpuOps::Rows x = ops.residual();
  for (std::int64_t r = 0; r < A; ++r) {
    const std::int64_t id = rows[r0 + r].id;
    if (w_.quantized_embed)
      w_.quantized_embed->dequantize_rows(id, id + 1, x.data + r * H);
    else
      std::copy_n(data(w_.embed) + id * H, H, x.data + r * H);
  }
  for (std::size_t li = 0; li < w_.layers.size(); ++li) {
    ops.at_layer(li);
    x = decoder_layer(ops, x);
  }
  if (first_logits >= 0) ops.unembed(ops.final_norm(), keep, logits + first_logits * cfg_.vocab_size);
}

}  // namespace rlloop::engine
