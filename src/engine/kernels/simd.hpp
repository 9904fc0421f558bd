// AVX2/FMA building blocks shared by the CPU kernels. Every function carries its own target attribute, so
// callers compile for any x86-64 and choose these paths at run time (has_avx2_fma()).
//
// The level the kernels run at is the best this CPU supports, or lower where the environment variable
// RLLOOP_CPU_KERNELS caps it (native | avx512_bf16 | avx2 | portable): so one machine can run, and CI can test,
// each path a CPU of another kind would take (an AVX2-only server on an AVX-512 one). A cap above what the CPU
// has changes nothing.
//
// RLLOOP_SIMD_X86 says whether the x86 kernels are compiled at all: only for x86-64 with GCC or Clang (target
// attributes, __builtin_cpu_supports, <immintrin.h>), and not when the build asks for the portable engine
// (RLLOOP_NATIVE_KERNELS=OFF defines RLLOOP_NO_NATIVE_KERNELS). Where it is 0 has_avx2_fma() is false and every
// kernel takes its portable formulation, so that path is the one a non-x86 CPU runs and the one CI tests.
#pragma once
#if defined(__x86_64__) && defined(__GNUC__) && !defined(RLLOOP_NO_NATIVE_KERNELS)
#define RLLOOP_SIMD_X86 1
#include <immintrin.h>
#else
#define RLLOOP_SIMD_X86 0
#endif

#include <cstdint>

namespace rlloop::engine::simd {

// Ordered: each level's kernels need what the levels below it need.
enum class KernelLevel { portable, avx2, avx512_bf16 };

// The best level this CPU (and build) supports, capped by RLLOOP_CPU_KERNELS; an unknown value of the variable
// throws rlloop::invalid_argument naming it and the levels (simd.cpp). Read once per process.
KernelLevel detect_kernel_level();
const char* to_string(KernelLevel level);

inline KernelLevel kernel_level() {
  static const KernelLevel level = detect_kernel_level();
  return level;
}

inline bool has_avx2_fma() { return kernel_level() >= KernelLevel::avx2; }

// Where a few-row product's results go (small_gemm.cpp, bf16_gemm.cpp): Y [rows, ldy], each result written, or
// added to what is there with `accumulate`.
struct ProductOutput {
  float* Y;
  std::int64_t ldy;
  bool accumulate;

  void store(std::int64_t m, std::int64_t n, float v) const {
    float& y = Y[m * ldy + n];
    y = accumulate ? y + v : v;
  }
#if RLLOOP_SIMD_X86
  // The 4 lanes of v to rows m..m+3 of column n.
  void store_column(std::int64_t m, std::int64_t n, __m128 v) const {
    alignas(16) float f[4];
    _mm_store_ps(f, v);
    for (int i = 0; i < 4; ++i) store(m + i, n, f[i]);
  }
  // The 4 lanes of v to columns n..n+3 of row m.
  void store_row(std::int64_t m, std::int64_t n, __m128 v) const {
    alignas(16) float f[4];
    _mm_store_ps(f, v);
    for (int i = 0; i < 4; ++i) store(m, n + i, f[i]);
  }
#endif
};

#if RLLOOP_SIMD_X86

// Sum of the 8 lanes.
__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// [sum(a0) sum(a1) sum(a2) sum(a3)]: four horizontal sums at once. hadd pairs neighbouring lanes
// ([a0 a0 a1 a1 | a0 a0 a1 a1] etc.); then the two 128-bit halves add up.
__attribute__((target("avx2,fma"))) inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// Largest of the 8 lanes.
__attribute__((target("avx2,fma"))) inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// e^x for x <= 0 (values minus their maximum), 8 lanes: e^x = 2^n e^r with n = round(x / ln 2) and
// |r| <= ln(2) / 2, e^r from its degree-6 Taylor polynomial (relative error < 2e-7, about one ulp); inputs
// below -87 (and -inf) give 0 instead of a denormal.
__attribute__((target("avx2,fma"))) inline __m256 exp_nonpositive(__m256 x) {
  const __m256 lower = _mm256_set1_ps(-87.0f);
  const __m256 underflow = _mm256_cmp_ps(x, lower, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lower);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // r = x - n ln2 with ln2 split in a high part exact in float and a low correction (Cody-Waite).
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 poly = _mm256_set1_ps(1.0f / 720);
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(1.0f / 120));
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(1.0f / 24));
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(1.0f / 6));
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(0.5f));
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(1.0f));
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(1.0f));
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 result = _mm256_mul_ps(poly, _mm256_castsi256_ps(pow2n));
  return _mm256_andnot_ps(underflow, result);
}

#endif  // RLLOOP_SIMD_X86

}  // namespace rlloop::engine::simd
