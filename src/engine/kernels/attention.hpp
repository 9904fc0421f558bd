// Causal grouped-query attention, the one piece of the decoder that LibTorch 1.13 runs badly on CPU: its bmm
// loops over the batch x heads matrices with three tensor `select`s and an addmm dispatch each (~20 us per
// 32x32 matrix), which made attention a sixth of a small model's training step and most of a decoding step.
// On CPU (fp32/fp64) this calls BLAS directly per (sequence, head) from one parallel loop and recomputes the
// probabilities in the backward pass from a saved log-sum-exp, so its memory grows linearly with the length.
// Elsewhere: LibTorch's fused scaled_dot_product_attention where it exists (2.5+: CUDA, bf16) in a layout its flash
// and memory-efficient kernels take (sdpa_args), bf16 on the CPU through the kernel on fp32 copies, and the ATen
// reference (which keeps [B, heads, T, S]) for the rest.
#pragma once
#include <torch/torch.h>
#include <torch/version.h>

// at::scaled_dot_product_attention with grouped-query heads (enable_gqa) exists from LibTorch 2.5; Debian's 1.13
// has neither.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 5)
#define RLLOOP_HAVE_SDPA 1
#else
#define RLLOOP_HAVE_SDPA 0
#endif

namespace rlloop::engine {

// q: [B, heads, T, D]; keys, values: [B, kv_heads, S, D] with S >= T and the last dimension contiguous (views
// of a KV cache are fine). heads must be a multiple of kv_heads (query head h reads KV head h / (heads /
// kv_heads)). Query i sits at position S - T + i and sees keys 0 ..= S - T + i. Returns [B, T, heads * D]
// (the layout o_proj takes), differentiable with respect to q, keys and values.
torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                               double scale);

// The same computation with plain ATen ops (matmul, masked_fill, softmax in fp32): the path for devices and
// dtypes the kernel does not cover, and the reference the kernel is tested against (windowed_attention without
// sinks or a window).
torch::Tensor causal_attention_reference(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                                         double scale);

// How causal_attention calls LibTorch's fused scaled_dot_product_attention (2.5+; on CUDA, or bf16 on the CPU) so
// that its flash and memory-efficient kernels take the call whatever the layout: prefill, prefill after a cache,
// chunked prefill, grouped-query heads. Their preconditions, which the arguments meet: no explicit mask (flash takes
// none); the causal flag only over as many queries as keys (flash refuses it otherwise: its mask is aligned
// bottom-right, SDPA's top-left); as many KV heads as query heads (no enable_gqa); the last dimension contiguous;
// one dtype. `q` holds `skip` leading zero queries when the real ones follow cached keys; the output's rows past
// them are the real queries'. A pure function of the shapes, so that the CPU tests check it (attention_sdpa_test).
struct SdpaArgs {
  torch::Tensor q, keys, values;  // [B, heads, skip + T, D], [B, heads, S, D] twice
  bool is_causal = false;
  std::int64_t skip = 0;
};
SdpaArgs sdpa_args(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values);

#if RLLOOP_HAVE_SDPA
// causal_attention through scaled_dot_product_attention over sdpa_args: what causal_attention runs on CUDA.
torch::Tensor sdpa_attention(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                             double scale);
#endif

// causal_attention with gpt-oss's two extras, as transformers' eager attention computes them: a sliding window
// (`window` > 0: the query at position p sees keys p - window < j <= p) and sink logits (`sinks` [heads], when
// defined: one more logit per head in every softmax, taking probability without contributing a value; its gradient
// flows), and Gemma 2's soft-cap (`softcap` > 0: each scaled logit s becomes softcap * tanh(s / softcap) before the
// mask). ATen operators on every device, the softmax in fp32 (fp64 for fp64): memory [B, heads, T, S], as the
// reference's.
torch::Tensor windowed_attention(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                                 double scale, const torch::Tensor& sinks, std::int64_t window, double softcap = 0);

// One decoded query per row over keys padded to a common length: q [R, heads, 1, D]; keys, values [R, kv_heads, S,
// D]; row r sees keys [0, lengths[r]) (lengths: [R] int64 on q's device, each in [1, S]); what lies past a row's
// length may be anything, NaN included (a pool's unwritten slots). Returns [R, 1, heads * D].
// The paged cache's decoding step on devices without the CPU kernel: scaled_dot_product_attention with a mask where
// LibTorch has it, else ATen operators with the softmax in fp32.
// With `sinks`, a `window` (as windowed_attention's: the row sees its last `window` keys) or a `softcap` (as
// windowed_attention's), ATen operators.
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                               const torch::Tensor& lengths, double scale, const torch::Tensor& sinks = {},
                               std::int64_t window = 0, double softcap = 0);

}  // namespace rlloop::engine
