#include "kernels/attention.hpp"

#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

#include <rlloop/error.hpp>

#include "kernels/blas.hpp"

namespace rlloop::engine {
namespace {

using blas::gemm;

struct Dims {
  std::int64_t B, nh, nkv, rep, T, S, D, past;
};

Dims dims_of(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values) {
  auto fail = [](const std::string& what) { throw invalid_argument("causal_attention: " + what); };
  if (q.dim() != 4 || keys.dim() != 4 || values.dim() != 4) fail("q, keys and values must be 4-D [B, heads, T, D]");
  Dims d{q.size(0), q.size(1), keys.size(1), 0, q.size(2), keys.size(2), q.size(3), 0};
  if (keys.sizes() != values.sizes()) fail("keys and values differ in shape");
  if (keys.size(0) != d.B || keys.size(3) != d.D) fail("keys do not match q's batch or head_dim");
  if (d.nkv == 0 || d.nh % d.nkv != 0) fail("the number of query heads is not a multiple of the KV heads");
  if (d.S < d.T) fail("fewer keys than queries");
  d.rep = d.nh / d.nkv;
  d.past = d.S - d.T;
  return d;
}

// Rows of keys/values may be strided (KV-cache views, transposed projections) but each row must be contiguous
// and rows must not overlap (BLAS needs a leading dimension >= D).
torch::Tensor rows_contiguous(const torch::Tensor& t) {
  const bool ok = t.stride(3) == 1 && (t.size(2) == 1 || t.stride(2) >= t.size(3));
  return ok ? t : t.contiguous();
}

// Leading dimension of the [S, D] rows of one head; a single row may carry any stride, BLAS wants >= D.
std::int64_t row_stride(const torch::Tensor& t) { return t.size(2) == 1 ? t.size(3) : t.stride(2); }

template <class T>
const T* head_ptr(const torch::Tensor& t, std::int64_t b, std::int64_t h) {
  return t.data_ptr<T>() + b * t.stride(0) + h * t.stride(1);
}

// In place over scores [T, S] (already scaled): causal softmax per row; stores each row's log-sum-exp.
template <class T>
void causal_softmax(T* scores, T* lse, const Dims& d) {
  for (std::int64_t i = 0; i < d.T; ++i) {
    T* row = scores + i * d.S;
    const std::int64_t visible = d.past + i + 1;
    T mx = -std::numeric_limits<T>::infinity();
    for (std::int64_t j = 0; j < visible; ++j) mx = std::max(mx, row[j]);
    T sum = 0;
    for (std::int64_t j = 0; j < visible; ++j) sum += (row[j] = std::exp(row[j] - mx));
    const T inv = T(1) / sum;
    for (std::int64_t j = 0; j < visible; ++j) row[j] *= inv;
    for (std::int64_t j = visible; j < d.S; ++j) row[j] = 0;
    lse[i] = mx + std::log(sum);
  }
}

// Recomputes the probabilities of one head from its log-sum-exp: scores [T, S] -> P in place.
template <class T>
void probabilities_from_lse(T* scores, const T* lse, const Dims& d) {
  for (std::int64_t i = 0; i < d.T; ++i) {
    T* row = scores + i * d.S;
    const std::int64_t visible = d.past + i + 1;
    for (std::int64_t j = 0; j < visible; ++j) row[j] = std::exp(row[j] - lse[i]);
    for (std::int64_t j = visible; j < d.S; ++j) row[j] = 0;
  }
}

// Work items are small (one head of one sequence); group enough of them per thread to amortise the fork.
std::int64_t grain(const Dims& d) { return std::max<std::int64_t>(1, 4096 / std::max<std::int64_t>(1, d.T * d.S)); }

// out [B, T, nh, D] and lse [B, nh, T].
template <class T>
void forward_kernel(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, double scale, const Dims& d,
                    torch::Tensor& out, torch::Tensor& lse) {
  at::parallel_for(0, d.B * d.nh, grain(d), [&](std::int64_t begin, std::int64_t end) {
    std::vector<T> scores(static_cast<std::size_t>(d.T * d.S));
    for (std::int64_t item = begin; item < end; ++item) {
      const std::int64_t b = item / d.nh, h = item % d.nh, g = h / d.rep;
      const T* qp = head_ptr<T>(q, b, h);
      gemm<T>(false, true, d.T, d.S, d.D, static_cast<T>(scale), qp, d.D, head_ptr<T>(k, b, g), row_stride(k), T(0),
              scores.data(), d.S);
      causal_softmax(scores.data(), lse.data_ptr<T>() + item * d.T, d);
      T* op = out.data_ptr<T>() + (b * d.T * d.nh + h) * d.D;
      gemm<T>(false, false, d.T, d.D, d.S, T(1), scores.data(), d.S, head_ptr<T>(v, b, g), row_stride(v), T(0), op,
              d.nh * d.D);
    }
  });
}

// Per (sequence, KV head): the `rep` query heads that share it accumulate into its dK and dV, so no two
// threads write the same rows.
template <class T>
void backward_kernel(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& lse,
                     const torch::Tensor& grad_out, double scale, const Dims& d, torch::Tensor& dq, torch::Tensor& dk,
                     torch::Tensor& dv) {
  at::parallel_for(
      0, d.B * d.nkv, std::max<std::int64_t>(1, grain(d) / d.rep), [&](std::int64_t begin, std::int64_t end) {
        std::vector<T> p(static_cast<std::size_t>(d.T * d.S)), dp(p.size());
        for (std::int64_t item = begin; item < end; ++item) {
          const std::int64_t b = item / d.nkv, g = item % d.nkv;
          const T* kp = head_ptr<T>(k, b, g);
          const T* vp = head_ptr<T>(v, b, g);
          T* dkp = dk.data_ptr<T>() + item * d.S * d.D;
          T* dvp = dv.data_ptr<T>() + item * d.S * d.D;
          for (std::int64_t h = g * d.rep; h < (g + 1) * d.rep; ++h) {
            const T* qp = head_ptr<T>(q, b, h);
            const T* dop = grad_out.data_ptr<T>() + (b * d.T * d.nh + h) * d.D;  // [T, D], leading dim nh * D
            const std::int64_t ldo = d.nh * d.D;
            gemm<T>(false, true, d.T, d.S, d.D, static_cast<T>(scale), qp, d.D, kp, row_stride(k), T(0), p.data(), d.S);
            probabilities_from_lse(p.data(), lse.data_ptr<T>() + (b * d.nh + h) * d.T, d);
            gemm<T>(true, false, d.S, d.D, d.T, T(1), p.data(), d.S, dop, ldo, T(1), dvp, d.D);  // dV += P^T dO
            gemm<T>(false, true, d.T, d.S, d.D, T(1), dop, ldo, vp, row_stride(v), T(0), dp.data(),
                    d.S);  // dP = dO V^T
            // Softmax backward: dS = P * (dP - rowsum(P * dP)), times the score scale.
            for (std::int64_t i = 0; i < d.T; ++i) {
              const T* pr = p.data() + i * d.S;
              T* dr = dp.data() + i * d.S;
              T dot = 0;
              for (std::int64_t j = 0; j < d.S; ++j) dot += pr[j] * dr[j];
              for (std::int64_t j = 0; j < d.S; ++j) dr[j] = pr[j] * (dr[j] - dot) * static_cast<T>(scale);
            }
            T* dqp = dq.data_ptr<T>() + (b * d.nh + h) * d.T * d.D;
            gemm<T>(false, false, d.T, d.D, d.S, T(1), dp.data(), d.S, kp, row_stride(k), T(0), dqp, d.D);  // dQ = dS K
            gemm<T>(true, false, d.S, d.D, d.T, T(1), dp.data(), d.S, qp, d.D, T(1), dkp, d.D);  // dK += dS^T Q
          }
        }
      });
}

class CausalAttentionFn : public torch::autograd::Function<CausalAttentionFn> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor q, torch::Tensor keys,
                               torch::Tensor values, double scale) {
    q = q.contiguous();
    keys = rows_contiguous(keys);
    values = rows_contiguous(values);
    const Dims d = dims_of(q, keys, values);
    auto out = torch::empty({d.B, d.T, d.nh * d.D}, q.options());
    auto lse = torch::empty({d.B, d.nh, d.T}, q.options());
    AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "causal_attention",
                               [&] { forward_kernel<scalar_t>(q, keys, values, scale, d, out, lse); });
    ctx->save_for_backward({q, keys, values, lse});
    ctx->saved_data["scale"] = scale;
    return out;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &keys = saved[1], &values = saved[2], &lse = saved[3];
    const double scale = ctx->saved_data["scale"].toDouble();
    const Dims d = dims_of(q, keys, values);
    const torch::Tensor grad_out = grads[0].contiguous();
    auto dq = torch::empty_like(q, torch::MemoryFormat::Contiguous);
    auto dk = torch::zeros({d.B, d.nkv, d.S, d.D}, q.options());
    auto dv = torch::zeros({d.B, d.nkv, d.S, d.D}, q.options());
    AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "causal_attention_backward", [&] {
      backward_kernel<scalar_t>(q, keys, values, lse, grad_out, scale, d, dq, dk, dv);
    });
    return {dq, dk, dv, torch::Tensor()};
  }
};

}  // namespace

SdpaArgs sdpa_args(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values) {
  const Dims d = dims_of(q, keys, values);
  SdpaArgs a;
  // Queries that follow cached keys: as many zero queries before them as keys are cached, so that query i sits at
  // key i and the causal flag's top-left alignment is the right one. Their outputs are dropped. Work over S x S / 2
  // scores where the queries need T x S (at most S / 2T times as much, ~1.5x over a prompt prefilled in 4 chunks),
  // memory linear in S: where the alternative, an explicit [T, S] mask, rules out flash attention, and with it the
  // memory-efficient kernel's grouped-query support varies by release, leaving the math kernel's [B, heads, T, S].
  // (CUDA's flash kernel itself aligns the causal mask bottom-right, as PyTorch's causal_lower_right uses through an
  // internal entry point, at::_scaled_dot_product_flash_attention; not taken here: the CPU tests could not see it.)
  a.skip = d.T > 1 ? d.past : 0;
  a.q = a.skip > 0 ? torch::cat({torch::zeros({d.B, d.nh, a.skip, d.D}, q.options()), q}, 2) : q;
  a.is_causal = d.T > 1;
  // Grouped-query heads as plain heads: each KV head repeated for the query heads that read it (query head h reads
  // KV head h / rep), so that no kernel needs enable_gqa (flash takes it; the memory-efficient kernel's support for
  // it varies by release and platform). Memory as the queries', linear in S.
  auto per_head = [&](const torch::Tensor& t) {
    const torch::Tensor rows = t.stride(3) == 1 ? t : t.contiguous();
    if (d.rep == 1) return rows;
    return rows.unsqueeze(2).expand({d.B, d.nkv, d.rep, d.S, d.D}).reshape({d.B, d.nh, d.S, d.D});
  };
  a.keys = per_head(keys);
  a.values = per_head(values);
  if (a.q.stride(3) != 1) a.q = a.q.contiguous();
  return a;
}

#if RLLOOP_HAVE_SDPA
torch::Tensor sdpa_attention(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                             double scale) {
  const std::int64_t B = q.size(0), nh = q.size(1), T = q.size(2), D = q.size(3);
  const SdpaArgs a = sdpa_args(q, keys, values);
  torch::Tensor out = at::scaled_dot_product_attention(a.q, a.keys, a.values, /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                                       a.is_causal, scale);
  if (a.skip > 0) out = out.narrow(2, a.skip, T);
  return out.transpose(1, 2).reshape({B, T, nh * D});
}
#endif

torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                               double scale) {
  const auto dtype = q.scalar_type();
  const bool same = keys.scalar_type() == dtype && values.scalar_type() == dtype;
  if (q.device().is_cpu() && same && (dtype == torch::kFloat32 || dtype == torch::kFloat64))
    return CausalAttentionFn::apply(q, keys, values, scale);
#if RLLOOP_HAVE_SDPA
  if (same) return sdpa_attention(q, keys, values, scale);
#endif
  // bf16 on the CPU with LibTorch 1.13: the kernel on fp32 copies (memory linear in the length, as the fused
  // attention's; its arithmetic too: fp32 products and softmax over bf16 inputs, the output rounded to bf16).
  if (q.device().is_cpu() && same && (dtype == torch::kBFloat16 || dtype == torch::kHalf))
    return CausalAttentionFn::apply(q.to(torch::kFloat32), keys.to(torch::kFloat32), values.to(torch::kFloat32), scale)
        .to(dtype);
  return causal_attention_reference(q, keys, values, scale);
}

torch::Tensor causal_attention_reference(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                                         double scale) {
  return windowed_attention(q, keys, values, scale, /*sinks=*/{}, /*window=*/0);
}

namespace {
// Softmax over the last dimension of scores [..., heads as nkv x rep, rows, S] in `dtype`, with each head's sink
// logit (sinks [nh], when defined) as one more column that is dropped afterwards.
torch::Tensor softmax_with_sinks(const torch::Tensor& scores, const torch::Tensor& sinks, torch::ScalarType dtype) {
  if (!sinks.defined()) return torch::softmax(scores, -1, dtype);
  std::vector<std::int64_t> shape(scores.sizes().begin(), scores.sizes().end());
  shape.back() = 1;
  std::vector<std::int64_t> per_head(shape.size(), 1);
  per_head[per_head.size() - 4] = scores.size(-4);  // nkv
  per_head[per_head.size() - 3] = scores.size(-3);  // rep
  const torch::Tensor column = sinks.to(dtype).view(per_head).expand(shape);
  const std::int64_t S = scores.size(-1);
  return torch::softmax(torch::cat({scores.to(dtype), column}, -1), -1).narrow(-1, 0, S);
}

// Gemma 2's soft-cap of attention logits (softcap > 0).
torch::Tensor soft_capped(torch::Tensor scores, double softcap) {
  return softcap > 0 ? torch::tanh(scores / softcap) * softcap : scores;
}
}  // namespace

torch::Tensor windowed_attention(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                                 double scale, const torch::Tensor& sinks, std::int64_t window, double softcap) {
  const Dims d = dims_of(q, keys, values);
  if (sinks.defined() && (sinks.dim() != 1 || sinks.size(0) != d.nh))
    throw invalid_argument("windowed_attention: sinks must be [" + std::to_string(d.nh) + "]");
  // [B, nkv, rep, T, S]: the `rep` query heads that share a KV head stacked along the rows ([B, nkv, rep*T, D] x
  // [B, nkv, D, S]), so the repeated K/V are never materialised.
  torch::Tensor scores =
      soft_capped(torch::matmul(q.reshape({d.B, d.nkv, d.rep * d.T, d.D}), keys.transpose(-1, -2)) * scale, softcap)
          .view({d.B, d.nkv, d.rep, d.T, d.S});
  auto pos = torch::TensorOptions().device(q.device()).dtype(torch::kLong);
  const torch::Tensor key = torch::arange(0, d.S, pos).unsqueeze(0);
  const torch::Tensor query = torch::arange(d.past, d.S, pos).unsqueeze(1);
  torch::Tensor hidden = key > query;  // [T, S]
  if (window > 0) hidden = hidden.logical_or(key <= query - window);
  scores = scores.masked_fill(hidden, -std::numeric_limits<double>::infinity());
  // Softmax in fp32 as HF does (fp64 stays fp64: it is used to check gradients).
  const auto softmax_dtype = q.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
  torch::Tensor probs = softmax_with_sinks(scores, sinks, softmax_dtype);
  if (probs.scalar_type() != q.scalar_type()) probs = probs.to(q.scalar_type());
  return torch::matmul(probs.view({d.B, d.nkv, d.rep * d.T, d.S}), values)
      .view({d.B, d.nh, d.T, d.D})
      .transpose(1, 2)
      .reshape({d.B, d.T, d.nh * d.D});
}

torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& keys_padded,
                               const torch::Tensor& values_padded, const torch::Tensor& lengths, double scale,
                               const torch::Tensor& sinks, std::int64_t window, double softcap) {
  const std::int64_t R = q.size(0), nh = q.size(1), D = q.size(3), nkv = keys_padded.size(1), S = keys_padded.size(2);
  const torch::Tensor position = torch::arange(S, lengths.options()).view({1, S});
  torch::Tensor visible = position < lengths.view({R, 1});  // [R, S]
  if (window > 0) visible = visible.logical_and(position >= lengths.view({R, 1}) - window);
  // Keys and values past a row's length are whatever its blocks held (a pool's slots are never cleared): zeroed
  // first, since a masked score is 0 only when finite (NaN + -inf is NaN, and 0 x NaN too).
  const torch::Tensor hidden = visible.logical_not().view({R, 1, S, 1});
  const torch::Tensor keys = keys_padded.masked_fill(hidden, 0), values = values_padded.masked_fill(hidden, 0);
  // The `rep` query heads of a KV head as the query rows of that head: [R, nkv, rep, D] against [R, nkv, S, D], so the
  // keys are never repeated (query head h reads KV head h / rep).
  const std::int64_t rep = nh / nkv;
#if RLLOOP_HAVE_SDPA
  // A mask and no grouped-query flag: the memory-efficient kernel takes that combination (flash takes no mask).
  if (!sinks.defined() && softcap == 0)
    return at::scaled_dot_product_attention(q.reshape({R, nkv, rep, D}), keys, values, visible.view({R, 1, 1, S}),
                                            /*dropout_p=*/0.0, /*is_causal=*/false, scale)
        .reshape({R, 1, nh * D});
#endif
  // [R, nkv, rep, 1, S]: one query row per head, in the layout softmax_with_sinks reads.
  torch::Tensor scores =
      soft_capped(torch::matmul(q.reshape({R, nkv, rep, D}), keys.transpose(-1, -2)) * scale, softcap).unsqueeze(3);
  scores = scores.masked_fill(visible.logical_not().view({R, 1, 1, 1, S}), -std::numeric_limits<double>::infinity());
  torch::Tensor probs = softmax_with_sinks(scores, sinks, torch::kFloat32).squeeze(3);
  if (probs.scalar_type() != q.scalar_type()) probs = probs.to(q.scalar_type());
  return torch::matmul(probs, values).reshape({R, 1, nh * D});
}

}  // namespace rlloop::engine
