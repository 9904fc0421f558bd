// Element-wise parts of the decoder as single fused CPU kernels (forward and backward). In eager LibTorch an
// RMSNorm is six tensor ops forward and a dozen backward, each a pass over the activations plus a dispatch;
// fused, it is one pass each way. On CPU fp32/fp64 these run the fused kernels; elsewhere (CUDA, bf16) the
// ATen formulation, which is also the reference the kernels are tested against.
#pragma once
#include <cmath>
#include <cstdint>

#include <torch/torch.h>

namespace rlloop::engine {

// One row of rms_norm: y = w * (x * r) with r = 1 / sqrt(mean(x^2) + eps) (sum of squares in double);
// returns r. Shared by the fused kernel and the CPU decoder so both compute the same values.
template <class T>
T rms_norm_row(const T* x, const T* w, T* y, std::int64_t H, double eps) {
  double sum = 0;
  for (std::int64_t i = 0; i < H; ++i) sum += static_cast<double>(x[i]) * x[i];
  const auto r = static_cast<T>(1.0 / std::sqrt(sum / static_cast<double>(H) + eps));
  for (std::int64_t i = 0; i < H; ++i) y[i] = w[i] * (x[i] * r);
  return r;
}

// Hugging Face LlamaRMSNorm: weight * (x * rsqrt(mean(x^2, -1) + eps)), normalised in fp32.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);
torch::Tensor rms_norm_reference(const torch::Tensor& x, const torch::Tensor& weight, double eps);

// One vector of HF rotate_half RoPE (pairs (i, i + D/2)): y = x * cos + rotate_half(x) * sin. y may be x.
template <class T>
void rope_row(const T* x, T* y, const T* cos, const T* sin, std::int64_t D) {
  const std::int64_t half = D / 2;
  for (std::int64_t i = 0; i < half; ++i) {
    const T a = x[i], b = x[i + half];
    y[i] = -b * sin[i] + a * cos[i];
    y[i + half] = a * sin[i + half] + b * cos[i + half];
  }
}

// RoPE on x [B, T, heads, D] (a projection's output viewed per head) with cos/sin rows [T, D]; returns the
// rotated heads as [B, heads, T, D], contiguous (the layout attention reads).
torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
torch::Tensor rope_reference(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);

// gate[i] = silu(gate[i]) * up[i] for n values in place, as the decoding step applies it (AVX2 with a
// vectorised exp where the CPU has it: within a few ulp of the formula; a scalar std::exp loop elsewhere).
void swiglu_in_place(float* gate, const float* up, std::int64_t n);

// The SwiGLU gate: silu(gate) * up, same shapes.
torch::Tensor swiglu(const torch::Tensor& gate, const torch::Tensor& up);
torch::Tensor swiglu_reference(const torch::Tensor& gate, const torch::Tensor& up);

}  // namespace rlloop::engine
