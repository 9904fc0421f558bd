// ggml's block formats to fp32, element for element as ggml's dequantize_row_* computes them (the same products
// and sums in fp32, in the same order; this file is compiled without floating-point contraction, so that no FMA
// changes a rounding). Block layouts: ggml-common.h (block_q4_0, ..., block_q6_K, block_mxfp4); QK_K = 256.
#include <bit>
#include <cstring>

#include <rlloop/error.hpp>
#include <rlloop/gguf.hpp>

namespace rlloop::gguf {
namespace {

constexpr int kQK = 32;    // elements of a Q4_0 ... Q8_0 block
constexpr int kQKK = 256;  // elements of a K-quant super-block

std::uint16_t u16(const std::uint8_t* p) { return static_cast<std::uint16_t>(p[0] | (p[1] << 8)); }
float f16(const std::uint8_t* p) { return half_to_float(u16(p)); }
std::uint32_t u32(const std::uint8_t* p) {
  return static_cast<std::uint32_t>(p[0]) | static_cast<std::uint32_t>(p[1]) << 8 |
         static_cast<std::uint32_t>(p[2]) << 16 | static_cast<std::uint32_t>(p[3]) << 24;
}

// The j-th 4-bit value of 32 packed in 16 bytes: the low nibbles are elements 0..15, the high ones 16..31.
int nibble(const std::uint8_t* qs, int j) { return j < 16 ? qs[j] & 0xF : qs[j - 16] >> 4; }

// block_q4_0 {half d; uint8 qs[16]}: (q - 8) * d.
void q4_0(const std::uint8_t* b, float* y) {
  const float d = f16(b);
  for (int j = 0; j < kQK; ++j) y[j] = static_cast<float>(nibble(b + 2, j) - 8) * d;
}
// block_q4_1 {half d, m; uint8 qs[16]}: q * d + m.
void q4_1(const std::uint8_t* b, float* y) {
  const float d = f16(b), m = f16(b + 2);
  for (int j = 0; j < kQK; ++j) y[j] = static_cast<float>(nibble(b + 4, j)) * d + m;
}
// block_q5_0 {half d; uint8 qh[4]; uint8 qs[16]}: bit j of qh is the fifth bit of element j; (q - 16) * d.
void q5_0(const std::uint8_t* b, float* y) {
  const float d = f16(b);
  const std::uint32_t qh = u32(b + 2);
  for (int j = 0; j < kQK; ++j) {
    const int q = nibble(b + 6, j) | static_cast<int>((qh >> j) & 1u) << 4;
    y[j] = static_cast<float>(q - 16) * d;
  }
}
// block_q5_1 {half d, m; uint8 qh[4]; uint8 qs[16]}: q * d + m.
void q5_1(const std::uint8_t* b, float* y) {
  const float d = f16(b), m = f16(b + 2);
  const std::uint32_t qh = u32(b + 4);
  for (int j = 0; j < kQK; ++j) {
    const int q = nibble(b + 8, j) | static_cast<int>((qh >> j) & 1u) << 4;
    y[j] = static_cast<float>(q) * d + m;
  }
}
// block_q8_0 {half d; int8 qs[32]}: q * d.
void q8_0(const std::uint8_t* b, float* y) {
  const float d = f16(b);
  for (int j = 0; j < kQK; ++j) y[j] = static_cast<float>(static_cast<std::int8_t>(b[2 + j])) * d;
}

// The 2-bit value of element e (0..255) in a K-quant's 64 bytes of 2-bit values: 32 bytes per 128 elements, the
// four 32-element runs of each taking the bits at shifts 0, 2, 4, 6.
int crumb(const std::uint8_t* qs, int e) { return (qs[(e / 128) * 32 + e % 32] >> (2 * ((e % 128) / 32))) & 3; }
// The 4-bit value of element e in 128 bytes: 32 bytes per 64 elements, low nibbles first.
int k_nibble(const std::uint8_t* qs, int e) { return (qs[(e / 64) * 32 + e % 32] >> (4 * ((e % 64) / 32))) & 0xF; }

// block_q2_K {uint8 scales[16]; uint8 qs[64]; half d, dmin}: per 16 elements a 4-bit scale and a 4-bit min;
// d * scale * q - dmin * min.
void q2_k(const std::uint8_t* b, float* y) {
  const std::uint8_t* scales = b;
  const std::uint8_t* qs = b + 16;
  const float d = f16(b + 80), dmin = f16(b + 82);
  for (int e = 0; e < kQKK; ++e) {
    const std::uint8_t sc = scales[e / 16];
    const float dl = d * static_cast<float>(sc & 0xF), ml = dmin * static_cast<float>(sc >> 4);
    y[e] = dl * static_cast<float>(crumb(qs, e)) - ml;
  }
}

// block_q3_K {uint8 hmask[32]; uint8 qs[64]; uint8 scales[12]; half d}: per 16 elements a 6-bit signed scale (low
// 4 bits from scales[0..7], high 2 from scales[8..11]); q = the 2-bit value, less 4 where its hmask bit is clear.
void q3_k(const std::uint8_t* b, float* y) {
  const std::uint8_t* hmask = b;
  const std::uint8_t* qs = b + 32;
  const std::uint8_t* scales = b + 96;
  const float d = f16(b + 108);
  for (int e = 0; e < kQKK; ++e) {
    const int i = e / 16;
    const int low = (scales[i % 8] >> (4 * (i / 8))) & 0xF, high = (scales[8 + i % 4] >> (2 * (i / 4))) & 3;
    const float dl = d * static_cast<float>((low | high << 4) - 32);
    const int q = crumb(qs, e) - (((hmask[e % 32] >> (e / 32)) & 1) ? 0 : 4);
    y[e] = dl * static_cast<float>(q);
  }
}

// Q4_K and Q5_K's 8 scales and 8 mins of 6 bits, packed in 12 bytes (ggml's get_scale_min_k4).
void scale_min_k4(const std::uint8_t* s, int j, int& scale, int& min) {
  if (j < 4) {
    scale = s[j] & 63;
    min = s[j + 4] & 63;
  } else {
    scale = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// block_q4_K {half d, dmin; uint8 scales[12]; uint8 qs[128]}: per 32 elements d * scale * q - dmin * min.
void q4_k(const std::uint8_t* b, float* y) {
  const float d = f16(b), dmin = f16(b + 2);
  const std::uint8_t* qs = b + 16;
  for (int j = 0; j < 8; ++j) {
    int scale = 0, min = 0;
    scale_min_k4(b + 4, j, scale, min);
    const float dl = d * static_cast<float>(scale), ml = dmin * static_cast<float>(min);
    for (int e = 32 * j; e < 32 * (j + 1); ++e) y[e] = dl * static_cast<float>(k_nibble(qs, e)) - ml;
  }
}

// block_q5_K {half d, dmin; uint8 scales[12]; uint8 qh[32]; uint8 qs[128]}: as Q4_K with a fifth bit per element,
// bit e / 32 of qh[e % 32].
void q5_k(const std::uint8_t* b, float* y) {
  const float d = f16(b), dmin = f16(b + 2);
  const std::uint8_t* qh = b + 16;
  const std::uint8_t* qs = b + 48;
  for (int j = 0; j < 8; ++j) {
    int scale = 0, min = 0;
    scale_min_k4(b + 4, j, scale, min);
    const float dl = d * static_cast<float>(scale), ml = dmin * static_cast<float>(min);
    for (int e = 32 * j; e < 32 * (j + 1); ++e) {
      const int q = k_nibble(qs, e) | ((qh[e % 32] >> (e / 32)) & 1) << 4;
      y[e] = dl * static_cast<float>(q) - ml;
    }
  }
}

// block_q6_K {uint8 ql[128]; uint8 qh[64]; int8 scales[16]; half d}: 4 low bits in ql (64 bytes per 128
// elements, low nibbles first), 2 high bits in qh (2-bit values as Q2_K lays them out); d * scale * (q - 32).
void q6_k(const std::uint8_t* b, float* y) {
  const std::uint8_t* ql = b;
  const std::uint8_t* qh = b + 128;
  const float d = f16(b + 208);
  for (int e = 0; e < kQKK; ++e) {
    const float dl = d * static_cast<float>(static_cast<std::int8_t>(b[192 + e / 16]));
    const int low = (ql[(e / 128) * 64 + e % 64] >> (4 * ((e % 128) / 64))) & 0xF;
    y[e] = dl * static_cast<float>((low | crumb(qh, e) << 4) - 32);
  }
}

// block_mxfp4 {uint8 e; uint8 qs[16]}: FP4 E2M1 codes, element j in qs[j]'s low nibble and j + 16 in its high one,
// times the E8M0 scale 2^(e - 127). ggml keeps the codes' values doubled (kvalues_mxfp4) and halves the scale
// (GGML_E8M0_TO_FP32_HALF), exactly.
void mxfp4(const std::uint8_t* b, float* y) {
  static constexpr std::int8_t kValues[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
  const std::uint32_t e = b[0];
  const float d = std::bit_cast<float>(e < 2 ? 0x00200000u << e : (e - 1) << 23);
  for (int j = 0; j < kQK / 2; ++j) {
    y[j] = static_cast<float>(kValues[b[1 + j] & 0x0F]) * d;
    y[j + kQK / 2] = static_cast<float>(kValues[b[1 + j] >> 4]) * d;
  }
}

using BlockFn = void (*)(const std::uint8_t*, float*);
BlockFn block_fn(TensorType type) {
  switch (type) {
    case TensorType::q4_0: return q4_0;
    case TensorType::q4_1: return q4_1;
    case TensorType::q5_0: return q5_0;
    case TensorType::q5_1: return q5_1;
    case TensorType::q8_0: return q8_0;
    case TensorType::q2_k: return q2_k;
    case TensorType::q3_k: return q3_k;
    case TensorType::q4_k: return q4_k;
    case TensorType::q5_k: return q5_k;
    case TensorType::q6_k: return q6_k;
    case TensorType::mxfp4: return mxfp4;
    case TensorType::f32:
    case TensorType::f16:
    case TensorType::bf16: return nullptr;
  }
  return nullptr;
}

}  // namespace

float half_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exponent = (h >> 10) & 0x1Fu;
  std::uint32_t mantissa = h & 0x3FFu;
  std::uint32_t bits = 0;
  if (exponent == 0x1F) {
    bits = sign | 0x7F800000u | mantissa << 13;  // infinity, NaN
  } else if (exponent != 0) {
    bits = sign | (exponent + 112) << 23 | mantissa << 13;
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: mantissa * 2^-24, normalised
    std::uint32_t shifts = 0;
    while (!(mantissa & 0x400u)) mantissa <<= 1, ++shifts;
    bits = sign | (113 - shifts) << 23 | (mantissa & 0x3FFu) << 13;
  }
  return std::bit_cast<float>(bits);
}

float bf16_to_float(std::uint16_t b) { return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16); }

void dequantize(TensorType type, std::span<const std::uint8_t> blocks, std::span<float> out) {
  const auto layout = block_layout(type);
  if (!layout) throw invalid_argument("gguf: cannot dequantize tensor type " + to_string(type));
  const auto n = static_cast<std::int64_t>(out.size());
  if (n % layout->elements != 0)
    throw invalid_argument("gguf: " + std::to_string(n) + " values of " + to_string(type) + " are not whole blocks of " +
                           std::to_string(layout->elements));
  const std::int64_t count = n / layout->elements;
  if (static_cast<std::int64_t>(blocks.size()) != count * layout->bytes)
    throw invalid_argument("gguf: " + std::to_string(count) + " blocks of " + to_string(type) + " take " +
                           std::to_string(count * layout->bytes) + " bytes, not " + std::to_string(blocks.size()));
  const std::uint8_t* in = blocks.data();
  float* y = out.data();
  switch (type) {
    case TensorType::f32:
      std::memcpy(y, in, blocks.size());  // GGUF is little-endian, as this machine
      return;
    case TensorType::f16:
      for (std::int64_t i = 0; i < n; ++i) y[i] = half_to_float(u16(in + 2 * i));
      return;
    case TensorType::bf16:
      for (std::int64_t i = 0; i < n; ++i) y[i] = bf16_to_float(u16(in + 2 * i));
      return;
    default:
      break;
  }
  const BlockFn fn = block_fn(type);
  for (std::int64_t i = 0; i < count; ++i) fn(in + i * layout->bytes, y + i * layout->elements);
}

}  // namespace rlloop::gguf
