// The one definition of a decoder layer: what it computes and in which order, over the operations of a backend.
// Training, scoring, prefill and the ATen decoding step run it over ATen tensors (transformer.cpp: any device and
// dtype, autograd, sparse layers); the CPU's fp32 decoding step runs it over rows in host buffers with its fused
// kernels and few-row products (cpu_decoder.cpp). A backend supplies the operations; it never restates the layer,
// so a change to the architecture is made here once and reaches both.
#pragma once
#include <array>

#include "model/model_family.hpp"

namespace rlloop::engine {

// The layer's RMSNorm weights: before attention, before the MLP, and the per-head ones of q and k (qk_norm).
enum class LayerNormOf { input, post, q, k };

// What a backend provides, `Ops::Rows` being its activations (one row per token, a width per tensor):
//   bool qk_norm(), bool sparse()                      the layer's flags (q/k norms; experts in place of the MLP)
//   Rows norm(const Rows& x, LayerNormOf)              RMSNorm of every row (input / post)
//   Rows head_norm(const Rows& x, LayerNormOf)         RMSNorm of every head of every row (q / k)
//   std::array<Rows, N> project(const Rows& h, Projection... p)
//                                                      several projections of one input, each with its bias and
//                                                      its rows' adapters
//   Rows rope(const Rows& x)                           RoPE at each row's position
//   Rows attend(const Rows& q, const Rows& k, const Rows& v)
//                                                      causal attention over the row's sequence (its cache, when
//                                                      there is one, which receives k and v)
//   Rows add_projection(const Rows& x, Projection p, const Rows& h)
//                                                      x + the projection of h (the residual connections)
//   Rows swiglu(const Rows& gate, const Rows& up)      silu(gate) * up
//   Rows add_experts(const Rows& x, const Rows& h)     x + the routed experts over h (sparse layers)
// A backend may write a result over an operation's input (its Rows naming buffers) except norm's, which the layer
// reads again for the residual connection.
template <class Ops>
typename Ops::Rows decoder_layer(Ops& ops, typename Ops::Rows x) {
  using Rows = typename Ops::Rows;
  Rows h = ops.norm(x, LayerNormOf::input);
  auto [q, k, v] = ops.project(h, Projection::q, Projection::k, Projection::v);
  if (ops.qk_norm()) {  // Qwen3: per-head RMSNorm over head_dim, before RoPE
    q = ops.head_norm(q, LayerNormOf::q);
    k = ops.head_norm(k, LayerNormOf::k);
  }
  q = ops.rope(q);
  k = ops.rope(k);
  x = ops.add_projection(x, Projection::o, ops.attend(q, k, v));

  h = ops.norm(x, LayerNormOf::post);
  if (ops.sparse()) return ops.add_experts(x, h);
  auto [gate, up] = ops.project(h, Projection::gate, Projection::up);
  return ops.add_projection(x, Projection::down, ops.swiglu(gate, up));
}

}  // namespace rlloop::engine
