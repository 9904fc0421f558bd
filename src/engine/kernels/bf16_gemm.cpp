#include "kernels/bf16_gemm.hpp"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <new>

#include <rlloop/error.hpp>

#include "kernels/product_blocks.hpp"
#include "kernels/simd.hpp"
#include "kernels/small_gemm.hpp"

namespace rlloop::engine {

bool bf16_dot_supported() { return simd::kernel_level() >= simd::KernelLevel::avx512_bf16; }

namespace {

constexpr std::int64_t kStep = 32;  // bf16 values per 512-bit register (one cache line)

std::int64_t padded(std::int64_t cols) { return (cols + kStep - 1) / kStep * kStep; }

#if RLLOOP_SIMD_X86
#define RLLOOP_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")))

constexpr std::int64_t kWRows = 4;  // 4 W rows x 4 X rows: 16 accumulators + 4 W + 1 X of the 32 zmm registers
constexpr std::int64_t kXRows = 4;

std::uint16_t* bits(const torch::Tensor& bf16) { return reinterpret_cast<std::uint16_t*>(bf16.data_ptr()); }

// The calling thread's buffer for rounded input rows, 64-byte aligned (the kernel's 512-bit loads), kept
// across calls instead of a LibTorch tensor per product (an allocation and a dispatch, dozens per decoding
// step). The threads of the product's parallel region only read it while the caller waits for them.
std::uint16_t* rounded_input_scratch(std::int64_t values) {
  struct Free {
    void operator()(std::uint16_t* p) const { std::free(p); }
  };
  thread_local std::unique_ptr<std::uint16_t, Free> buffer;
  thread_local std::int64_t capacity = 0;
  if (values > capacity) {
    const std::int64_t grown = std::max(values, 2 * capacity);
    const auto bytes = static_cast<std::size_t>((grown * 2 + 63) / 64 * 64);  // aligned_alloc wants a multiple
    auto* fresh = static_cast<std::uint16_t*>(std::aligned_alloc(64, bytes));
    if (!fresh) throw std::bad_alloc();  // the old buffer and capacity stay valid
    buffer.reset(fresh);
    capacity = grown;
  }
  return buffer.get();
}

// Rows are 64-byte aligned when LibTorch's allocator aligns as it does on x86 (c10: 64 bytes), which is what
// makes these loads fast; the unaligned instruction costs nothing then and stays correct under any allocator.
RLLOOP_BF16_TARGET inline __m512bh load(const std::uint16_t* p) {
  return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p));  // same bits, bf16 view
}

RLLOOP_BF16_TARGET inline __m256 fold(__m512 v) {  // 16 lanes -> 8 partial sums
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

// Sums of 4 accumulators, in lanes 0..3.
RLLOOP_BF16_TARGET inline __m128 hsum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  return simd::hsum4(fold(a0), fold(a1), fold(a2), fold(a3));
}

// Rows [m0, m1) of X [M, K] fp32 -> bf16 rows of `stride` values, zero past K (those lanes are masked off, and
// their address clamped to the row's end). Rounds to nearest even; vcvtneps2bf16 also flushes denormal inputs
// to zero.
RLLOOP_BF16_TARGET void round_rows(const float* X, std::int64_t m0, std::int64_t m1, std::int64_t K, std::uint16_t* out,
                                   std::int64_t stride) {
  for (std::int64_t m = m0; m < m1; ++m) {
    const float* x = X + m * K;
    std::uint16_t* o = out + m * stride;
    for (std::int64_t k = 0; k < stride; k += 16) {
      const std::int64_t left = std::max<std::int64_t>(0, K - k);
      const auto in = static_cast<__mmask16>(left >= 16 ? 0xFFFF : (1u << left) - 1u);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + k),
                          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(in, x + std::min(k, K)))));
    }
  }
}

// Output columns [n0, n1) of Y = X W^T, both operands bf16 rows of `stride` values (zero-padded, aligned).
// Same shape of loop as small_gemm.cpp's kernel: each block of W rows is read from memory once and stays in
// L1 while every group of X rows passes over it; the next block is prefetched a slice per pass.
RLLOOP_BF16_TARGET void kernel(const std::uint16_t* X, std::int64_t M, const std::uint16_t* W, std::int64_t n0,
                               std::int64_t n1, std::int64_t stride, float* Y, std::int64_t ldy, bool accumulate) {
  const simd::ProductOutput out{Y, ldy, accumulate};
  const std::int64_t passes = std::max<std::int64_t>(1, (M + kXRows - 1) / kXRows);
  const std::int64_t lines = kWRows * stride / kStep, per_pass = (lines + passes - 1) / passes;
  std::int64_t n = n0;
  for (; n + kWRows <= n1; n += kWRows) {
    const std::uint16_t* w0 = W + n * stride;
    const std::uint16_t *w1 = w0 + stride, *w2 = w1 + stride, *w3 = w2 + stride;
    const std::uint16_t* next = n + 2 * kWRows <= n1 ? w0 + kWRows * stride : nullptr;
    for (std::int64_t m = 0, pass = 0; m < M; m += kXRows, ++pass) {
      if (next)
        for (std::int64_t line = pass * per_pass, end = std::min(lines, line + per_pass); line < end; ++line)
          _mm_prefetch(reinterpret_cast<const char*>(next + line * kStep), _MM_HINT_T0);
      if (m + kXRows <= M) {
        const std::uint16_t *x0 = X + m * stride, *x1 = x0 + stride, *x2 = x1 + stride, *x3 = x2 + stride;
        __m512 a00 = _mm512_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, a13 = a00,
               a20 = a00, a21 = a00, a22 = a00, a23 = a00, a30 = a00, a31 = a00, a32 = a00, a33 = a00;
        for (std::int64_t k = 0; k < stride; k += kStep) {
          const __m512bh v0 = load(w0 + k), v1 = load(w1 + k), v2 = load(w2 + k), v3 = load(w3 + k);
          __m512bh x = load(x0 + k);
          a00 = _mm512_dpbf16_ps(a00, v0, x), a10 = _mm512_dpbf16_ps(a10, v1, x);
          a20 = _mm512_dpbf16_ps(a20, v2, x), a30 = _mm512_dpbf16_ps(a30, v3, x);
          x = load(x1 + k);
          a01 = _mm512_dpbf16_ps(a01, v0, x), a11 = _mm512_dpbf16_ps(a11, v1, x);
          a21 = _mm512_dpbf16_ps(a21, v2, x), a31 = _mm512_dpbf16_ps(a31, v3, x);
          x = load(x2 + k);
          a02 = _mm512_dpbf16_ps(a02, v0, x), a12 = _mm512_dpbf16_ps(a12, v1, x);
          a22 = _mm512_dpbf16_ps(a22, v2, x), a32 = _mm512_dpbf16_ps(a32, v3, x);
          x = load(x3 + k);
          a03 = _mm512_dpbf16_ps(a03, v0, x), a13 = _mm512_dpbf16_ps(a13, v1, x);
          a23 = _mm512_dpbf16_ps(a23, v2, x), a33 = _mm512_dpbf16_ps(a33, v3, x);
        }
        out.store_column(m, n, hsum4(a00, a01, a02, a03));
        out.store_column(m, n + 1, hsum4(a10, a11, a12, a13));
        out.store_column(m, n + 2, hsum4(a20, a21, a22, a23));
        out.store_column(m, n + 3, hsum4(a30, a31, a32, a33));
        continue;
      }
      for (std::int64_t r = m; r < M; ++r) {  // the last M % 4 rows
        const std::uint16_t* x0 = X + r * stride;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (std::int64_t k = 0; k < stride; k += kStep) {
          const __m512bh x = load(x0 + k);
          a0 = _mm512_dpbf16_ps(a0, load(w0 + k), x), a1 = _mm512_dpbf16_ps(a1, load(w1 + k), x);
          a2 = _mm512_dpbf16_ps(a2, load(w2 + k), x), a3 = _mm512_dpbf16_ps(a3, load(w3 + k), x);
        }
        out.store_row(r, n, hsum4(a0, a1, a2, a3));
      }
    }
  }
  for (; n < n1; ++n) {  // the last N % 4 columns
    const std::uint16_t* w0 = W + n * stride;
    for (std::int64_t m = 0; m < M; ++m) {
      __m512 a = _mm512_setzero_ps();
      for (std::int64_t k = 0; k < stride; k += kStep) a = _mm512_dpbf16_ps(a, load(w0 + k), load(X + m * stride + k));
      out.store(m, n, _mm512_reduce_add_ps(a));
    }
  }
}
#endif  // RLLOOP_SIMD_X86

}  // namespace

Bf16Weight::Bf16Weight(const float* W, std::int64_t rows, std::int64_t cols, Storage storage)
    : rows_(rows), cols_(cols), stride_(padded(cols)) {
  if (storage == Storage::best) storage = bf16_dot_supported() ? Storage::bf16 : Storage::widened;
  if (storage == Storage::bf16 && !bf16_dot_supported())
    throw invalid_argument(
        "Bf16Weight: bf16 storage needs a CPU with AVX512_BF16 and a build with RLLOOP_NATIVE_KERNELS=ON");
  const std::int64_t grain = std::max<std::int64_t>(1, (1 << 16) / std::max<std::int64_t>(1, cols));
#if RLLOOP_SIMD_X86
  if (storage == Storage::bf16) {
    bf16_ = torch::empty({rows, stride_}, torch::kBFloat16);
    at::parallel_for(0, rows, grain, [&](std::int64_t begin, std::int64_t end) {
      round_rows(W, begin, end, cols, bits(bf16_), stride_);
    });
    return;
  }
#endif
  widened_ = torch::empty({rows, cols}, torch::kFloat32);
  float* out = widened_.data_ptr<float>();
  at::parallel_for(0, rows * cols, grain * cols, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t i = begin; i < end; ++i) out[i] = from_bf16(to_bf16(W[i]));
  });
}

void Bf16Weight::multiply(const float* X, std::int64_t M, float* Y, bool accumulate) const {
  const Bf16Product product{this, Y, accumulate};
  multiply_group(X, M, {&product, 1});
}

void Bf16Weight::multiply_group(const float* X, std::int64_t M, std::span<const Bf16Product> products) {
  if (products.empty()) return;
  const Bf16Weight& first = *products.front().weight;
  const std::int64_t K = first.cols_;
  for (const Bf16Product& p : products)
    if (p.weight->cols_ != K || p.weight->stored_as_bf16() != first.stored_as_bf16())
      throw invalid_argument(
          "Bf16Weight::multiply_group: the weights of one group must have the same columns and storage");
  if (!first.stored_as_bf16()) {
    std::vector<std::uint16_t> bits16(M * K);
    to_bf16(X, bits16.data(), M * K);
    std::vector<float> rounded(M * K);
    for (std::int64_t i = 0; i < M * K; ++i) rounded[i] = from_bf16(bits16[i]);
    std::vector<RowProduct> widened;
    for (const Bf16Product& p : products)
      widened.push_back({p.weight->widened_.data_ptr<float>(), p.weight->rows_, p.Y, p.accumulate});
    linear_rows_group(rounded.data(), M, K, widened);
    return;
  }
#if RLLOOP_SIMD_X86
  const std::int64_t stride = first.stride_;
  std::uint16_t* x = rounded_input_scratch(M * stride);
  round_rows(X, 0, M, K, x, stride);
  // Blocks of kWRows columns shared between the threads as product_blocks.hpp says; the grain is ~1M
  // multiply-adds.
  const auto blocks_of = [](const Bf16Product& p) { return (p.weight->rows_ + kWRows - 1) / kWRows; };
  std::int64_t blocks = 0;
  for (const Bf16Product& p : products) blocks += blocks_of(p);
  const std::int64_t grain = std::max<std::int64_t>(1, (1 << 20) / std::max<std::int64_t>(1, M * K * kWRows));
  product_blocks::parallel(blocks, grain, [&](std::int64_t begin, std::int64_t end) {
    product_blocks::visit(products, begin, end, blocks_of, [&](const Bf16Product& p, std::int64_t b0, std::int64_t b1) {
      const std::int64_t N = p.weight->rows_;
      kernel(x, M, bits(p.weight->bf16_), b0 * kWRows, std::min(N, b1 * kWRows), stride, p.Y, N, p.accumulate);
    });
  });
#endif
}

}  // namespace rlloop::engine
