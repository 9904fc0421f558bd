// The few-row product of small_gemm.hpp with operands rounded to bf16 and fp32 sums: the opt-in "bf16"
// sampling precision (LocalServiceOptions::sampling_precision). Decoding 16 rows of rlloop-100m is
// compute-bound in fp32 (bench/engine/README.md); a CPU with AVX512_BF16 does 32 bf16 multiply-adds per
// `vdpbf16ps` where an fp32 FMA does 8 or 16, and the weights take half the bytes.
//
// Numerics are the same everywhere: weights and inputs rounded to the nearest bf16 (ties to even), products
// exact, sums in fp32. Where the CPU has AVX512_BF16 the weights are stored as bf16 and go through the
// dot-product kernel; elsewhere (and in builds without the x86 kernels) the rounded values are stored as fp32
// and go through linear_rows, which makes the option portable (same speed as fp32 there) and gives the tests a
// reference that differs only in the order of the sums and in denormals (the AVX512_BF16 instructions flush
// denormal inputs and sums to zero).
#pragma once
#include <cstdint>
#include <span>

#include <torch/torch.h>

#include "kernels/bf16.hpp"

namespace rlloop::engine {

// True when this CPU runs the AVX512_BF16 kernel (never in a build without the x86 kernels: simd.hpp).
bool bf16_dot_supported();

class Bf16Weight;

// One of several products of the same input: Y (row-major [M, weight->rows()]) = round(X) W^T, or += with
// `accumulate`.
struct Bf16Product {
  const Bf16Weight* weight;
  float* Y;
  bool accumulate;
};

// A weight [rows, cols] (row-major) rounded to bf16, in the storage the product uses on this CPU. bf16 rows
// start on 64-byte boundaries (their stride is cols rounded up to 32 values, zero-padded): the kernel's
// 512-bit loads then never straddle two cache lines, which otherwise costs 40% of its speed. Storage comes
// from LibTorch's CPU allocator, so under the engine's caching allocator a sampler that rounds the same
// model every call reuses the same (already mapped) blocks instead of page-faulting fresh ones.
class Bf16Weight {
 public:
  enum class Storage { best, bf16, widened };  // best: bf16 when bf16_dot_supported(), else widened
  Bf16Weight() = default;
  // `storage` other than best is for tests (bf16 requires bf16_dot_supported()). Rounds in parallel.
  Bf16Weight(const float* W, std::int64_t rows, std::int64_t cols, Storage storage = Storage::best);

  std::int64_t rows() const { return rows_; }
  std::int64_t cols() const { return cols_; }
  bool stored_as_bf16() const { return bf16_.defined(); }

  // Y (row-major [M, rows()]) = round(X) W^T for X row-major [M, cols()], or Y += that with `accumulate`.
  void multiply(const float* X, std::int64_t M, float* Y, bool accumulate) const;
  // Every product of X [M, cols] (the same cols for all the weights) with X rounded once and one parallel
  // region for all of them, as linear_rows_group.
  static void multiply_group(const float* X, std::int64_t M, std::span<const Bf16Product> products);

 private:
  std::int64_t rows_ = 0, cols_ = 0, stride_ = 0;  // stride_: bf16 values per stored row
  torch::Tensor bf16_;     // bf16 storage: kBFloat16 [rows_, stride_] (LibTorch aligns CPU blocks to 64 bytes)
  torch::Tensor widened_;  // widened storage: kFloat32 [rows_, cols_]
};

}  // namespace rlloop::engine
