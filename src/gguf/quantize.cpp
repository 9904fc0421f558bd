// fp32 to ggml's storage types, rounding as ggml's reference quantizers do (quantize_row_q8_0_ref and the scalar
// fp32 -> fp16 / bf16 conversions): round to nearest, ties to even for the floating-point types, and for Q8_0 a
// scale of max|x| / 127 per block of 32 with each value rounded half away from zero. The K-quants Q4_K and Q6_K
// are rlloop's own choice of scales (quantize_k.cpp), in ggml's block layouts.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>

#include <rlloop/error.hpp>
#include <rlloop/gguf.hpp>

#include "quantize_k.hpp"

namespace rlloop::gguf {
namespace {

constexpr int kQK8 = 32;

void put_u16(std::uint8_t* p, std::uint16_t v) {
  p[0] = static_cast<std::uint8_t>(v & 0xFF);
  p[1] = static_cast<std::uint8_t>(v >> 8);
}

// block_q8_0 {half d; int8 qs[32]}.
void q8_0_block(const float* x, std::uint8_t* out) {
  float amax = 0.0f;
  for (int j = 0; j < kQK8; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  put_u16(out, float_to_half(d));
  for (int j = 0; j < kQK8; ++j)
    out[2 + j] = static_cast<std::uint8_t>(static_cast<std::int8_t>(std::round(x[j] * id)));
}

}  // namespace

std::uint16_t float_to_half(float f) {
  const auto x = std::bit_cast<std::uint32_t>(f);
  const auto sign = static_cast<std::uint16_t>((x >> 16) & 0x8000u);
  const std::uint32_t abs = x & 0x7FFFFFFFu;
  if (abs >= 0x7F800000u) return sign | (abs > 0x7F800000u ? 0x7E00u : 0x7C00u);  // NaN (quiet), infinity
  if (abs >= 0x477FF000u) return sign | 0x7C00u;  // 65520 and above round to infinity
  if (abs < 0x38800000u) {                          // below 2^-14: a subnormal half, in units of 2^-24
    const float units = std::bit_cast<float>(abs) * 16777216.0f;  // exact: a power-of-two scaling
    return sign | static_cast<std::uint16_t>(std::nearbyint(units));  // ties to even; 1024 is the least normal
  }
  // A normal half: rebias the exponent, keep 10 of the 23 mantissa bits, round the 13 dropped ones to even (a
  // carry out of the mantissa moves the exponent up, as it should).
  std::uint32_t h = ((abs >> 23) - 112) << 10 | (abs & 0x7FFFFFu) >> 13;
  const std::uint32_t dropped = abs & 0x1FFFu;
  if (dropped > 0x1000u || (dropped == 0x1000u && (h & 1u))) ++h;
  return sign | static_cast<std::uint16_t>(h);
}

std::uint16_t float_to_bf16(float f) {
  const auto x = std::bit_cast<std::uint32_t>(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<std::uint16_t>((x >> 16) | 0x40u);  // NaN stays NaN
  return static_cast<std::uint16_t>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);                  // ties to even
}

std::vector<std::uint8_t> quantize(TensorType type, std::span<const float> values) {
  const auto n = values.size();
  std::vector<std::uint8_t> out;
  switch (type) {
    case TensorType::f32:
      out.resize(n * 4);
      if (n) std::memcpy(out.data(), values.data(), n * 4);  // GGUF is little-endian, as this machine
      return out;
    case TensorType::f16:
    case TensorType::bf16:
      out.resize(n * 2);
      for (std::size_t i = 0; i < n; ++i)
        put_u16(out.data() + 2 * i, type == TensorType::f16 ? float_to_half(values[i]) : float_to_bf16(values[i]));
      return out;
    case TensorType::q8_0:
      if (n % kQK8 != 0)
        throw invalid_argument("gguf: " + std::to_string(n) + " values are not whole Q8_0 blocks of 32");
      out.resize(n / kQK8 * 34);
      for (std::size_t b = 0; b < n / kQK8; ++b) q8_0_block(values.data() + b * kQK8, out.data() + b * 34);
      return out;
    case TensorType::q4_k:
    case TensorType::q6_k: {
      const auto block = static_cast<std::size_t>(block_layout(type)->bytes);
      if (n % detail::kSuperBlock != 0)
        throw invalid_argument("gguf: " + std::to_string(n) + " values are not whole " + to_string(type) +
                               " blocks of 256");
      const auto fn = type == TensorType::q4_k ? detail::quantize_q4_k_block : detail::quantize_q6_k_block;
      out.resize(n / detail::kSuperBlock * block);
      for (std::size_t b = 0; b < n / detail::kSuperBlock; ++b)
        fn(values.data() + b * detail::kSuperBlock, out.data() + b * block);
      return out;
    }
    default:
      throw invalid_argument("gguf: rlloop writes F32, F16, BF16, Q8_0, Q4_K and Q6_K tensors, not " +
                             to_string(type));
  }
}

}  // namespace rlloop::gguf
