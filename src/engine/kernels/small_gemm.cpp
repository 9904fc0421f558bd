#include "kernels/small_gemm.hpp"

#include <algorithm>
#include <vector>

#include "kernels/blas.hpp"
#include "kernels/product_blocks.hpp"
#include "kernels/simd.hpp"

namespace rlloop::engine {
namespace {

constexpr std::int64_t kMaxRows = 64;  // beyond this BLAS's packing pays for itself

#if RLLOOP_SIMD_X86
constexpr std::int64_t kWRows = 3;  // W rows per block: 3 x 4 accumulators + 3 W + 1 X fill the 16 ymm registers
constexpr std::int64_t kXRows = 4;

using simd::hsum;
using simd::hsum4;

// Output columns [n0, n1): blocks of 3 W rows against 4 X rows at a time; K is a multiple of 8.
__attribute__((target("avx2,fma"))) void kernel(const float* X, std::int64_t M, const float* W, std::int64_t n0,
                                                std::int64_t n1, std::int64_t K, float* Y, std::int64_t ldy,
                                                bool accumulate) {
  const simd::ProductOutput out{Y, ldy, accumulate};
  const std::int64_t passes = std::max<std::int64_t>(1, (M + kXRows - 1) / kXRows);
  const std::int64_t lines = kWRows * K / 16, per_pass = (lines + passes - 1) / passes;
  std::int64_t n = n0;
  for (; n + kWRows <= n1; n += kWRows) {
    const float* w0 = W + n * K;
    const float *w1 = w0 + K, *w2 = w1 + K;
    // The next block's weights (contiguous with these) are prefetched a slice per pass over X, so they arrive
    // while this block computes instead of stalling the next one on memory latency.
    const float* next = n + 2 * kWRows <= n1 ? w0 + kWRows * K : nullptr;
    for (std::int64_t m = 0, pass = 0; m < M; m += kXRows, ++pass) {
      if (next)
        for (std::int64_t line = pass * per_pass, end = std::min(lines, line + per_pass); line < end; ++line)
          _mm_prefetch(reinterpret_cast<const char*>(next + line * 16), _MM_HINT_T0);
      if (m + kXRows <= M) {
        const float *x0 = X + m * K, *x1 = x0 + K, *x2 = x1 + K, *x3 = x2 + K;
        __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, a13 = a00,
               a20 = a00, a21 = a00, a22 = a00, a23 = a00;
        for (std::int64_t k = 0; k < K; k += 8) {
          const __m256 v0 = _mm256_loadu_ps(w0 + k), v1 = _mm256_loadu_ps(w1 + k), v2 = _mm256_loadu_ps(w2 + k);
          __m256 x = _mm256_loadu_ps(x0 + k);
          a00 = _mm256_fmadd_ps(v0, x, a00), a10 = _mm256_fmadd_ps(v1, x, a10), a20 = _mm256_fmadd_ps(v2, x, a20);
          x = _mm256_loadu_ps(x1 + k);
          a01 = _mm256_fmadd_ps(v0, x, a01), a11 = _mm256_fmadd_ps(v1, x, a11), a21 = _mm256_fmadd_ps(v2, x, a21);
          x = _mm256_loadu_ps(x2 + k);
          a02 = _mm256_fmadd_ps(v0, x, a02), a12 = _mm256_fmadd_ps(v1, x, a12), a22 = _mm256_fmadd_ps(v2, x, a22);
          x = _mm256_loadu_ps(x3 + k);
          a03 = _mm256_fmadd_ps(v0, x, a03), a13 = _mm256_fmadd_ps(v1, x, a13), a23 = _mm256_fmadd_ps(v2, x, a23);
        }
        out.store_column(m, n, hsum4(a00, a01, a02, a03));
        out.store_column(m, n + 1, hsum4(a10, a11, a12, a13));
        out.store_column(m, n + 2, hsum4(a20, a21, a22, a23));
        continue;
      }
      for (std::int64_t r = m; r < M; ++r) {  // the last M % 4 rows
        const float* x0 = X + r * K;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0;
        for (std::int64_t k = 0; k < K; k += 8) {
          const __m256 x = _mm256_loadu_ps(x0 + k);
          a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + k), x, a0);
          a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + k), x, a1);
          a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + k), x, a2);
        }
        out.store(r, n, hsum(a0)), out.store(r, n + 1, hsum(a1)), out.store(r, n + 2, hsum(a2));
      }
    }
  }
  for (; n < n1; ++n) {  // the last N % 3 columns
    const float* w0 = W + n * K;
    for (std::int64_t m = 0; m < M; ++m) {
      __m256 a = _mm256_setzero_ps();
      for (std::int64_t k = 0; k < K; k += 8)
        a = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + k), _mm256_loadu_ps(X + m * K + k), a);
      out.store(m, n, hsum(a));
    }
  }
}
#endif  // RLLOOP_SIMD_X86

}  // namespace

bool small_gemm_applies(std::int64_t M, std::int64_t K) { return M <= kMaxRows && K % 8 == 0 && simd::has_avx2_fma(); }

void linear_rows(const float* X, std::int64_t M, const float* W, std::int64_t N, std::int64_t K, float* Y,
                 bool accumulate) {
  const RowProduct product{W, N, Y, accumulate};
  linear_rows_group(X, M, K, {&product, 1});
}

void linear_rows_serial(const float* X, std::int64_t M, const float* W, std::int64_t N, std::int64_t K, float* Y,
                        std::int64_t ldy, bool accumulate) {
  if (!small_gemm_applies(M, K)) {
    blas::gemm<float>(false, true, M, N, K, 1.0f, X, K, W, K, accumulate ? 1.0f : 0.0f, Y, ldy);
    return;
  }
#if RLLOOP_SIMD_X86
  kernel(X, M, W, 0, N, K, Y, ldy, accumulate);
#endif
}

void linear_rows_group(const float* X, std::int64_t M, std::int64_t K, std::span<const RowProduct> products) {
  std::vector<OwnRowsProduct> each;
  each.reserve(products.size());
  for (const RowProduct& p : products) each.push_back({X, M, p.W, p.N, p.Y, p.accumulate});
  linear_rows_each(K, each);
}

void linear_rows_each(std::int64_t K, std::span<const OwnRowsProduct> products) {
  std::int64_t rows = 0;
  for (const OwnRowsProduct& p : products) rows = std::max(rows, p.M);
  if (!small_gemm_applies(rows, K)) {
    for (const OwnRowsProduct& p : products)
      blas::gemm<float>(false, true, p.M, p.N, K, 1.0f, p.X, K, p.W, K, p.accumulate ? 1.0f : 0.0f, p.Y, p.N);
    return;
  }
#if RLLOOP_SIMD_X86
  // Blocks of kWRows columns shared between the threads as product_blocks.hpp says; the grain is ~1M
  // multiply-adds.
  const auto blocks_of = [](const OwnRowsProduct& p) { return (p.N + kWRows - 1) / kWRows; };
  std::int64_t blocks = 0;
  for (const OwnRowsProduct& p : products) blocks += blocks_of(p);
  const std::int64_t grain = std::max<std::int64_t>(1, (1 << 20) / std::max<std::int64_t>(1, rows * K * kWRows));
  product_blocks::parallel(blocks, grain, [&](std::int64_t begin, std::int64_t end) {
    product_blocks::visit(products, begin, end, blocks_of,
                          [&](const OwnRowsProduct& p, std::int64_t b0, std::int64_t b1) {
                            kernel(p.X, p.M, p.W, b0 * kWRows, std::min(p.N, b1 * kWRows), K, p.Y, p.N, p.accumulate);
                          });
  });
#endif
}

}  // namespace rlloop::engine
