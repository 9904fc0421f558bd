// The one definition of a decoder layer: what it computes and in which order, over the operations of a backend.
// Training, scoring, prefill and the ATen decoding step run it over ATen tensors (transformer.cpp: any device and
// dtype, autograd, sparse layers); the CPU's fp32 decoding step runs it over rows in host buffers with its fused
// kernels and few-row products (cpu_decoder.cpp). A backend supplies the operations; it never restates the layer,
// so a change to the architecture is made here once and reaches both.
#pragma once
#include <array>
#include <concepts>

#include "model/model_config.hpp"
#include "model/model_family.hpp"

namespace rlloop::engine {

// The layer's RMSNorm weights: before attention, before the MLP, the per-head ones of q and k (qk_norm), and the
// sandwich norms of attention's and the MLP's outputs (sandwich_norms).
enum class LayerNormOf { input, post, q, k, attn_out, mlp_out };

// What a backend provides (DecoderOps), `Ops::Rows` being its activations (one row per token, a width per tensor):
//   qk_norm(), sparse(),               the layer's parts (q/k norms; experts in place of the MLP; a norm on each
//   sandwich_norms(), activation()     sublayer's output; the MLP's gated activation)
//   norm(x, LayerNormOf)               RMSNorm of every row (input / post)
//   head_norm(x, LayerNormOf)          RMSNorm of every head of every row (q / k)
//   project(h, Projection... p)        several projections of one input (std::array of Rows, one per p), each with
//                                      its bias and its rows' adapters
//   rope(x)                            RoPE at each row's position
//   attend(q, k, v)                    causal attention over the row's sequence (its cache, when there is one,
//                                      which receives k and v)
//   add_projection(x, p, h)            x + the projection of h (the residual connections)
//   add_normed_projection(x, p, h, n)  x + RMSNorm n of the projection of h (sandwich norms' residual connections)
//   swiglu(gate, up)                   silu(gate) * up
//   geglu(gate, up)                    gelu_tanh(gate) * up
//   add_experts(x, h)                  x + the routed experts over h (sparse layers)
// A backend may write a result over an operation's input (its Rows naming buffers) except norm's, which the layer
// reads again for the residual connection. Each backend states that it is one (static_assert(DecoderOps<...>)
// beside it: AtenOps in aten_ops.hpp, CpuOps in cpu_decoder.cpp), so a missing or mistyped operation is an error
// there and a new part of the recipe (another norm, activation or attention option) is added here and to both.
template <class Ops>
concept DecoderOps = requires(Ops& ops, const typename Ops::Rows& x, LayerNormOf n, Projection p) {
  { ops.qk_norm() } -> std::convertible_to<bool>;
  { ops.sparse() } -> std::convertible_to<bool>;
  { ops.sandwich_norms() } -> std::convertible_to<bool>;
  { ops.activation() } -> std::same_as<ModelConfig::Activation>;
  { ops.norm(x, n) } -> std::same_as<typename Ops::Rows>;
  { ops.head_norm(x, n) } -> std::same_as<typename Ops::Rows>;
  { ops.project(x, p, p, p) } -> std::same_as<std::array<typename Ops::Rows, 3>>;
  { ops.project(x, p, p) } -> std::same_as<std::array<typename Ops::Rows, 2>>;
  { ops.rope(x) } -> std::same_as<typename Ops::Rows>;
  { ops.attend(x, x, x) } -> std::same_as<typename Ops::Rows>;
  { ops.add_projection(x, p, x) } -> std::same_as<typename Ops::Rows>;
  { ops.add_normed_projection(x, p, x, n) } -> std::same_as<typename Ops::Rows>;
  { ops.swiglu(x, x) } -> std::same_as<typename Ops::Rows>;
  { ops.geglu(x, x) } -> std::same_as<typename Ops::Rows>;
  { ops.add_experts(x, x) } -> std::same_as<typename Ops::Rows>;
};

template <DecoderOps Ops>
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
  const bool sandwich = ops.sandwich_norms();  // Gemma 2
  const Rows attention = ops.attend(q, k, v);
  x = sandwich ? ops.add_normed_projection(x, Projection::o, attention, LayerNormOf::attn_out)
               : ops.add_projection(x, Projection::o, attention);

  h = ops.norm(x, LayerNormOf::post);
  if (ops.sparse()) return ops.add_experts(x, h);  // (sandwich norms around experts: refused by ModelConfig)
  auto [gate, up] = ops.project(h, Projection::gate, Projection::up);
  const Rows act = ops.activation() == ModelConfig::Activation::gelu_tanh ? ops.geglu(gate, up) : ops.swiglu(gate, up);
  return sandwich ? ops.add_normed_projection(x, Projection::down, act, LayerNormOf::mlp_out)
                  : ops.add_projection(x, Projection::down, act);
}

}  // namespace rlloop::engine
