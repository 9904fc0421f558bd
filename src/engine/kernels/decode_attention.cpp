#include "kernels/decode_attention.hpp"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/bf16.hpp"
#include "kernels/simd.hpp"

namespace rlloop::engine {
namespace {

// Where the keys (or values) of one (sequence, KV head) lie: position j's row of D values at row(j). Contiguous
// (`blocks` null: row j at base + j * stride) or paged (row j in block blocks[j / kKVBlockTokens], at offset
// j % kKVBlockTokens, rows `stride` apart in a block).
template <class T>
struct KVRows {
  const T* base;
  const std::int64_t* blocks;
  std::int64_t stride;
  const T* row(std::int64_t j) const {
    return base + (blocks ? blocks[j / kKVBlockTokens] * kKVBlockTokens + j % kKVBlockTokens : j) * stride;
  }
};

// The cached keys and values are fp32 or bf16 (the bf16 sampling precision); arithmetic is fp32 either way.
inline float widen(float v) { return v; }
inline float widen(std::uint16_t b) { return from_bf16(b); }

// Portable version. Eight partial sums make the dot product vectorisable without reassociating one float.
template <class T>
float dot(const float* a, const T* b, std::int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * widen(b[i + l]);
  float sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) sum += a[i] * widen(b[i]);
  return sum;
}

template <class T>
void attend_portable(const float* q, KVRows<T> K, KVRows<T> V, std::int64_t S, std::int64_t D, float scale, float* p,
                     float* out) {
  float mx = -std::numeric_limits<float>::infinity();
  for (std::int64_t j = 0; j < S; ++j) mx = std::max(mx, p[j] = dot(q, K.row(j), D) * scale);
  float sum = 0;
  for (std::int64_t j = 0; j < S; ++j) sum += (p[j] = std::exp(p[j] - mx));
  std::fill_n(out, D, 0.0f);
  for (std::int64_t j = 0; j < S; ++j) {
    const float pj = p[j] / sum;
    const T* v = V.row(j);
    for (std::int64_t d = 0; d < D; ++d) out[d] += pj * widen(v[d]);
  }
}

#if RLLOOP_SIMD_X86
using simd::exp_nonpositive;
using simd::hsum;

__attribute__((target("avx2,fma"))) inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2,fma"))) inline __m256 load8(const std::uint16_t* p) { return simd::from_bf16(p); }

// D a multiple of 8 (every head_dim in practice).
template <class T>
__attribute__((target("avx2,fma"))) void attend_avx2(const float* q, KVRows<T> K, KVRows<T> V, std::int64_t S,
                                                     std::int64_t D, float scale, float* p, float* out) {
  // Scores, four keys per pass: one load of q feeds four FMAs; the four sums are reduced together. Four keys from
  // a multiple of 4 lie in one block (kKVBlockTokens is a multiple of 4), so they are `stride` apart.
  std::int64_t j = 0;
  for (; j + 4 <= S; j += 4) {
    const T *k0 = K.row(j), *k1 = k0 + K.stride, *k2 = k1 + K.stride, *k3 = k2 + K.stride;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (std::int64_t d = 0; d < D; d += 8) {
      const __m256 qv = _mm256_loadu_ps(q + d);
      a0 = _mm256_fmadd_ps(load8(k0 + d), qv, a0);
      a1 = _mm256_fmadd_ps(load8(k1 + d), qv, a1);
      a2 = _mm256_fmadd_ps(load8(k2 + d), qv, a2);
      a3 = _mm256_fmadd_ps(load8(k3 + d), qv, a3);
    }
    const __m128 sums = simd::hsum4(a0, a1, a2, a3);
    _mm_storeu_ps(p + j, _mm_mul_ps(sums, _mm_set1_ps(scale)));
  }
  for (; j < S; ++j) {
    __m256 a = _mm256_setzero_ps();
    for (std::int64_t d = 0; d < D; d += 8) a = _mm256_fmadd_ps(load8(K.row(j) + d), _mm256_loadu_ps(q + d), a);
    p[j] = hsum(a) * scale;
  }
  float mx = -std::numeric_limits<float>::infinity();
  for (std::int64_t i = 0; i < S; ++i) mx = std::max(mx, p[i]);
  // Probabilities (unnormalised), 8 at a time.
  const __m256 vmx = _mm256_set1_ps(mx);
  __m256 vsum = _mm256_setzero_ps();
  std::int64_t i = 0;
  for (; i + 8 <= S; i += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(p + i), vmx));
    _mm256_storeu_ps(p + i, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  float sum = hsum(vsum);
  for (; i < S; ++i) sum += (p[i] = std::exp(p[i] - mx));
  // out = (sum_j p_j V_j) / sum, 64 columns of out in registers at a time: one pass over V for head_dim 64.
  const __m256 inv = _mm256_set1_ps(1.0f / sum);
  for (std::int64_t d0 = 0; d0 < D; d0 += 64) {
    const std::int64_t width = std::min<std::int64_t>(64, D - d0);
    __m256 o[8];
    for (__m256& acc : o) acc = _mm256_setzero_ps();
    for (std::int64_t jj = 0; jj < S; ++jj) {
      const __m256 pj = _mm256_set1_ps(p[jj]);
      const T* v = V.row(jj) + d0;
      for (std::int64_t c = 0; c < width / 8; ++c) o[c] = _mm256_fmadd_ps(pj, load8(v + 8 * c), o[c]);
    }
    for (std::int64_t c = 0; c < width / 8; ++c) _mm256_storeu_ps(out + d0 + 8 * c, _mm256_mul_ps(o[c], inv));
  }
}
#endif  // RLLOOP_SIMD_X86

template <class T>
void attend(const float* q, KVRows<T> K, KVRows<T> V, std::int64_t S, std::int64_t D, float scale, float* p,
            float* out) {
#if RLLOOP_SIMD_X86
  if (D % 8 == 0 && simd::has_avx2_fma()) return attend_avx2(q, K, V, S, D, scale, p, out);
#endif
  attend_portable(q, K, V, S, D, scale, p, out);
}

}  // namespace

void attend_row(const float* q, const float* K, const float* V, std::int64_t S, std::int64_t D, float scale, float* p,
                float* out) {
  attend(q, KVRows<float>{K, nullptr, D}, KVRows<float>{V, nullptr, D}, S, D, scale, p, out);
}

void attend_row(const float* q, const std::uint16_t* K, const std::uint16_t* V, std::int64_t S, std::int64_t D,
                float scale, float* p, float* out) {
  attend(q, KVRows<std::uint16_t>{K, nullptr, D}, KVRows<std::uint16_t>{V, nullptr, D}, S, D, scale, p, out);
}

template <class T>
void attend_paged(const float* q, const T* keys, const T* values, const PagedRows& rows, std::int64_t nh,
                  std::int64_t nkv, std::int64_t D, float scale, float* out) {
  const std::int64_t rep = nh / nkv, row_stride = nkv * D;
  std::int64_t longest = 1;
  for (std::int64_t r = 0; r < rows.rows; ++r) longest = std::max(longest, rows.lengths[r]);
  // In parallel only with enough work: a parallel region costs more than a small model's whole attention.
  const std::int64_t per_chunk = std::max<std::int64_t>(1, (1 << 18) / (longest * D));
  at::parallel_for(0, rows.rows * nh, per_chunk, [&](std::int64_t begin, std::int64_t end) {
    std::vector<float> p(static_cast<std::size_t>(longest));
    for (std::int64_t item = begin; item < end; ++item) {
      const std::int64_t r = item / nh, kv = (item % nh) / rep;
      const std::int64_t* blocks = rows.tables + r * rows.table_stride;
      attend(q + item * D, KVRows<T>{keys + kv * D, blocks, row_stride}, KVRows<T>{values + kv * D, blocks, row_stride},
             rows.lengths[r], D, scale, p.data(), out + item * D);
    }
  });
}
template void attend_paged(const float*, const float*, const float*, const PagedRows&, std::int64_t, std::int64_t,
                           std::int64_t, float, float*);
template void attend_paged(const float*, const std::uint16_t*, const std::uint16_t*, const PagedRows&, std::int64_t,
                           std::int64_t, std::int64_t, float, float*);

}  // namespace rlloop::engine
