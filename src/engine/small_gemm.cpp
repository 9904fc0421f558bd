#include "small_gemm.hpp"

#include <ATen/Parallel.h>

#include "blas.hpp"
#include "simd.hpp"

namespace rlloop::engine {
namespace {

constexpr std::int64_t kMaxRows = 64;  // beyond this BLAS's packing pays for itself
constexpr std::int64_t kWRows = 4;     // W rows per block: 4 x 2 accumulators + 6 loads fit the 16 ymm registers

using simd::hsum;

// Output columns [n0, n1): blocks of 4 W rows against pairs of X rows; K is a multiple of 8.
__attribute__((target("avx2,fma"))) void kernel(const float* X, std::int64_t M, const float* W, std::int64_t n0,
                                                std::int64_t n1, std::int64_t K, float* Y, std::int64_t ldy,
                                                bool accumulate) {
  auto store = [&](std::int64_t m, std::int64_t n, float v) {
    float& y = Y[m * ldy + n];
    y = accumulate ? y + v : v;
  };
  std::int64_t n = n0;
  for (; n + kWRows <= n1; n += kWRows) {
    const float* w0 = W + n * K;
    const float *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
    // The next block's weights (contiguous with these) are prefetched a slice per pass over X, so they arrive
    // while this block computes instead of stalling the next one on memory latency.
    const float* next = n + 2 * kWRows <= n1 ? w0 + kWRows * K : nullptr;
    const std::int64_t lines = kWRows * K / 16, per_pass = (lines + M / 2 - 1) / std::max<std::int64_t>(1, M / 2);
    std::int64_t m = 0;
    for (; m + 2 <= M; m += 2) {
      const float *x0 = X + m * K, *x1 = x0 + K;
      __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
      if (next)
        for (std::int64_t line = m / 2 * per_pass, end = std::min(lines, line + per_pass); line < end; ++line)
          _mm_prefetch(reinterpret_cast<const char*>(next + line * 16), _MM_HINT_T0);
      for (std::int64_t k = 0; k < K; k += 8) {
        const __m256 v0 = _mm256_loadu_ps(x0 + k), v1 = _mm256_loadu_ps(x1 + k);
        __m256 w = _mm256_loadu_ps(w0 + k);
        a00 = _mm256_fmadd_ps(w, v0, a00), a01 = _mm256_fmadd_ps(w, v1, a01);
        w = _mm256_loadu_ps(w1 + k);
        a10 = _mm256_fmadd_ps(w, v0, a10), a11 = _mm256_fmadd_ps(w, v1, a11);
        w = _mm256_loadu_ps(w2 + k);
        a20 = _mm256_fmadd_ps(w, v0, a20), a21 = _mm256_fmadd_ps(w, v1, a21);
        w = _mm256_loadu_ps(w3 + k);
        a30 = _mm256_fmadd_ps(w, v0, a30), a31 = _mm256_fmadd_ps(w, v1, a31);
      }
      store(m, n, hsum(a00)), store(m + 1, n, hsum(a01));
      store(m, n + 1, hsum(a10)), store(m + 1, n + 1, hsum(a11));
      store(m, n + 2, hsum(a20)), store(m + 1, n + 2, hsum(a21));
      store(m, n + 3, hsum(a30)), store(m + 1, n + 3, hsum(a31));
    }
    for (; m < M; ++m) {  // an odd last row
      const float* x0 = X + m * K;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (std::int64_t k = 0; k < K; k += 8) {
        const __m256 v0 = _mm256_loadu_ps(x0 + k);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + k), v0, a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + k), v0, a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + k), v0, a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + k), v0, a3);
      }
      store(m, n, hsum(a0)), store(m, n + 1, hsum(a1)), store(m, n + 2, hsum(a2)), store(m, n + 3, hsum(a3));
    }
  }
  for (; n < n1; ++n) {  // the last N % 4 columns
    const float* w0 = W + n * K;
    for (std::int64_t m = 0; m < M; ++m) {
      __m256 a = _mm256_setzero_ps();
      for (std::int64_t k = 0; k < K; k += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + k), _mm256_loadu_ps(X + m * K + k), a);
      store(m, n, hsum(a));
    }
  }
}


}  // namespace

bool small_gemm_applies(std::int64_t M, std::int64_t K) {
  return M <= kMaxRows && K % 8 == 0 && simd::has_avx2_fma();
}

void linear_rows(const float* X, std::int64_t M, const float* W, std::int64_t N, std::int64_t K, float* Y,
                 bool accumulate) {
  if (!small_gemm_applies(M, K)) {
    blas::gemm<float>(false, true, M, N, K, 1.0f, X, K, W, K, accumulate ? 1.0f : 0.0f, Y, N);
    return;
  }
  // Split the columns across threads only when there is enough work (~1M multiply-adds per chunk): small
  // products stay on the calling thread, where a parallel region would cost more than it saves.
  const std::int64_t cols_per_chunk = std::max<std::int64_t>(kWRows, ((1 << 20) / std::max<std::int64_t>(1, M * K)) / kWRows * kWRows);
  at::parallel_for(0, (N + cols_per_chunk - 1) / cols_per_chunk, 1, [&](std::int64_t begin, std::int64_t end) {
    kernel(X, M, W, begin * cols_per_chunk, std::min(N, end * cols_per_chunk), K, Y, N, accumulate);
  });
}

}  // namespace rlloop::engine
