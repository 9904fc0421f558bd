// fp32 to ggml's Q4_K and Q6_K super-blocks (ggml-common.h's block_q4_K and block_q6_K; QK_K = 256).
//
// Q4_K: 8 sub-blocks of 32 values, each value d * sc * q - dmin * m with q in 0..15, the sub-block's sc and m
// 6 bits each, d and dmin halves. Q6_K: 16 sub-blocks of 16 values, each d * sc * (q - 32) with q in 0..63, sc a
// signed byte, d a half. Each sub-block's own (scale, offset) is chosen by a small search: inverse scales around
// the one that maps the sub-block's range onto the codes, each followed by the least-squares scale (and offset) of
// the codes it gives, keeping the pair of least squared error. The super-block's d (and dmin) then puts the largest
// of those on the top 6-bit (or 8-bit) code, each sub-block's scale is rounded against d as stored (a half), and
// the values once more against the scales as stored.
// Compiled without floating-point contraction, so that every build writes the same bytes.
#include "quantize_k.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#include <rlloop/gguf.hpp>

namespace rlloop::gguf::detail {
namespace {

// v rounded to the nearest integer in [lo, hi] (NaN to lo: a garbage value, never undefined behaviour).
int code(float v, int lo, int hi) {
  if (!(v > static_cast<float>(lo))) return lo;
  if (v >= static_cast<float>(hi)) return hi;
  return static_cast<int>(std::nearbyint(v));
}

void put_half(std::uint8_t* p, float v) {
  const std::uint16_t h = float_to_half(v);
  p[0] = static_cast<std::uint8_t>(h & 0xFF);
  p[1] = static_cast<std::uint8_t>(h >> 8);
}

// The candidate inverse scales of the search: the range-filling one times (top + step / 10) / top.
constexpr int kSearchSteps = 10;

// --- Q4_K ------------------------------------------------------------------------------------------------------

constexpr int kQ4Sub = 32;   // values per sub-block
constexpr int kQ4Top = 15;   // the largest 4-bit code
constexpr int kScaleTop = 63;  // the largest 6-bit scale or min

// x ~ scale * q - offset, q in 0..15. Both are stored as unsigned multiples (of d and dmin), so the sub-block's
// lowest representable value, -offset, is never above zero.
struct Affine {
  float scale = 0, offset = 0;
};

double affine_error(const float* x, const Affine& a) {
  double err = 0;
  for (int i = 0; i < kQ4Sub; ++i) {
    const int q = a.scale > 0 ? code((x[i] + a.offset) / a.scale, 0, kQ4Top) : 0;
    const double e = static_cast<double>(a.scale) * q - a.offset - x[i];
    err += e * e;
  }
  return err;
}

Affine fit_affine(const float* x) {
  float lo = x[0], hi = x[0];
  for (int i = 1; i < kQ4Sub; ++i) lo = std::min(lo, x[i]), hi = std::max(hi, x[i]);
  lo = std::min(lo, 0.0f);
  if (!(hi > lo)) return {0.0f, -lo};  // every value is lo (<= 0)
  Affine best{(hi - lo) / kQ4Top, -lo};
  double best_error = affine_error(x, best);
  for (int step = -kSearchSteps; step <= kSearchSteps; ++step) {
    const float inverse = (kQ4Top + 0.1f * static_cast<float>(step)) / (hi - lo);
    double n = kQ4Sub, sq = 0, sqq = 0, sx = 0, sqx = 0;
    for (int i = 0; i < kQ4Sub; ++i) {
      const double q = code((x[i] - lo) * inverse, 0, kQ4Top);
      sq += q, sqq += q * q, sx += x[i], sqx += q * x[i];
    }
    const double det = n * sqq - sq * sq;
    if (!(det > 0)) continue;  // one code for every value: no slope to fit
    double scale = (n * sqx - sq * sx) / det, shift = (sqq * sx - sq * sqx) / det;
    if (shift > 0) shift = 0, scale = sqx / sqq;  // the offset may not go below zero
    if (!(scale > 0)) continue;
    const Affine a{static_cast<float>(scale), static_cast<float>(-shift)};
    if (const double e = affine_error(x, a); e < best_error) best = a, best_error = e;
  }
  return best;
}

// --- Q6_K ------------------------------------------------------------------------------------------------------

constexpr int kQ6Sub = 16;  // values per sub-block
constexpr int kQ6Low = -32, kQ6High = 31;  // q - 32
constexpr int kQ6ScaleTop = 127;

double symmetric_error(const float* x, float scale) {
  double err = 0;
  for (int i = 0; i < kQ6Sub; ++i) {
    const int q = scale != 0 ? code(x[i] / scale, kQ6Low, kQ6High) : 0;
    const double e = static_cast<double>(scale) * q - x[i];
    err += e * e;
  }
  return err;
}

// x ~ scale * q, q in -32..31: the value of largest magnitude goes to -32 (the side with one more code), so the
// scale takes that value's opposite sign.
float fit_symmetric(const float* x) {
  float extreme = 0;
  for (int i = 0; i < kQ6Sub; ++i)
    if (std::fabs(x[i]) > std::fabs(extreme)) extreme = x[i];
  if (extreme == 0) return 0.0f;
  float best = extreme / kQ6Low;
  double best_error = symmetric_error(x, best);
  for (int step = -kSearchSteps; step <= kSearchSteps; ++step) {
    const float inverse = (kQ6Low - 0.1f * static_cast<float>(step)) / extreme;
    double sqq = 0, sqx = 0;
    for (int i = 0; i < kQ6Sub; ++i) {
      const double q = code(x[i] * inverse, kQ6Low, kQ6High);
      sqq += q * q, sqx += q * x[i];
    }
    if (!(sqq > 0)) continue;
    const auto scale = static_cast<float>(sqx / sqq);
    if (const double e = symmetric_error(x, scale); e < best_error) best = scale, best_error = e;
  }
  return best;
}

}  // namespace

// block_q4_K {half d, dmin; uint8 scales[12]; uint8 qs[128]}. scales: sub-blocks 0..3 keep their scale in the low
// 6 bits of bytes 0..3 and their min in those of bytes 4..7; sub-blocks 4..7 keep the low 4 bits of scale and min
// in the two nibbles of bytes 8..11, and their top 2 bits in the top 2 bits of bytes 0..3 (scale) and 4..7 (min).
// qs: 32 bytes per 64 values, the first 32 values in the low nibbles.
void quantize_q4_k_block(const float* x, std::uint8_t* out) {
  constexpr int kSubs = kSuperBlock / kQ4Sub;
  Affine fits[kSubs];
  float top_scale = 0, top_offset = 0;
  for (int j = 0; j < kSubs; ++j) {
    fits[j] = fit_affine(x + kQ4Sub * j);
    top_scale = std::max(top_scale, fits[j].scale);
    top_offset = std::max(top_offset, fits[j].offset);
  }
  const float d = top_scale / kScaleTop, dmin = top_offset / kScaleTop;
  put_half(out, d);
  put_half(out + 2, dmin);
  const float stored_d = half_to_float(float_to_half(d)), stored_dmin = half_to_float(float_to_half(dmin));
  std::uint8_t* scales = out + 4;
  std::uint8_t* qs = out + 16;
  std::memset(scales, 0, 12 + kSuperBlock / 2);
  for (int j = 0; j < kSubs; ++j) {
    const int sc = stored_d > 0 ? code(fits[j].scale / stored_d, 0, kScaleTop) : 0;
    const int m = stored_dmin > 0 ? code(fits[j].offset / stored_dmin, 0, kScaleTop) : 0;
    if (j < 4) {
      scales[j] = static_cast<std::uint8_t>(sc);
      scales[j + 4] = static_cast<std::uint8_t>(m);
    } else {
      scales[j + 4] = static_cast<std::uint8_t>((sc & 0xF) | (m & 0xF) << 4);
      scales[j - 4] |= static_cast<std::uint8_t>((sc >> 4) << 6);
      scales[j] |= static_cast<std::uint8_t>((m >> 4) << 6);
    }
    // The values against the scale and min as the dequantizer will compute them.
    const float dl = stored_d * static_cast<float>(sc), ml = stored_dmin * static_cast<float>(m);
    for (int e = kQ4Sub * j; e < kQ4Sub * (j + 1); ++e) {
      const int q = dl > 0 ? code((x[e] + ml) / dl, 0, kQ4Top) : 0;
      qs[(e / 64) * 32 + e % 32] |= static_cast<std::uint8_t>(q << (4 * ((e % 64) / 32)));
    }
  }
}

// block_q6_K {uint8 ql[128]; uint8 qh[64]; int8 scales[16]; half d}. ql: the low 4 bits, 64 bytes per 128 values,
// the first 64 in the low nibbles; qh: the top 2 bits, 32 bytes per 128 values, the four runs of 32 at bit shifts
// 0, 2, 4, 6.
void quantize_q6_k_block(const float* x, std::uint8_t* out) {
  constexpr int kSubs = kSuperBlock / kQ6Sub;
  float fits[kSubs];
  float top = 0;
  for (int j = 0; j < kSubs; ++j) {
    fits[j] = fit_symmetric(x + kQ6Sub * j);
    top = std::max(top, std::fabs(fits[j]));
  }
  const float d = top / kQ6ScaleTop;
  const float stored_d = half_to_float(float_to_half(d));
  std::uint8_t* ql = out;
  std::uint8_t* qh = out + 128;
  std::memset(out, 0, 192);
  for (int j = 0; j < kSubs; ++j) {
    const int sc = stored_d > 0 ? code(fits[j] / stored_d, -kQ6ScaleTop, kQ6ScaleTop) : 0;
    out[192 + j] = static_cast<std::uint8_t>(static_cast<std::int8_t>(sc));
    const float dl = stored_d * static_cast<float>(sc);
    for (int e = kQ6Sub * j; e < kQ6Sub * (j + 1); ++e) {
      const int q = (dl != 0 ? code(x[e] / dl, kQ6Low, kQ6High) : 0) - kQ6Low;
      ql[(e / 128) * 64 + e % 64] |= static_cast<std::uint8_t>((q & 0xF) << (4 * ((e % 128) / 64)));
      qh[(e / 128) * 32 + e % 32] |= static_cast<std::uint8_t>((q >> 4) << (2 * ((e % 128) / 32)));
    }
  }
  put_half(out + 208, d);
}

}  // namespace rlloop::gguf::detail
