#include "kernels/quantized_matrix.hpp"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include <rlloop/error.hpp>

#include "kernels/product_blocks.hpp"
#include "kernels/simd.hpp"
#include "kernels/small_gemm.hpp"

namespace rlloop::engine {
namespace {

#if RLLOOP_SIMD_X86
// Without "fma": the compiler must not fuse q * d + m into one rounding, which would change the values (ggml and
// gguf::dequantize round the product, then the sum). F16C converts the blocks' half scales exactly.
#define RLLOOP_DEQUANT_TARGET __attribute__((target("avx2,f16c")))

RLLOOP_DEQUANT_TARGET inline __m256 half_scale(const std::uint8_t* p) {
  std::uint16_t h;
  std::memcpy(&h, p, 2);
  return _mm256_set1_ps(_cvtsh_ss(h));
}
// Eight integers (the low 8 bytes of `q`, unsigned or signed) as floats.
RLLOOP_DEQUANT_TARGET inline __m256 u8_to_float(__m128i q) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)); }
RLLOOP_DEQUANT_TARGET inline __m256 i8_to_float(__m128i q) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)); }

// The 32 4-bit values of a block's 16 bytes as floats: low nibbles are elements 0..15, high nibbles 16..31.
struct Nibbles {
  __m256 v[4];
};
RLLOOP_DEQUANT_TARGET inline Nibbles nibbles(const std::uint8_t* qs) {
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i lo = _mm_and_si128(bytes, mask), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
  return {{u8_to_float(lo), u8_to_float(_mm_srli_si128(lo, 8)), u8_to_float(hi), u8_to_float(_mm_srli_si128(hi, 8))}};
}

// block_q4_0 {half d; uint8 qs[16]}: (q - 8) * d.
RLLOOP_DEQUANT_TARGET void q4_0_blocks(const std::uint8_t* b, std::int64_t count, float* y) {
  const __m256 eight = _mm256_set1_ps(8.0f);
  for (std::int64_t i = 0; i < count; ++i, b += 18, y += 32) {
    const __m256 d = half_scale(b);
    const Nibbles q = nibbles(b + 2);
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(y + 8 * j, _mm256_mul_ps(_mm256_sub_ps(q.v[j], eight), d));
  }
}
// block_q4_1 {half d, m; uint8 qs[16]}: q * d + m.
RLLOOP_DEQUANT_TARGET void q4_1_blocks(const std::uint8_t* b, std::int64_t count, float* y) {
  for (std::int64_t i = 0; i < count; ++i, b += 20, y += 32) {
    const __m256 d = half_scale(b), m = half_scale(b + 2);
    const Nibbles q = nibbles(b + 4);
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(y + 8 * j, _mm256_add_ps(_mm256_mul_ps(q.v[j], d), m));
  }
}
// block_q8_0 {half d; int8 qs[32]}: q * d.
RLLOOP_DEQUANT_TARGET void q8_0_blocks(const std::uint8_t* b, std::int64_t count, float* y) {
  for (std::int64_t i = 0; i < count; ++i, b += 34, y += 32) {
    const __m256 d = half_scale(b);
    for (int j = 0; j < 4; ++j) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * j));
      _mm256_storeu_ps(y + 8 * j, _mm256_mul_ps(i8_to_float(q), d));
    }
  }
}
#endif  // RLLOOP_SIMD_X86

// `count` whole blocks of `type` to fp32: the vectorised formats where this CPU runs them (the types GGUF models
// mostly use for their large matrices), gguf::dequantize for the rest.
// (`count` is unused where the x86 paths are not compiled.)
void dequantize_blocks(gguf::TensorType type, const std::uint8_t* b, [[maybe_unused]] std::int64_t count,
                       std::int64_t bytes, std::int64_t values, float* y) {
#if RLLOOP_SIMD_X86
  if (simd::has_avx2_fma()) {
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wswitch-enum"  // a fast path for a few of GGUF's types; the others fall back
    switch (type) {
      case gguf::TensorType::q4_0: return q4_0_blocks(b, count, y);
      case gguf::TensorType::q4_1: return q4_1_blocks(b, count, y);
      case gguf::TensorType::q8_0: return q8_0_blocks(b, count, y);
      default: break;
    }
#pragma GCC diagnostic pop
  }
#endif
  gguf::dequantize(type, {b, static_cast<std::size_t>(bytes)}, {y, static_cast<std::size_t>(values)});
}

// Rows of W dequantized per piece of a decoding product: about 64 KB of fp32, which stays in L2 while every input
// row passes over it; a multiple of the product kernel's 3-row blocks.
std::int64_t tile_rows(std::int64_t cols) { return std::max<std::int64_t>(3, (16384 / cols) / 3 * 3); }

// Pieces of the matrix for training's products: at most 4M values (16 MB of fp32) dequantized at a time.
constexpr std::int64_t kChunkValues = std::int64_t{1} << 22;

torch::Tensor dequantized_rows(const QuantizedMatrix& w, std::int64_t begin, std::int64_t count,
                               torch::ScalarType dtype) {
  auto out = torch::empty({count, w.cols()}, torch::kFloat32);
  float* y = out.data_ptr<float>();
  const std::int64_t grain = std::max<std::int64_t>(1, 65536 / w.cols());
  at::parallel_for(0, count, grain, [&](std::int64_t r0, std::int64_t r1) {
    w.dequantize_rows(begin + r0, begin + r1, y + r0 * w.cols());
  });
  return dtype == torch::kFloat32 ? out : out.to(dtype);
}

// y = x W^T, one piece of W's rows at a time into the matching columns of y.
torch::Tensor product(const torch::Tensor& x, const QuantizedMatrix& w) {
  const std::int64_t rows = w.rows(), step = std::max<std::int64_t>(1, kChunkValues / w.cols());
  if (step >= rows) return torch::linear(x, dequantized_rows(w, 0, rows, x.scalar_type()));
  auto sizes = x.sizes().vec();
  sizes.back() = rows;
  auto y = torch::empty(sizes, x.options());
  for (std::int64_t r0 = 0; r0 < rows; r0 += step) {
    const std::int64_t n = std::min(step, rows - r0);
    y.narrow(-1, r0, n).copy_(torch::linear(x, dequantized_rows(w, r0, n, x.scalar_type())));
  }
  return y;
}

// dx = dy W, summed over the same pieces.
torch::Tensor input_gradient(const torch::Tensor& dy, const QuantizedMatrix& w) {
  const std::int64_t rows = w.rows(), step = std::max<std::int64_t>(1, kChunkValues / w.cols());
  torch::Tensor dx;
  for (std::int64_t r0 = 0; r0 < rows; r0 += step) {
    const std::int64_t n = std::min(step, rows - r0);
    auto part = torch::matmul(dy.narrow(-1, r0, n), dequantized_rows(w, r0, n, dy.scalar_type()));
    dx = dx.defined() ? dx.add_(part) : part;
  }
  return dx;
}

// quantized_linear as an autograd function, differentiable in its input only (the quantized matrix is frozen).
class QuantizedLinear : public torch::autograd::Function<QuantizedLinear> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor x, const QuantizedMatrix* w) {
    // The matrix outlives the graph (its model does); saved_data holds IValues, so its address.
    ctx->saved_data["weight"] = static_cast<std::int64_t>(reinterpret_cast<std::intptr_t>(w));
    return product(x, *w);
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto address = static_cast<std::intptr_t>(ctx->saved_data["weight"].toInt());
    const auto* w = reinterpret_cast<const QuantizedMatrix*>(address);
    return {grads[0].defined() ? input_gradient(grads[0], *w) : torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

QuantizedMatrix::QuantizedMatrix(gguf::TensorType type, std::int64_t rows, std::int64_t cols, torch::Tensor blocks)
    : type_(type), rows_(rows), cols_(cols), blocks_(std::move(blocks)) {
  const auto layout = gguf::block_layout(type);
  if (!layout) throw invalid_argument("QuantizedMatrix: unknown tensor type " + gguf::to_string(type));
  if (rows <= 0 || cols <= 0 || cols % layout->elements != 0)
    throw invalid_argument("QuantizedMatrix: " + std::to_string(rows) + " x " + std::to_string(cols) + " values of " +
                           gguf::to_string(type) + " are not rows of whole blocks of " +
                           std::to_string(layout->elements));
  const std::int64_t row_bytes = cols / layout->elements * layout->bytes;
  if (!blocks_.device().is_cpu() || blocks_.scalar_type() != torch::kUInt8 || blocks_.dim() != 2 ||
      blocks_.size(0) != rows || blocks_.size(1) != row_bytes || !blocks_.is_contiguous())
    throw invalid_argument("QuantizedMatrix: the blocks must be a contiguous uint8 CPU tensor [" +
                           std::to_string(rows) + ", " + std::to_string(row_bytes) + "]");
}

void QuantizedMatrix::dequantize_rows(std::int64_t begin, std::int64_t end, float* out) const {
  const auto layout = *gguf::block_layout(type_);
  const std::int64_t row_bytes = blocks_.size(1), n = end - begin;
  dequantize_blocks(type_, blocks_.data_ptr<std::uint8_t>() + begin * row_bytes, n * cols_ / layout.elements,
                    n * row_bytes, n * cols_, out);
}

torch::Tensor QuantizedMatrix::dequantize() const { return dequantized_rows(*this, 0, rows_, torch::kFloat32); }

torch::Tensor QuantizedMatrix::rows_of(const torch::Tensor& ids) const {
  const auto flat = ids.to(torch::kCPU, torch::kLong).contiguous();
  auto sizes = flat.sizes().vec();
  sizes.push_back(cols_);
  auto out = torch::empty(sizes, torch::kFloat32);
  const auto* id = flat.data_ptr<std::int64_t>();
  float* y = out.data_ptr<float>();
  at::parallel_for(0, flat.numel(), std::max<std::int64_t>(1, 65536 / cols_), [&](std::int64_t i0, std::int64_t i1) {
    for (std::int64_t i = i0; i < i1; ++i) dequantize_rows(id[i], id[i] + 1, y + i * cols_);
  });
  return out;
}

void QuantizedMatrix::multiply(const float* X, std::int64_t M, float* Y, bool accumulate) const {
  const Product product{this, Y, accumulate};
  multiply_group(X, M, {&product, 1});
}

void QuantizedMatrix::multiply_group(const float* X, std::int64_t M, std::span<const Product> products) {
  if (products.empty() || M <= 0) return;
  const std::int64_t K = products.front().weight->cols(), tile = tile_rows(K);
  for (const Product& p : products)
    if (p.weight->cols() != K) throw invalid_argument("QuantizedMatrix::multiply_group: products of different inputs");
  const auto tiles_of = [&](const Product& p) { return (p.weight->rows() + tile - 1) / tile; };
  std::int64_t tiles = 0;
  for (const Product& p : products) tiles += tiles_of(p);
  // ~1M multiply-adds per grain, as linear_rows_group; dequantizing a tile costs about one input row's pass.
  const std::int64_t grain = std::max<std::int64_t>(1, (1 << 20) / ((M + 1) * K * tile));
  product_blocks::parallel(tiles, grain, [&](std::int64_t begin, std::int64_t end) {
    std::vector<float> W(tile * K);
    product_blocks::visit(products, begin, end, tiles_of, [&](const Product& p, std::int64_t t0, std::int64_t t1) {
      const QuantizedMatrix& w = *p.weight;
      for (std::int64_t t = t0; t < t1; ++t) {
        const std::int64_t r0 = t * tile, n = std::min(tile, w.rows() - r0);
        w.dequantize_rows(r0, r0 + n, W.data());
        linear_rows_serial(X, M, W.data(), n, K, p.Y + r0, w.rows(), p.accumulate);
      }
    });
  });
}

torch::Tensor quantized_linear(const torch::Tensor& x, std::shared_ptr<const QuantizedMatrix> w) {
  if (!x.device().is_cpu() || x.size(-1) != w->cols())
    throw invalid_argument("quantized_linear: the input must be a CPU tensor [..., " + std::to_string(w->cols()) + "]");
  return QuantizedLinear::apply(x, w.get());
}

}  // namespace rlloop::engine
