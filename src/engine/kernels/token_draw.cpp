#include "kernels/token_draw.hpp"

#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include <rlloop/error.hpp>

#include "kernels/simd.hpp"

namespace rlloop::engine {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr std::int64_t kBlock = 1024;  // float partial sums per block, blocks added in double

struct RowMax {
  float max = kNegInf;
  bool nan = false;
};

RowMax row_max_portable(const float* l, std::int64_t V) {
  RowMax r;
  for (std::int64_t i = 0; i < V; ++i) {
    r.nan = r.nan || std::isnan(l[i]);
    r.max = std::max(r.max, l[i]);
  }
  return r;
}

#if RLLOOP_SIMD_X86
__attribute__((target("avx2,fma"))) RowMax row_max_avx2(const float* l, std::int64_t V) {
  __m256 vmax = _mm256_set1_ps(kNegInf), unordered = _mm256_setzero_ps();
  std::int64_t i = 0;
  for (; i + 8 <= V; i += 8) {
    const __m256 x = _mm256_loadu_ps(l + i);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    vmax = _mm256_max_ps(vmax, x);
  }
  RowMax r{simd::hmax(vmax), _mm256_movemask_ps(unordered) != 0};
  const RowMax tail = row_max_portable(l + i, V - i);
  r.max = std::max(r.max, tail.max);
  r.nan = r.nan || tail.nan;
  return r;
}
#endif  // RLLOOP_SIMD_X86

// Sum of e^(l - max) (the temperature-1 normaliser); with `weights`, also stores e^((l - max) / T) there and
// returns their sum in *weight_sum.
double exp_sums_portable(const float* l, std::int64_t V, float max, float inv_t, float* weights, double* weight_sum) {
  double sum = 0.0, wsum = 0.0;
  for (std::int64_t i = 0; i < V; ++i) {
    const float x = l[i] - max;
    sum += std::exp(x);
    // A masked (-inf) logit keeps weight 0 even when 1 / T rounds to 0 (-inf * 0 is NaN).
    if (weights) wsum += (weights[i] = x == kNegInf ? 0.0f : std::exp(x * inv_t));
  }
  if (weights) *weight_sum = wsum;
  return sum;
}

#if RLLOOP_SIMD_X86
__attribute__((target("avx2,fma"))) double exp_sums_avx2(const float* l, std::int64_t V, float max, float inv_t,
                                                         float* weights, double* weight_sum) {
  const __m256 vmax = _mm256_set1_ps(max), vinv = _mm256_set1_ps(inv_t), vneginf = _mm256_set1_ps(kNegInf);
  const bool same = inv_t == 1.0f;  // temperature 1: the weights are the normaliser's terms
  double sum = 0.0, wsum = 0.0;
  std::int64_t i = 0;
  while (i + 8 <= V) {
    __m256 s = _mm256_setzero_ps(), ws = _mm256_setzero_ps();
    for (const std::int64_t end = std::min(V, i + kBlock); i + 8 <= end; i += 8) {
      const __m256 x = _mm256_sub_ps(_mm256_loadu_ps(l + i), vmax);
      const __m256 e = simd::exp_nonpositive(x);
      s = _mm256_add_ps(s, e);
      if (!weights) continue;
      // Masked (-inf) logits stay -inf after scaling, also when 1 / T rounds to 0 (-inf * 0 is NaN).
      const __m256 w = same ? e
                            : simd::exp_nonpositive(
                                  _mm256_blendv_ps(_mm256_mul_ps(x, vinv), x, _mm256_cmp_ps(x, vneginf, _CMP_EQ_OQ)));
      _mm256_storeu_ps(weights + i, w);
      ws = _mm256_add_ps(ws, w);
    }
    sum += simd::hsum(s);
    wsum += simd::hsum(ws);
  }
  double tail_wsum = 0.0;
  sum += exp_sums_portable(l + i, V - i, max, inv_t, weights ? weights + i : nullptr, &tail_wsum);
  if (weights) *weight_sum = wsum + tail_wsum;
  return sum;
}
#endif  // RLLOOP_SIMD_X86

// The row's maximum and the sums of exp_sums_portable, with the AVX2 kernels where they run.
RowMax row_max(const float* l, std::int64_t V) {
#if RLLOOP_SIMD_X86
  if (simd::has_avx2_fma()) return row_max_avx2(l, V);
#endif
  return row_max_portable(l, V);
}

double exp_sums(const float* l, std::int64_t V, float max, float inv_t, float* weights, double* weight_sum) {
#if RLLOOP_SIMD_X86
  if (simd::has_avx2_fma()) return exp_sums_avx2(l, V, max, inv_t, weights, weight_sum);
#endif
  return exp_sums_portable(l, V, max, inv_t, weights, weight_sum);
}

// The first index whose cumulative weight exceeds target; rounding can leave the scan short of a target
// just below the total, then the last index with weight.
std::int64_t invert_cdf(const float* weights, std::int64_t V, double target) {
  double cumulative = 0.0;
  std::int64_t last_positive = 0;
  for (std::int64_t i = 0; i < V; ++i) {
    if (weights[i] <= 0.0f) continue;
    cumulative += weights[i];
    if (cumulative > target) return i;
    last_positive = i;
  }
  return last_positive;
}

std::int64_t first_index_of(const float* l, std::int64_t V, float value) {
  for (std::int64_t i = 0; i < V; ++i)
    if (l[i] == value) return i;
  return 0;
}

void draw_row(const float* l, std::int64_t V, double temperature, double uniform, std::int64_t* token, float* logprob,
              std::vector<float>& scratch, std::int64_t row) {
  const RowMax m = row_max(l, V);
  if (m.nan || !std::isfinite(m.max))
    throw invalid_argument("sample: the model's logits for row " + std::to_string(row) + " of the decoding batch are " +
                           (m.nan       ? "NaN"
                            : m.max > 0 ? "+inf"
                                        : "all -inf") +
                           " (diverged weights?); no token can be drawn");
  // A temperature so small that 1 / T overflows a float is the limit T -> 0: greedy.
  const bool greedy = temperature == 0.0 || 1.0 / temperature > 1e30;
  const float inv_t = greedy ? 1.0f : static_cast<float>(1.0 / temperature);
  float* weights = greedy ? nullptr : scratch.data();
  double weight_sum = 0.0;
  const double normaliser = exp_sums(l, V, m.max, inv_t, weights, &weight_sum);
  *token = greedy ? first_index_of(l, V, m.max) : invert_cdf(weights, V, uniform * weight_sum);
  *logprob = static_cast<float>(static_cast<double>(l[*token] - m.max) - std::log(normaliser));
}

}  // namespace

void draw_tokens(const float* logits, std::int64_t rows, std::int64_t vocab, std::int64_t row_stride,
                 double temperature, const double* uniforms, std::int64_t* tokens, float* logprobs) {
  if (rows <= 0 || vocab <= 0) return;
  if (!(temperature >= 0.0) || !std::isfinite(temperature))
    throw invalid_argument("draw_tokens: temperature must be a finite number >= 0, got " + std::to_string(temperature));
  // Rows in parallel once there is enough work (a 32k-vocabulary row is ~30 us; a byte-level one ~0.3 us).
  const std::int64_t grain = std::max<std::int64_t>(1, (1 << 15) / vocab);
  at::parallel_for(0, rows, grain, [&](std::int64_t begin, std::int64_t end) {
    std::vector<float> scratch(temperature == 0.0 ? 0 : vocab);
    for (std::int64_t r = begin; r < end; ++r)
      draw_row(logits + r * row_stride, vocab, temperature, uniforms ? uniforms[r] : 0.0, tokens + r, logprobs + r,
               scratch, r);
  });
}

}  // namespace rlloop::engine
