// The int8 products of quantized_matrix.hpp: a quantized matrix's blocks against 8-bit input blocks in integer dot
// products, with no fp32 copy of either. Reading a 4-bit matrix is then the whole cost of a decoding step's
// product, as in llama.cpp (ggml_vec_dot_q4_1_q8_1 and its siblings), instead of dequantizing every weight to fp32.
//
// For one 32-value block of a weight row (scale dw, minimum mw or none, integers qw) and of an input row (scale dx,
// integers qx, s = dx * sum(qx)):
//   Q8_0: dw dx sum(qw qx)                    qw in [-128, 127]
//   Q4_0: dw dx sum(qw qx) - 8 dw s           qw in [0, 15] (the stored nibbles; the value is qw - 8)
//   Q4_1: dw dx sum(qw qx) + mw s             qw in [0, 15]
// The integer sums are exact on every path; only the fp32 accumulation of the blocks' terms differs in order between
// the AVX2 kernel (eight lanes) and the portable one (block by block).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include <rlloop/error.hpp>

#include "kernels/product_blocks.hpp"
#include "kernels/quantized_matrix.hpp"
#include "kernels/simd.hpp"

namespace rlloop::engine {
namespace {

constexpr std::int64_t kBlock = 32;
constexpr std::int64_t kRowsPerTask = 16;  // weight rows per unit of work shared between threads
constexpr std::int64_t kInputRows = 4;     // input rows whose accumulators stay in registers together

// A block's layout: bytes, where its integers start, and how its minimum term is formed.
struct Format {
  std::int64_t bytes, quants;
  enum class Min { none, minus_eight, stored } min;
};
Format format_of(gguf::TensorType type) {
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wswitch-enum"  // a fast path for a few of GGUF's types; the others fall back
  switch (type) {
    case gguf::TensorType::q4_0: return {18, 2, Format::Min::minus_eight};
    case gguf::TensorType::q4_1: return {20, 4, Format::Min::stored};
    case gguf::TensorType::q8_0: return {34, 2, Format::Min::none};
    default: throw invalid_argument("int8 products: no integer kernel for " + gguf::to_string(type));
  }
#pragma GCC diagnostic pop
}

float half(const std::uint8_t* p) {
  std::uint16_t h;
  std::memcpy(&h, p, 2);
  return gguf::half_to_float(h);
}

// The minimum's coefficient of a block (multiplies the input block's s).
float block_min(const Format& f, const std::uint8_t* block, float d) {
  if (f.min == Format::Min::minus_eight) return -8.0f * d;
  if (f.min == Format::Min::stored) return half(block + 2);
  return 0.0f;
}

// Weight rows [n0, n1) against every input row, one block at a time with integer sums.
void rows_portable(const QuantizedMatrix& w, const Int8Rows& X, std::int64_t n0, std::int64_t n1, float* Y,
                   bool accumulate) {
  const Format f = format_of(w.type());
  const std::int64_t blocks = w.cols() / kBlock, row_bytes = w.blocks().size(1), N = w.rows();
  const bool nibbles = w.type() != gguf::TensorType::q8_0;
  for (std::int64_t n = n0; n < n1; ++n) {
    const std::uint8_t* row = w.blocks().data_ptr<std::uint8_t>() + n * row_bytes;
    for (std::int64_t m = 0; m < X.rows; ++m) {
      float acc = 0.0f;
      for (std::int64_t b = 0; b < blocks; ++b) {
        const std::uint8_t* block = row + b * f.bytes;
        const std::int8_t* x = X.q.data() + m * X.cols + b * kBlock;
        std::int32_t sum = 0;
        for (int j = 0; j < kBlock; ++j) {
          const int q = nibbles ? (j < 16 ? block[f.quants + j] & 0xF : block[f.quants + j - 16] >> 4)
                                : static_cast<std::int8_t>(block[f.quants + j]);
          sum += q * x[j];
        }
        const float d = half(block);
        acc += d * X.d[m * blocks + b] * static_cast<float>(sum) + block_min(f, block, d) * X.s[m * blocks + b];
      }
      float& y = Y[m * N + n];
      y = accumulate ? y + acc : acc;
    }
  }
}

#if RLLOOP_SIMD_X86
#define RLLOOP_INT8_TARGET __attribute__((target("avx2,fma,f16c")))

RLLOOP_INT8_TARGET inline float half_f16c(const std::uint8_t* p) {
  std::uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// The 32 weights of a block as bytes in element order: the 4-bit formats' nibbles (low ones are elements 0..15),
// or Q8_0's signed bytes.
template <gguf::TensorType T>
RLLOOP_INT8_TARGET inline __m256i block_weights(const std::uint8_t* quants) {
  if constexpr (T == gguf::TensorType::q8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quants));
  } else {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(quants));
    const __m128i mask = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask), _mm_and_si128(bytes, mask));
  }
}

// Eight int32 partial sums of the block's 32 products (maddubs multiplies unsigned by signed bytes: Q8_0's signed
// weights go in as their absolute values, with their signs moved onto the inputs).
template <gguf::TensorType T>
RLLOOP_INT8_TARGET inline __m256 block_dot(__m256i w, const std::int8_t* x_block) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x_block));
  __m256i pairs;
  if constexpr (T == gguf::TensorType::q8_0)
    pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
  else
    pairs = _mm256_maddubs_epi16(w, x);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

template <gguf::TensorType T>
RLLOOP_INT8_TARGET void rows_avx2(const QuantizedMatrix& w, const Int8Rows& X, std::int64_t n0, std::int64_t n1,
                                  float* Y, bool accumulate) {
  const Format f = format_of(T);
  const std::int64_t blocks = w.cols() / kBlock, row_bytes = w.blocks().size(1), N = w.rows();
  const std::uint8_t* matrix = w.blocks().data_ptr<std::uint8_t>();
  const std::int8_t* xq = X.q.data();
  const float *xd = X.d.data(), *xs = X.s.data();
  for (std::int64_t n = n0; n < n1; ++n) {
    const std::uint8_t* row = matrix + n * row_bytes;
    for (std::int64_t m0 = 0; m0 < X.rows; m0 += kInputRows) {
      const std::int64_t rows = std::min(kInputRows, X.rows - m0);
      __m256 acc[kInputRows] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
      float mins[kInputRows] = {0.0f, 0.0f, 0.0f, 0.0f};
      for (std::int64_t b = 0; b < blocks; ++b) {
        const std::uint8_t* block = row + b * f.bytes;
        const float d = half_f16c(block);
        const float min = T == gguf::TensorType::q4_1 ? half_f16c(block + 2) : -8.0f * d;
        const __m256i weights = block_weights<T>(block + f.quants);
        for (std::int64_t r = 0; r < rows; ++r) {
          const std::int64_t m = m0 + r, at = m * blocks + b;
          const __m256 sums = block_dot<T>(weights, xq + m * X.cols + b * kBlock);
          acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * xd[at]), sums, acc[r]);
          if constexpr (T != gguf::TensorType::q8_0) mins[r] += min * xs[at];
        }
      }
      for (std::int64_t r = 0; r < rows; ++r) {
        float& y = Y[(m0 + r) * N + n];
        const float v = simd::hsum(acc[r]) + mins[r];
        y = accumulate ? y + v : v;
      }
    }
  }
}
#endif  // RLLOOP_SIMD_X86

void int8_rows(const QuantizedMatrix& w, const Int8Rows& X, std::int64_t n0, std::int64_t n1, float* Y,
               bool accumulate) {
#if RLLOOP_SIMD_X86
  if (simd::has_avx2_fma()) {
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wswitch-enum"  // a fast path for a few of GGUF's types; the others fall back
    switch (w.type()) {
      case gguf::TensorType::q4_0: return rows_avx2<gguf::TensorType::q4_0>(w, X, n0, n1, Y, accumulate);
      case gguf::TensorType::q4_1: return rows_avx2<gguf::TensorType::q4_1>(w, X, n0, n1, Y, accumulate);
      case gguf::TensorType::q8_0: return rows_avx2<gguf::TensorType::q8_0>(w, X, n0, n1, Y, accumulate);
      default: break;
    }
#pragma GCC diagnostic pop
  }
#endif
  rows_portable(w, X, n0, n1, Y, accumulate);
}

}  // namespace

Int8Rows Int8Rows::quantize(const float* X, std::int64_t rows, std::int64_t cols) {
  if (cols % kBlock != 0)
    throw invalid_argument("Int8Rows: " + std::to_string(cols) + " values per row are not whole blocks of 32");
  Int8Rows out;
  out.rows = rows;
  out.cols = cols;
  out.q.resize(rows * cols);
  out.d.resize(rows * cols / kBlock);
  out.s.resize(rows * cols / kBlock);
  for (std::int64_t i = 0; i < rows * cols / kBlock; ++i) {
    const float* x = X + i * kBlock;
    float amax = 0.0f;
    for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::abs(x[j]));
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    std::int32_t sum = 0;
    for (int j = 0; j < kBlock; ++j) {
      const auto q = static_cast<std::int8_t>(std::lround(x[j] * id));
      out.q[i * kBlock + j] = q;
      sum += q;
    }
    out.d[i] = d;
    out.s[i] = d * static_cast<float>(sum);
  }
  return out;
}

bool QuantizedMatrix::int8_products() const {
  return type_ == gguf::TensorType::q4_0 || type_ == gguf::TensorType::q4_1 || type_ == gguf::TensorType::q8_0;
}

void QuantizedMatrix::multiply_group_int8(const Int8Rows& X, std::span<const Product> products) {
  if (products.empty() || X.rows <= 0) return;
  for (const Product& p : products)
    if (!p.weight->int8_products() || p.weight->cols() != X.cols)
      throw invalid_argument("QuantizedMatrix::multiply_group_int8: a " + gguf::to_string(p.weight->type()) + " [" +
                             std::to_string(p.weight->rows()) + ", " + std::to_string(p.weight->cols()) +
                             "] matrix against input rows of " + std::to_string(X.cols));
  const auto tasks_of = [](const Product& p) { return (p.weight->rows() + kRowsPerTask - 1) / kRowsPerTask; };
  std::int64_t tasks = 0;
  for (const Product& p : products) tasks += tasks_of(p);
  // ~1M multiply-adds per grain, as the fp32 products.
  const std::int64_t grain = std::max<std::int64_t>(1, (1 << 20) / (X.rows * X.cols * kRowsPerTask));
  product_blocks::parallel(tasks, grain, [&](std::int64_t begin, std::int64_t end) {
    product_blocks::visit(products, begin, end, tasks_of, [&](const Product& p, std::int64_t t0, std::int64_t t1) {
      int8_rows(*p.weight, X, t0 * kRowsPerTask, std::min(p.weight->rows(), t1 * kRowsPerTask), p.Y, p.accumulate);
    });
  });
}

}  // namespace rlloop::engine
