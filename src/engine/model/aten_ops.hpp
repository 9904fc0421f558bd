// decoder_layer's operations over ATen tensors ([B, T, width]): every device and dtype, autograd, the caches of a
// prefill and the row groups of a decoding step (step_context.hpp), sparse layers (experts_layer.hpp). Training,
// scoring, prefill and the ATen decoding step run the layer recipe through it; the CPU's fp32 decoding step runs
// the same recipe through CpuOps (cpu_decoder.cpp).
#pragma once
#include <array>
#include <cstddef>

#include <torch/torch.h>

#include "model/decoder_layer.hpp"
#include "model/experts_layer.hpp"
#include "model/model_weights.hpp"
#include "model/step_context.hpp"

namespace rlloop::engine {

class AtenOps {
 public:
  using Rows = torch::Tensor;
  AtenOps(const ModelWeights& w, const ExpertsLayer& experts, std::size_t li, const StepContext& in)
      : w_(w), experts_(experts), cfg_(w.cfg), layer_(w.layers[li]), li_(li), in_(in) {}

  bool qk_norm() const { return cfg_.qk_norm; }
  bool sparse() const { return layer_.sparse(); }
  bool sandwich_norms() const { return cfg_.sandwich_norms; }
  ModelConfig::Activation activation() const { return cfg_.hidden_activation; }
  Rows norm(const Rows& x, LayerNormOf which) const;
  Rows head_norm(const Rows& x, LayerNormOf which) const;  // [B, T, heads, D]
  template <class... P>
  std::array<Rows, sizeof...(P)> project(const Rows& h, P... p) const {
    return {one_projection(p, h)...};
  }
  Rows rope(const Rows& x) const;                                  // [B, heads, T, D]
  Rows attend(const Rows& q, const Rows& k, const Rows& v) const;  // q, k as rope returns them; [B, T, nh * D]
  Rows add_projection(const Rows& x, Projection p, const Rows& h) const { return x + summed(one_projection(p, h)); }
  Rows add_normed_projection(const Rows& x, Projection p, const Rows& h, LayerNormOf which) const {
    return x + norm(summed(one_projection(p, h)), which);
  }
  Rows swiglu(const Rows& gate, const Rows& up) const;
  Rows geglu(const Rows& gate, const Rows& up) const;
  Rows add_experts(const Rows& x, const Rows& h) const {
    return x + summed(experts_.forward(w_, li_, h, in_).view(x.sizes()));
  }

 private:
  // [B, T, heads * D] (or already [B, T, heads, D]) -> [B, T, heads, D].
  // (The head count is explicit: an expert-parallel rank's idle forward has B = 0, which a -1 cannot size.)
  Rows heads(const Rows& x) const {
    return x.dim() == 4 ? x : x.view({x.size(0), x.size(1), x.size(2) / cfg_.head_dim, cfg_.head_dim});
  }
  // The layer's own projection or, in a step of row groups, the base's over every row and each group's adapter.
  Rows one_projection(Projection p, const Rows& h) const {
    return engine::project(layer_.projection(p), h, in_,
                           [&](const RowGroup& g) -> const Linear& { return g.weights->layers[li_].projection(p); });
  }
  // A residual branch's output: on a tensor-parallel rank (tensor_parallel.hpp) its part of the row-parallel sum
  // (o, down, the experts), summed over the ranks; the output itself otherwise.
  Rows summed(const Rows& y) const;
  // The weight a norm scales by (with the one added where the family's norms add it).
  torch::Tensor norm_weight(LayerNormOf which) const;
  // The layer's causal attention: with its sinks, window and soft-cap where the family has them (windowed_attention).
  Rows causal(const Rows& q, const Rows& keys, const Rows& values) const;
  // The attention of a step of several groups (StepContext::groups): each group's rows extend and read its cache.
  Rows attend_groups(const Rows& q, const Rows& k, const Rows& v) const;

  const ModelWeights& w_;
  const ExpertsLayer& experts_;
  const ModelConfig& cfg_;
  const Layer& layer_;
  std::size_t li_;
  const StepContext& in_;
};
static_assert(DecoderOps<AtenOps>);

// Layer `li` of `w` over x [B, T, H]: attention (extending in.cache when given), then the MLP, each with its residual.
inline torch::Tensor aten_decoder_layer(const ModelWeights& w, const ExpertsLayer& experts, std::size_t li,
                                        torch::Tensor x, const StepContext& in) {
  AtenOps ops(w, experts, li, in);
  return decoder_layer(ops, std::move(x));
}

}  // namespace rlloop::engine
