// bfloat16 values as their 16 bits (the top half of a float): rounding floats to them and widening them back.
// Header-only and free of LibTorch, for the kernels that store bf16 (bf16_gemm.cpp, the bf16 KV cache of
// cpu_decoder.cpp and decode_attention.cpp).
#pragma once
#include <bit>
#include <cmath>
#include <cstdint>

#include "kernels/simd.hpp"

namespace rlloop::engine {

// The bf16 nearest to f (ties to even), as its 16 bits; NaN stays a (quiet) NaN. (The AVX512_BF16 path
// rounds with vcvtneps2bf16, which is the same except that it flushes denormal inputs to zero.)
inline std::uint16_t to_bf16(float f) {
  const auto u = std::bit_cast<std::uint32_t>(f);
  if (std::isnan(f)) return static_cast<std::uint16_t>((u >> 16) | 0x40);  // keep it a (quiet) NaN
  // Adding 0x7FFF plus the lowest kept bit rounds to nearest with ties to even; a carry into the exponent is
  // the correct rounding up (and turns the largest finite values into infinity, as it should).
  return static_cast<std::uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// The float with those bf16 bits (exact).
inline float from_bf16(std::uint16_t b) { return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16); }

#if RLLOOP_SIMD_X86
namespace simd {

// to_bf16 of 8 floats, the same bits.
__attribute__((target("avx2,fma"))) inline __m128i to_bf16(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i high = _mm256_srli_epi32(u, 16);
  const __m256i lowest_kept = _mm256_and_si256(high, _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lowest_kept), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_or_si256(high, _mm256_set1_epi32(0x40)), nan);
  // 32-bit lanes (all below 2^16) to 16 bits: packus works per 128-bit half, then qwords 0 and 2 hold them.
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0b1000));
}

// 8 bf16 values widened to floats (exact).
__attribute__((target("avx2,fma"))) inline __m256 from_bf16(const std::uint16_t* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

__attribute__((target("avx2,fma"))) inline void to_bf16_avx2(const float* x, std::uint16_t* out, std::int64_t n) {
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), simd::to_bf16(_mm256_loadu_ps(x + i)));
  for (; i < n; ++i) out[i] = engine::to_bf16(x[i]);
}

}  // namespace simd
#endif  // RLLOOP_SIMD_X86

// out[i] = to_bf16(x[i]) for n values.
inline void to_bf16(const float* x, std::uint16_t* out, std::int64_t n) {
#if RLLOOP_SIMD_X86
  if (simd::has_avx2_fma()) return simd::to_bf16_avx2(x, out, n);
#endif
  for (std::int64_t i = 0; i < n; ++i) out[i] = to_bf16(x[i]);
}

}  // namespace rlloop::engine
