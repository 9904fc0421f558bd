// Y[M, N] = X[M, K] W[N, K]^T (or Y += ...) for few rows (a decoding step's batch), reading W in place.
// OpenBLAS packs (copies) the whole weight on every call, which for a 16-row product costs more than the
// arithmetic: 41% of rlloop-100m's decoding time was sgemm_incopy. This kernel streams each block of W rows
// once from memory and keeps it in L1 while every row of X passes over it (AVX2 + FMA, chosen at run time;
// other CPUs and shapes, and builds without the x86 kernels (simd.hpp), go to BLAS). Each output is computed
// by one thread in a fixed order: results do not depend on the thread count.
#pragma once
#include <cstdint>
#include <span>

namespace rlloop::engine {

// True when the AVX2/FMA kernel runs for this shape on this CPU (otherwise linear_rows uses BLAS).
bool small_gemm_applies(std::int64_t M, std::int64_t K);

// Y (row-major [M, N], leading dimension N) = X (row-major [M, K]) W^T (W row-major [N, K]), or Y += that
// with `accumulate`.
void linear_rows(const float* X, std::int64_t M, const float* W, std::int64_t N, std::int64_t K, float* Y,
                 bool accumulate);

// The same product on the calling thread only, into columns of a wider Y (leading dimension ldy >= N): the
// building block of products whose weights arrive in pieces (quantized_matrix.cpp dequantizes a few rows of W at
// a time and multiplies each piece as it comes).
void linear_rows_serial(const float* X, std::int64_t M, const float* W, std::int64_t N, std::int64_t K, float* Y,
                        std::int64_t ldy, bool accumulate);

// One of several products of the same input: Y (row-major [M, N]) = X W^T (W row-major [N, K]), or += with
// `accumulate`.
struct RowProduct {
  const float* W;
  std::int64_t N;
  float* Y;
  bool accumulate;
};
// Every product of X [M, K] in one parallel region, the column blocks of all of them shared between the
// threads (product_blocks.hpp). A decoding step's q/k/v and gate/up products then cost one fork/join each, and
// a product too small to split keeps its thread busy beside the others instead of running alone. (Shapes the
// kernel does not take go to BLAS, one call per product.)
void linear_rows_group(const float* X, std::int64_t M, std::int64_t K, std::span<const RowProduct> products);

// A product with an input of its own: Y (row-major [M, N]) = X (row-major [M, K]) W^T, or += with `accumulate`.
struct OwnRowsProduct {
  const float* X;
  std::int64_t M;
  const float* W;
  std::int64_t N;
  float* Y;
  bool accumulate;
};
// Several products of the same K, each over its own rows (the experts of a decoding step, each over the rows routed
// to it), in one parallel region as linear_rows_group runs its products. (Shapes the kernel does not take go to
// BLAS, one call per product.)
void linear_rows_each(std::int64_t K, std::span<const OwnRowsProduct> products);

}  // namespace rlloop::engine
