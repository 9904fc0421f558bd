#include "model/aten_ops.hpp"

#include <stdexcept>

#include "kernels/attention.hpp"
#include "kernels/decode_attention.hpp"
#include "kernels/fused_ops.hpp"
#include "model/tensor_parallel.hpp"

namespace rlloop::engine {

namespace {

// Rows q [R, nh, D] (fp32) of a decoding step attending over `step`'s paged blocks of layer `li` of `pool` (fp32 or
// bf16) in place: the CPU decoder's attention kernel (one definition of decode attention on the CPU). [R, nh * D].
torch::Tensor attend_paged_cpu(const torch::Tensor& rows, const KVBlockPool& pool, std::size_t li,
                               const DecodeSlots& step, std::int64_t nkv, double scale) {
  const std::int64_t R = rows.size(0), nh = rows.size(1), D = rows.size(2);
  torch::Tensor out = torch::empty({R, nh * D}, rows.options());
  const PagedRows paged{step.tables.data(), step.max_blocks, step.lengths.data(), R};
  const auto s = static_cast<float>(scale);
  if (pool.dtype() == torch::kFloat32)
    attend_paged(rows.data_ptr<float>(), pool.keys(li).data_ptr<float>(), pool.values(li).data_ptr<float>(), paged,
                 nh, nkv, D, s, out.data_ptr<float>());
  else
    attend_paged(rows.data_ptr<float>(), static_cast<const std::uint16_t*>(pool.keys(li).data_ptr()),
                 static_cast<const std::uint16_t*>(pool.values(li).data_ptr()), paged, nh, nkv, D, s,
                 out.data_ptr<float>());
  return out;
}

}  // namespace

AtenOps::Rows AtenOps::summed(const Rows& y) const { return w_.tensor_parallel ? w_.tensor_parallel->sum(y) : y; }

torch::Tensor AtenOps::norm_weight(LayerNormOf which) const {
  switch (which) {
    case LayerNormOf::input: return w_.norm_scale(layer_.input_norm);
    case LayerNormOf::post: return w_.norm_scale(layer_.post_norm);
    case LayerNormOf::q: return w_.norm_scale(layer_.q_norm);
    case LayerNormOf::k: return w_.norm_scale(layer_.k_norm);
    case LayerNormOf::attn_out: return w_.norm_scale(layer_.attn_out_norm);
    case LayerNormOf::mlp_out: return w_.norm_scale(layer_.mlp_out_norm);
  }
  throw std::logic_error("AtenOps::norm_weight: not a norm");
}

AtenOps::Rows AtenOps::norm(const Rows& x, LayerNormOf which) const {
  return rms_norm(x, norm_weight(which), cfg_.rms_norm_eps);
}

AtenOps::Rows AtenOps::head_norm(const Rows& x, LayerNormOf which) const {
  return rms_norm(heads(x), norm_weight(which), cfg_.rms_norm_eps);
}

AtenOps::Rows AtenOps::rope(const Rows& x) const { return engine::rope(heads(x), in_.cos, in_.sin); }

AtenOps::Rows AtenOps::swiglu(const Rows& gate, const Rows& up) const { return engine::swiglu(gate, up); }

// transformers' gelu_pytorch_tanh (Gemma's hidden_activation).
AtenOps::Rows AtenOps::geglu(const Rows& gate, const Rows& up) const { return torch::gelu(gate, "tanh") * up; }

AtenOps::Rows AtenOps::causal(const Rows& q, const Rows& keys, const Rows& values) const {
  const std::int64_t window = cfg_.attention_window(static_cast<std::int64_t>(li_));
  const torch::Tensor& sinks = layer_.sinks;
  const double softcap = cfg_.attn_logit_softcapping;
  if (sinks.defined() || window > 0 || softcap > 0)
    return windowed_attention(q, keys, values, in_.scale, sinks, window, softcap);
  return causal_attention(q, keys, values, in_.scale);
}

AtenOps::Rows AtenOps::attend(const Rows& q, const Rows& k, const Rows& v_rows) const {
  const torch::Tensor v = heads(v_rows).transpose(1, 2);  // [B, nkv, T, D], as rope lays out q and k
  const std::int64_t B = v.size(0), T = v.size(2), D = cfg_.head_dim, nkv = cfg_.num_key_value_heads;
  if (!in_.groups.empty()) return attend_groups(q, k, v);
  if (!in_.cache) return causal(q, k, v);
  const KVBlockPool& pool = in_.cache->pool();
  store_slots(pool.keys(li_), in_.slots, k.transpose(1, 2).reshape({B * T, nkv, D}));
  store_slots(pool.values(li_), in_.slots, v.transpose(1, 2).reshape({B * T, nkv, D}));
  // Nothing cached before: the new keys and values are all there is, at the model's dtype.
  if (in_.past == 0) return causal(q, k, v);
  // Read back from the pool, so no gradient reaches them: a forward with a cache is inference only.
  const std::int64_t S = in_.past + T;
  return causal(q, gather_positions(pool.keys(li_), in_.tables, S, q.scalar_type()),
                gather_positions(pool.values(li_), in_.tables, S, q.scalar_type()));
}

AtenOps::Rows AtenOps::attend_groups(const Rows& q, const Rows& k, const Rows& v) const {
  // q [1, nh, R, D], k and v [1, nkv, R, D]: row r is its sequence's new position. Every row's key and value go to
  // its slot, then every row attends over its own blocks: a fixed number of operators for any number of groups.
  const std::int64_t R = q.size(2), nh = q.size(1), D = q.size(3);
  const std::size_t li = li_;
  KVBlockPool& pool = *in_.pool;
  store_slots(pool.keys(li), in_.slots, k[0].transpose(0, 1));
  store_slots(pool.values(li), in_.slots, v[0].transpose(0, 1));
  const torch::ScalarType cache = pool.dtype();
  const std::int64_t window = cfg_.attention_window(static_cast<std::int64_t>(li));
  const torch::Tensor& sinks = layer_.sinks;
  const double softcap = cfg_.attn_logit_softcapping;
  if (q.device().is_cpu() && q.scalar_type() == torch::kFloat32 && !sinks.defined() && window == 0 && softcap == 0 &&
      (cache == torch::kFloat32 || cache == torch::kBFloat16))
    return attend_paged_cpu(q[0].transpose(0, 1).contiguous(), pool, li, *in_.step, k.size(1), in_.scale)
        .view({1, R, nh * D});
  // Elsewhere (CUDA, bf16, sinks, a window or a soft-cap): every row's blocks gathered (padded to the longest table)
  // and masked past its length (and before its window).
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
    return decode_attention(q_rows, keys, values, lengths, in_.scale, sinks, window, softcap)
        .view({q_rows.size(0), nh * D});
  };
  if (!in_.single_rows.defined())
    return one_token_rows(q[0].transpose(0, 1).unsqueeze(2), in_.tables, in_.lengths).view({1, R, nh * D});
  // A step with prompt chunks: its one-token rows as above, in one call over their own blocks (a chunk may have
  // made the tables longer); a chunk's rows as a prefill attends (causally over its sequence's blocks, so a chunk
  // never holds [rows, keys] per row).
  torch::Tensor out = torch::empty({1, R, nh * D}, q.options());
  if (in_.single_rows.numel() > 0) {
    const std::int64_t blocks = (in_.single_longest + kKVBlockTokens - 1) / kKVBlockTokens;
    const torch::Tensor& rows = in_.single_rows;
    out[0].index_copy_(0, rows,
                       one_token_rows(q[0].index_select(1, rows).transpose(0, 1).unsqueeze(2),
                                      in_.tables.index_select(0, rows).narrow(1, 0, blocks),
                                      in_.lengths.index_select(0, rows)));
  }
  for (const RowGroup& g : in_.groups) {
    if (!g.chunk) continue;
    const std::int64_t S = in_.step->lengths[g.row0 + g.rows - 1];
    const torch::Tensor table = in_.tables.narrow(0, g.row0, 1);
    out.narrow(1, g.row0, g.rows)
        .copy_(causal(q.narrow(2, g.row0, g.rows), gather_positions(pool.keys(li), table, S, q.scalar_type()),
                      gather_positions(pool.values(li), table, S, q.scalar_type())));
  }
  return out;
}

}  // namespace rlloop::engine
