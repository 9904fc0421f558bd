// The arguments causal_attention gives LibTorch's fused attention (sdpa_args): a layout its flash and
// memory-efficient kernels take for every shape the engine attends over (training and prefill, prefill after a
// cache, a prompt's chunk over its gathered blocks, one decoded query), grouped-query heads included, with the
// attention of the ATen reference (the math kernel's, with its explicit mask) within fp32 rounding.
//
// The preconditions asserted are those of PyTorch's kernel choice (aten/src/ATen/native/transformers/cuda/
// sdp_utils.cpp, can_use_flash_attention and can_use_mem_efficient_attention): no attention mask, the causal flag
// only where there are as many queries as keys, as many KV heads as query heads (no enable_gqa), the last dimension
// contiguous, one floating dtype, a head dimension that is a multiple of 8 up to 256. In a LibTorch with
// scaled_dot_product_attention (2.5+), the CPU's own kernel choice is asked too (at::_fused_sdp_choice: flash, not
// the math fallback) and the fused call is compared with the reference.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "kernels/attention.hpp"

#if RLLOOP_HAVE_SDPA
#include <ATen/SDPBackend.h>
#endif

using namespace rlloop::engine;

namespace {

struct Shape {
  std::int64_t B, nh, nkv, T, S, D;
  std::string name;
};

// Every shape the engine attends over with causal_attention, grouped-query heads and not.
std::vector<Shape> shapes() {
  return {{2, 4, 2, 12, 12, 16, "prefill, grouped-query"},
          {2, 4, 4, 12, 12, 16, "prefill"},
          {2, 4, 2, 5, 12, 16, "after a cache, grouped-query"},
          {1, 8, 2, 16, 48, 32, "a chunk over its blocks, 4 query heads per KV head"},
          {2, 4, 1, 3, 20, 16, "after a cache, one KV head"},
          {2, 4, 2, 1, 9, 16, "one decoded query"}};
}

struct Inputs {
  torch::Tensor q, keys, values;
};

// q as the projections give it ([B, T, heads, D] transposed) and the keys and values as views of a cache's gather.
Inputs inputs_of(const Shape& s, torch::ScalarType dtype, int seed) {
  torch::manual_seed(seed);
  const auto f = torch::TensorOptions().dtype(dtype);
  Inputs in;
  in.q = torch::randn({s.B, s.T, s.nh, s.D}, f).transpose(1, 2);
  in.keys = torch::randn({s.B, s.S + 3, s.nkv, s.D}, f).narrow(1, 0, s.S).transpose(1, 2);
  in.values = torch::randn({s.B, s.S + 3, s.nkv, s.D}, f).narrow(1, 0, s.S).transpose(1, 2);
  return in;
}

// The attention the arguments ask for, computed with plain ATen operators in fp64: softmax(q k^T scale) v over
// keys j <= i where is_causal, all keys otherwise; the rows past `skip` in causal_attention's layout.
torch::Tensor attend_args(const SdpaArgs& a, double scale) {
  const torch::Tensor q = a.q.to(torch::kFloat64), k = a.keys.to(torch::kFloat64), v = a.values.to(torch::kFloat64);
  torch::Tensor scores = torch::matmul(q, k.transpose(-1, -2)) * scale;
  if (a.is_causal) {
    const std::int64_t L = q.size(2), S = k.size(2);
    const torch::Tensor hidden = torch::ones({L, S}, torch::kBool).triu(1);
    scores = scores.masked_fill(hidden, -std::numeric_limits<double>::infinity());
  }
  torch::Tensor out = torch::matmul(torch::softmax(scores, -1), v);
  const std::int64_t B = q.size(0), nh = q.size(1), D = q.size(3), T = q.size(2) - a.skip;
  return out.narrow(2, a.skip, T).transpose(1, 2).reshape({B, T, nh * D});
}

void expect_flash_preconditions(const SdpaArgs& a, const Shape& s, torch::ScalarType dtype) {
  SCOPED_TRACE(s.name);
  // No mask: SdpaArgs has none to give. The causal flag only over a square of queries and keys.
  EXPECT_EQ(a.is_causal, s.T > 1);
  if (a.is_causal) {
    EXPECT_EQ(a.q.size(2), a.keys.size(2)) << "flash refuses the causal flag when seqlen_q != seqlen_k";
  }
  EXPECT_EQ(a.skip + s.T, a.q.size(2));
  // As many KV heads as query heads: no enable_gqa.
  EXPECT_EQ(a.keys.size(1), a.q.size(1));
  EXPECT_EQ(a.values.size(1), a.q.size(1));
  EXPECT_EQ(a.keys.sizes(), a.values.sizes());
  for (const torch::Tensor* t : {&a.q, &a.keys, &a.values}) {
    EXPECT_EQ(t->dim(), 4);
    EXPECT_EQ(t->stride(3), 1) << "the last dimension must be contiguous";
    EXPECT_EQ(t->scalar_type(), dtype);
    EXPECT_EQ(t->size(0), s.B);
    EXPECT_EQ(t->size(3), s.D);
  }
  EXPECT_EQ(s.D % 8, 0);
  EXPECT_LE(s.D, 256);
}

}  // namespace

TEST(AttentionSdpa, TheArgumentsMeetTheFusedKernelsPreconditionsAndAttendAsTheReference) {
  for (const Shape& s : shapes()) {
    for (const torch::ScalarType dtype : {torch::kFloat32, torch::kBFloat16}) {
      const Inputs in = inputs_of(s, dtype, 7);
      const SdpaArgs a = sdpa_args(in.q, in.keys, in.values);
      expect_flash_preconditions(a, s, dtype);
      if (dtype != torch::kFloat32) continue;
      // The reference: the ATen path with its explicit [T, S] mask aligned to the cached keys (the math kernel's).
      const double scale = 1.0 / std::sqrt(static_cast<double>(s.D));
      const torch::Tensor reference = causal_attention_reference(in.q, in.keys, in.values, scale);
      const torch::Tensor through_args = attend_args(a, scale).to(torch::kFloat32);
      EXPECT_LT((through_args - reference).abs().max().item<double>(), 1e-5) << s.name;
    }
  }
}

#if RLLOOP_HAVE_SDPA
TEST(AttentionSdpa, TheCpuPicksItsFlashKernelAndTheFusedCallAttendsAsTheReference) {
  for (const Shape& s : shapes()) {
    for (const torch::ScalarType dtype : {torch::kFloat32, torch::kBFloat16}) {
      SCOPED_TRACE(s.name + (dtype == torch::kFloat32 ? ", fp32" : ", bf16"));
      const Inputs in = inputs_of(s, dtype, 11);
      const SdpaArgs a = sdpa_args(in.q, in.keys, in.values);
      const double scale = 1.0 / std::sqrt(static_cast<double>(s.D));
      const std::int64_t backend =
          at::_fused_sdp_choice(a.q, a.keys, a.values, /*attn_mask=*/{}, /*dropout_p=*/0.0, a.is_causal, scale);
      EXPECT_EQ(backend, static_cast<std::int64_t>(at::SDPBackend::flash_attention));
      const torch::Tensor fused = sdpa_attention(in.q, in.keys, in.values, scale);
      const torch::Tensor reference = causal_attention_reference(in.q.to(torch::kFloat32), in.keys.to(torch::kFloat32),
                                                                 in.values.to(torch::kFloat32), scale);
      // fp32: rounding only; bf16: the output's own rounding (2^-8 relative) over values of order 1.
      const double bound = dtype == torch::kFloat32 ? 1e-5 : 3e-2;
      EXPECT_LT((fused.to(torch::kFloat32) - reference).abs().max().item<double>(), bound);
    }
  }
}

// The gradients through the fused call, as training takes them (prefill: as many queries as keys), equal the
// reference's.
TEST(AttentionSdpa, TheFusedCallsGradientsAreTheReferences) {
  const Shape s{2, 4, 2, 10, 10, 16, "training"};
  const Inputs in = inputs_of(s, torch::kFloat64, 5);
  const double scale = 0.25;
  torch::Tensor grads[2][3];
  for (int path = 0; path < 2; ++path) {
    const torch::Tensor q = in.q.detach().clone().requires_grad_(true);
    const torch::Tensor k = in.keys.detach().clone().requires_grad_(true);
    const torch::Tensor v = in.values.detach().clone().requires_grad_(true);
    const torch::Tensor out = path == 0 ? sdpa_attention(q, k, v, scale) : causal_attention_reference(q, k, v, scale);
    (out * torch::linspace(-1, 1, out.numel(), out.options()).view(out.sizes())).sum().backward();
    grads[path][0] = q.grad();
    grads[path][1] = k.grad();
    grads[path][2] = v.grad();
  }
  for (int i = 0; i < 3; ++i) EXPECT_LT((grads[0][i] - grads[1][i]).abs().max().item<double>(), 1e-10) << i;
}
#endif
