#include "cpu_decoder.hpp"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <vector>

#include <rlloop/error.hpp>

#include "bf16.hpp"
#include "decode_attention.hpp"
#include "fused_ops.hpp"
#include "small_gemm.hpp"

namespace rlloop::engine {
namespace {

const float* data(const torch::Tensor& t) { return t.data_ptr<float>(); }

// Which projection of a layer (member of LayerWeights), or the unembedding (member null): names the same
// LinearWeights in any model's weights, so each group of a step finds its own adapter.
struct Which {
  std::size_t layer;
  LinearWeights LayerWeights::*member;
};
const LinearWeights& pick(const InferenceWeights& w, Which which) {
  return which.member ? w.layers[which.layer].*which.member : w.lm_head;
}

// Consecutive rows of a step from one group (one cache, one position, one model's adapters).
struct Segment {
  const InferenceWeights* adapters;
  std::int64_t begin, count;  // rows of this range (decode_rows' r0 is row 0)
  std::int64_t pos;
};

// One projection of a decoding step: y[rows, out] = x[rows, in] W^T + b (+ scale * (x A^T) B^T with each
// segment's adapter); with `accumulate` the result is added to y (residual connections). `rounded` (bf16 and int8
// precision: the decoder's snapshot of W) replaces W; a quantized W is read from its blocks whatever the
// precision, in integer products at int8 precision where its format has them; adapters and biases stay fp32.
struct Projection {
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
void project(const InferenceWeights& base, std::span<const Segment> segments, const float* x, std::int64_t rows,
             bool int8, std::initializer_list<Projection> group) {
  const std::int64_t in = pick(base, group.begin()->which).in_features();
  std::vector<QuantizedMatrix::Product> integer, quantized;
  std::vector<Bf16Product> rounded;
  std::vector<RowProduct> dense;
  for (const Projection& p : group) {
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
  for (const Projection& p : group) {
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

bool CpuDecoder::supports(Transformer& model) {
  if (model.config().num_experts > 0) return false;  // its layer is the dense one; experts decode through the model
  for (const auto& p : model.parameters())  // base weights and adapters alike
    if (!p.device().is_cpu() || p.scalar_type() != torch::kFloat32) return false;
  return true;
}

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
    : cfg_(model.config()), precision_(precision), w_(model.inference_weights()) {
  if (!supports(model)) throw invalid_argument("CpuDecoder: the model is not a dense fp32 model on the CPU");
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
  if (precision_ != other.precision_) return false;
  auto same = [](const torch::Tensor& a, const torch::Tensor& b) {
    return a.defined() == b.defined() && (!a.defined() || a.data_ptr() == b.data_ptr());
  };
  const InferenceWeights &a = w_, &b = other.w_;
  if (a.layers.size() != b.layers.size() || !same(a.embed, b.embed) || a.quantized_embed != b.quantized_embed ||
      !same(a.final_norm, b.final_norm) || !same(a.lm_head.weight, b.lm_head.weight) ||
      a.lm_head.quantized != b.lm_head.quantized || !same(a.lm_head.bias, b.lm_head.bias))
    return false;
  for (std::size_t l = 0; l < a.layers.size(); ++l) {
    const LayerWeights &x = a.layers[l], &y = b.layers[l];
    if (!same(x.input_norm, y.input_norm) || !same(x.post_norm, y.post_norm) || !same(x.q_norm, y.q_norm) ||
        !same(x.k_norm, y.k_norm))
      return false;
    for (auto m : {&LayerWeights::q, &LayerWeights::k, &LayerWeights::v, &LayerWeights::o, &LayerWeights::gate,
                   &LayerWeights::up, &LayerWeights::down})
      if (!same((x.*m).weight, (y.*m).weight) || (x.*m).quantized != (y.*m).quantized ||
          !same((x.*m).bias, (y.*m).bias))
        return false;
  }
  return true;
}

torch::Tensor CpuDecoder::step(std::span<const Group> groups) {
  const std::int64_t V = cfg_.vocab_size;
  const torch::ScalarType dtype = cache_dtype(precision_);
  std::vector<Row> rows;
  std::vector<KVCache*> caches;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const torch::Tensor& tokens = *groups[g].tokens;
    KVCache& cache = *groups[g].cache;
    const std::int64_t A = tokens.size(0);
    if (tokens.dim() != 1 || !tokens.device().is_cpu() || tokens.scalar_type() != torch::kLong || A != cache.batch())
      throw invalid_argument("CpuDecoder::step: tokens must be an int64 CPU vector with one token per cache row");
    if (cache.length + 1 > cache.capacity)
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
      rows.push_back({g, ids[r], cache.length});
    }
    caches.push_back(&cache);
  }
  // Every row's slot for its new key and value and its block table, laid out in `rows`' order.
  const DecodeSlots step = prepare_decode_step(caches, "CpuDecoder::step");
  const auto A = static_cast<std::int64_t>(rows.size());
  auto logits = torch::empty({A, V}, torch::kFloat32);
  const int threads = at::get_num_threads();
  if (threads > 1 && A > 1 && weights_fit_in_cache_) {
    // Sequences are independent: split the rows across threads once per step (one parallel region), not every
    // operation; each thread reads all the weights, which is cheap only while they stay in the caches.
    at::parallel_for(0, A, (A + threads - 1) / threads, [&](std::int64_t begin, std::int64_t end) {
      decode_rows(rows, groups, step, begin, end, logits.data_ptr<float>());
    });
  } else if (A > 0) {
    decode_rows(rows, groups, step, 0, A, logits.data_ptr<float>());  // the operations split their own work
  }
  for (KVCache* cache : caches) cache->length += 1;
  return logits;
}

void CpuDecoder::decode_rows(std::span<const Row> rows, std::span<const Group> groups, const DecodeSlots& step,
                             std::int64_t r0, std::int64_t r1, float* logits) const {
  const std::int64_t A = r1 - r0, H = cfg_.hidden_size, D = cfg_.head_dim, I = cfg_.intermediate_size;
  const std::int64_t nh = cfg_.num_attention_heads, nkv = cfg_.num_key_value_heads;
  const double eps = cfg_.rms_norm_eps;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));

  std::vector<Segment> segments;
  for (std::int64_t r = r0; r < r1; ++r) {
    const Row& row = rows[r];
    if (segments.empty() || rows[r - 1].group != row.group)
      segments.push_back({groups[row.group].adapters, r - r0, 0, row.pos});
    ++segments.back().count;
  }

  std::vector<float> x(A * H), h(A * H), q(A * nh * D), k(A * nkv * D), v(A * nkv * D), attn(A * nh * D), gate(A * I),
      up(A * I);
  for (std::int64_t r = 0; r < A; ++r) {
    const std::int64_t id = rows[r0 + r].id;
    if (w_.quantized_embed)
      w_.quantized_embed->dequantize_rows(id, id + 1, x.data() + r * H);
    else
      std::copy_n(data(w_.embed) + id * H, H, x.data() + r * H);
  }

  const bool bf16 = precision_ != DecodePrecision::fp32, int8 = precision_ == DecodePrecision::int8;
  const KVBlockPool* pool = &groups[rows[r0].group].cache->pool();  // every group's (prepare_decode_step)
  for (std::size_t li = 0; li < w_.layers.size(); ++li) {
    const LayerWeights& L = w_.layers[li];
    const RoundedWeights::Layer* R = bf16 ? &rounded_->layers()[li] : nullptr;
    rms_norm_rows(x.data(), L.input_norm, h.data(), A, H, eps);
    project(w_, segments, h.data(), A, int8,
            {{{li, &LayerWeights::q}, R ? &R->q : nullptr, q.data(), false},
             {{li, &LayerWeights::k}, R ? &R->k : nullptr, k.data(), false},
             {{li, &LayerWeights::v}, R ? &R->v : nullptr, v.data(), false}});
    if (cfg_.qk_norm) {
      rms_norm_rows(q.data(), L.q_norm, q.data(), A * nh, D, eps);
      rms_norm_rows(k.data(), L.k_norm, k.data(), A * nkv, D, eps);
    }
    for (const Segment& s : segments) {  // RoPE at each group's own position
      const float* cos = data(w_.rope_cos) + s.pos * D;
      const float* sin = data(w_.rope_sin) + s.pos * D;
      rope_rows(q.data() + s.begin * nh * D, s.count * nh, D, cos, sin);
      rope_rows(k.data() + s.begin * nkv * D, s.count * nkv, D, cos, sin);
    }
    // Attention of every row of the range at once, each over its own blocks: one parallel region per layer for any
    // number of groups.
    const auto attend = bf16 ? append_and_attend<std::uint16_t> : append_and_attend<float>;
    attend(*pool, li, step, r0, A, k.data(), v.data(), q.data(), nh, scale, attn.data());
    project(w_, segments, attn.data(), A, int8, {{{li, &LayerWeights::o}, R ? &R->o : nullptr, x.data(), true}});

    rms_norm_rows(x.data(), L.post_norm, h.data(), A, H, eps);
    project(w_, segments, h.data(), A, int8,
            {{{li, &LayerWeights::gate}, R ? &R->gate : nullptr, gate.data(), false},
             {{li, &LayerWeights::up}, R ? &R->up : nullptr, up.data(), false}});
    // Row by row, so that no value's result depends on how the rows were split between threads (the tail of
    // a row that is not a multiple of 8 takes the scalar path). Vectorised: tens of microseconds at 16 x 2048.
    for (std::int64_t r = 0; r < A; ++r) swiglu_in_place(gate.data() + r * I, up.data() + r * I, I);
    project(w_, segments, gate.data(), A, int8, {{{li, &LayerWeights::down}, R ? &R->down : nullptr, x.data(), true}});
  }
  rms_norm_rows(x.data(), w_.final_norm, h.data(), A, H, eps);
  project(w_, segments, h.data(), A, int8,
          {{{0, nullptr}, bf16 ? &rounded_->lm_head() : nullptr, logits + r0 * cfg_.vocab_size, false}});
}

}  // namespace rlloop::engine
