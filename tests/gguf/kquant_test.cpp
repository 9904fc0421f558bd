// rlloop's Q4_K and Q6_K quantizer (src/gguf/quantize_k.cpp) against the format and rlloop's dequantizer (itself
// held to gguf-py's bit for bit by gguf_reference_test): values that lie on a super-block's grid come back exactly,
// with the scale bytes spelled out by hand from ggml's layout; random values come back within each format's
// error; a fixed input gives the same bytes in every build (golden hashes); edge cases and wrong sizes.
// kquant_reference_test.py reads the same blocks with gguf-py.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <vector>

#include <rlloop/error.hpp>
#include <rlloop/gguf.hpp>

using namespace rlloop;
using gguf::TensorType;

namespace {

std::vector<float> round_trip(TensorType type, const std::vector<float>& x) {
  const auto bytes = gguf::quantize(type, x);
  std::vector<float> y(x.size());
  gguf::dequantize(type, bytes, y);
  return y;
}

std::uint16_t u16(const std::vector<std::uint8_t>& b, std::size_t at) {
  return static_cast<std::uint16_t>(b[at] | b[at + 1] << 8);
}

// FNV-1a over the bytes: a golden value for a whole tensor.
std::uint64_t fnv1a(const std::vector<std::uint8_t>& bytes) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (auto b : bytes) h = (h ^ b) * 0x100000001b3ull;
  return h;
}

// A fixed pseudo-random input as model weights are: uniform values in [-1, 1) times a magnitude per super-block
// (0.05 to 10) varied by up to 2x per 16 values, plus an offset per 32 values (so that the Q4_K mins matter).
std::vector<float> fixed_input(std::size_t n) {
  std::vector<float> x(n);
  std::uint32_t s = 12345;
  auto next = [&] {
    s = s * 1664525u + 1013904223u;
    return static_cast<float>(s >> 8) / 16777216.0f;  // [0, 1)
  };
  float magnitude = 1, local = 1, offset = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (i % 256 == 0) magnitude = 0.05f * std::pow(200.0f, next());
    if (i % 16 == 0) local = magnitude * (0.5f + 0.5f * next());
    if (i % 32 == 0) offset = (next() - 0.5f) * 0.5f * magnitude;
    x[i] = (2 * next() - 1) * local + offset;
  }
  return x;
}

}  // namespace

// Each sub-block j holds sc_j / 32 * q - m_j / 64 for every 4-bit q: d = 1/32 and dmin = 1/64 are what the largest
// scale (63) and min (63) make, the sub-blocks' search finds their exact scale and min, and every value comes back.
TEST(KQuants, Q4KValuesOnTheGridComeBackExactly) {
  const int sc[8] = {63, 1, 17, 40, 33, 16, 50, 7}, m[8] = {5, 63, 0, 20, 48, 31, 1, 60};
  std::vector<float> x(256);
  for (int e = 0; e < 256; ++e) {
    const int j = e / 32, q = (7 * e + j) % 16;  // each sub-block takes every code (twice)
    x[e] = static_cast<float>(sc[j]) / 32 * static_cast<float>(q) - static_cast<float>(m[j]) / 64;
  }
  const auto b = gguf::quantize(TensorType::q4_k, x);
  ASSERT_EQ(b.size(), 144u);
  EXPECT_EQ(u16(b, 0), 0x2800);  // d = 2^-5
  EXPECT_EQ(u16(b, 2), 0x2400);  // dmin = 2^-6
  // Sub-blocks 0..3: scale and min in the low 6 bits of bytes 0..3 and 4..7. Sub-blocks 4..7: low nibbles of scale
  // and min in bytes 8..11, their top 2 bits above those of bytes 0..3 (scale) and 4..7 (min). By hand: sub-block 4
  // (scale 33 = 0b10'0001, min 48 = 0b11'0000) gives byte 8 = 0x01, 0b10 over byte 0 (63 -> 0xBF), 0b11 over byte 4
  // (5 -> 0xC5); and so on.
  const std::vector<std::uint8_t> scales = {0xBF, 0x41, 0xD1, 0x28, 0xC5, 0x7F, 0x00, 0xD4, 0x01, 0xF0, 0x12, 0xC7};
  EXPECT_EQ(std::vector<std::uint8_t>(b.begin() + 4, b.begin() + 16), scales);
  // qs: byte k holds value 64 (k / 32) + k % 32 in its low nibble and the value 32 after it in its high one.
  EXPECT_EQ(b[16 + 0], 0x10);   // values 0 (q 0) and 32 (q 1)
  EXPECT_EQ(b[16 + 1], 0x87);   // values 1 (q 7) and 33 (q 8)
  EXPECT_EQ(b[16 + 32], 0x32);  // values 64 (q 2) and 96 (q 3)
  EXPECT_EQ(round_trip(TensorType::q4_k, x), x);
}

// Each sub-block j of 16 holds 2^-7 * sc_j * q' with q' in -32..31 (its first value -32): d = 2^-7 puts the largest
// |scale|, 127, on the top code; the negative scales are stored as signed bytes.
TEST(KQuants, Q6KValuesOnTheGridComeBackExactly) {
  const int sc[16] = {127, -3, 64, -127, 1, 90, -45, 12, 33, -100, 7, 55, -8, 110, 2, -64};
  std::vector<float> x(256);
  for (int e = 0; e < 256; ++e) {
    const int j = e / 16, q = e % 16 == 0 ? -32 : (e * 37 + j) % 64 - 32;
    x[e] = std::ldexp(static_cast<float>(sc[j] * q), -7);
  }
  const auto b = gguf::quantize(TensorType::q6_k, x);
  ASSERT_EQ(b.size(), 210u);
  EXPECT_EQ(u16(b, 208), 0x2000);  // d = 2^-7
  for (int j = 0; j < 16; ++j) EXPECT_EQ(static_cast<std::int8_t>(b[192 + j]), sc[j]) << j;
  // ql: low 4 bits of q = q' + 32, values 0..63 of each 128 in the low nibbles of 64 bytes, 64..127 in the high
  // ones; qh: the top 2 bits, values 0..31, 32..63, 64..95, 96..127 of each 128 at shifts 0, 2, 4, 6 of 32 bytes.
  EXPECT_EQ(b[1], 0x95);       // value 1 (q 37: low 5) and value 65 (q 41: low 9)
  EXPECT_EQ(b[2], 0xEA);       // value 2 (q 10) and value 66 (q 14)
  EXPECT_EQ(b[128 + 1], 0x22);  // top bits of values 1 (2), 33 (0), 65 (2), 97 (0)
  EXPECT_EQ(round_trip(TensorType::q6_k, x), x);
}

// Random values of many magnitudes: each format's error, relative to each sub-block's own spread, and the bytes
// of a fixed input the same in every build (the search is compiled without contraction).
TEST(KQuants, RandomValuesComeBackWithinEachFormatsError) {
  const auto x = fixed_input(256 * 64);
  struct Case {
    TensorType type;
    int sub;               // values per sub-block
    double rms, largest;   // bounds on the error relative to the sub-block's largest |value|
    std::uint64_t golden;  // FNV-1a of the bytes
  };
  // Measured: Q4_K rms 0.0293, max 0.111 (a 4-bit code's half step over a sub-block's range is 1/30 of it); Q6_K
  // rms 0.0080, max 0.0248 (half a 6-bit step: 1/64).
  for (const Case& c : {Case{TensorType::q4_k, 32, 0.035, 0.13, 0xf7854652904a6e30ull},
                        Case{TensorType::q6_k, 16, 0.0095, 0.03, 0x3c5e5a17c38b1cf4ull}}) {
    SCOPED_TRACE(gguf::to_string(c.type));
    const auto bytes = gguf::quantize(c.type, x);
    ASSERT_EQ(bytes.size(), x.size() / 256 * gguf::block_layout(c.type)->bytes);
    std::vector<float> y(x.size());
    gguf::dequantize(c.type, bytes, y);
    double sum = 0, worst = 0;
    std::size_t counted = 0;
    for (std::size_t s = 0; s < x.size(); s += c.sub) {
      float amax = 0;
      for (int i = 0; i < c.sub; ++i) amax = std::max(amax, std::fabs(x[s + i]));
      for (int i = 0; i < c.sub; ++i) {
        const double e = std::fabs(static_cast<double>(y[s + i]) - x[s + i]) / amax;
        sum += e * e, worst = std::max(worst, e), ++counted;
      }
    }
    const double rms = std::sqrt(sum / static_cast<double>(counted));
    std::printf("%s: error relative to the sub-block's largest value: rms %.5f, max %.5f; bytes' FNV-1a 0x%016llx\n",
                gguf::to_string(c.type).c_str(), rms, worst, static_cast<unsigned long long>(fnv1a(bytes)));
    EXPECT_LT(rms, c.rms);
    EXPECT_LT(worst, c.largest);
    EXPECT_EQ(fnv1a(bytes), c.golden);
  }
}

TEST(KQuants, ConstantAndZeroBlocks) {
  for (auto type : {TensorType::q4_k, TensorType::q6_k}) {
    SCOPED_TRACE(gguf::to_string(type));
    const std::vector<float> zeros(512, 0.0f);
    if (type == TensorType::q4_k) {  // (Q6_K stores a zero as code 32)
      EXPECT_EQ(gguf::quantize(type, zeros), std::vector<std::uint8_t>(2 * 144, 0));
    }
    EXPECT_EQ(round_trip(type, zeros), zeros);
    // A constant: up to the scales' precision (d a half, subnormal below 2^-14: Q6_K's d is |v| / 4064, so at
    // 0.02 a step of 1.2% of it, which the 8-bit scale brings back to 0.26%).
    for (float v : {0.5f, -0.25f, 0.02f}) {
      const auto y = round_trip(type, std::vector<float>(256, v));
      for (float got : y) ASSERT_NEAR(got, v, std::fabs(v) * 4e-3) << v;
    }
  }
}

TEST(KQuants, WrongSizesAreRefused) {
  for (auto type : {TensorType::q4_k, TensorType::q6_k}) {
    try {
      gguf::quantize(type, std::vector<float>(300));
      ADD_FAILURE() << "300 values accepted";
    } catch (const invalid_argument& e) {
      EXPECT_EQ(std::string(e.what()), "gguf: 300 values are not whole " + gguf::to_string(type) + " blocks of 256");
    }
  }
}

// The writer takes K-quant tensors (their rows whole super-blocks) and the reader gives back what the dequantizer
// gives for the same bytes.
TEST(KQuants, FilesOfKQuantTensorsReadBack) {
  const auto x = fixed_input(512 * 3);
  const auto path = (std::filesystem::temp_directory_path() / "rlloop-kquant-test.gguf").string();
  gguf::write(path, {{"general.architecture", {std::string("llama")}}},
              {{"a", {512, 3}, TensorType::q4_k, gguf::quantize(TensorType::q4_k, x)},
               {"b", {512, 3}, TensorType::q6_k, gguf::quantize(TensorType::q6_k, x)}});
  const auto file = gguf::File::open(path);
  EXPECT_EQ(file.tensor("a").type, TensorType::q4_k);
  EXPECT_EQ(file.dequantize(file.tensor("a")), round_trip(TensorType::q4_k, x));
  EXPECT_EQ(file.dequantize(file.tensor("b")), round_trip(TensorType::q6_k, x));
  std::filesystem::remove(path);
  try {
    gguf::write(path, {}, {{"c", {128, 2}, TensorType::q4_k, std::vector<std::uint8_t>(144)}});
    ADD_FAILURE() << "rows of 128 accepted as Q4_K";
  } catch (const invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()), "gguf: tensor 'c': rows of 128 are not whole Q4_K blocks of 256");
  }
}
