// A frozen weight matrix kept in the block format its GGUF file stores it in (Q4_1, Q8_0, the K-quants, F16, ...),
// dequantized where it is used instead of once at load: the base of LoRA sessions on a GGUF model takes its file's
// size in memory (SmolLM2-135M's Q4_1/Q8_0 weights: 0.13 of their fp32 size) while the adapters train in fp32.
//
// Every use sees exactly the values gguf::dequantize gives (the fast row paths below are checked against it bit for
// bit), so a model over quantized matrices computes what the same model with those matrices dequantized to fp32
// computes, up to the order of the products' sums:
// - training and prefill (quantized_linear): the matrix dequantized per call, in pieces of at most kChunkValues,
//   into an ordinary product; backward dequantizes again for the input's gradient (the matrix has none);
// - decoding (multiply, multiply_group): a few rows of the matrix at a time dequantized into a buffer the size of
//   the L1/L2 caches and multiplied there by every input row, so the fp32 matrix never exists in memory;
// - embeddings (rows): the looked-up rows only.
// CPU only: on other devices a GGUF base is dequantized at load (gguf_model.hpp).
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <rlloop/gguf.hpp>

namespace rlloop::engine {

// Input rows quantized to 8 bits per block of 32 values, as ggml's Q8_1 holds them (d = max |x| / 127,
// q = round(x / d), s = d * sum(q)): the other operand of the int8 products.
struct Int8Rows {
  std::int64_t rows = 0, cols = 0;  // cols: a multiple of 32
  std::vector<std::int8_t> q;       // [rows, cols]
  std::vector<float> d, s;          // [rows, cols / 32]
  static Int8Rows quantize(const float* X, std::int64_t rows, std::int64_t cols);
};

class QuantizedMatrix {
 public:
  // `blocks`: uint8 [rows, bytes per row] on the CPU, each row `cols` values of `type` (whole blocks).
  QuantizedMatrix(gguf::TensorType type, std::int64_t rows, std::int64_t cols, torch::Tensor blocks);

  gguf::TensorType type() const { return type_; }
  std::int64_t rows() const { return rows_; }
  std::int64_t cols() const { return cols_; }
  std::int64_t bytes() const { return blocks_.numel(); }
  // The stored blocks, row by row (for hashing and comparing; never written).
  const torch::Tensor& blocks() const { return blocks_; }

  // Rows [begin, end) as fp32 into out [end - begin, cols].
  void dequantize_rows(std::int64_t begin, std::int64_t end, float* out) const;
  // The whole matrix as fp32 [rows, cols].
  torch::Tensor dequantize() const;
  // Embedding lookup: the rows `ids` (int64, any shape, CPU) name, fp32 [ids..., cols]. Ids are not checked
  // (the model checks them against the vocabulary first).
  torch::Tensor rows_of(const torch::Tensor& ids) const;

  // Y (row-major [M, rows()]) = X (row-major [M, cols()]) W^T, or Y += that with `accumulate`.
  void multiply(const float* X, std::int64_t M, float* Y, bool accumulate) const;
  struct Product {
    const QuantizedMatrix* weight;
    float* Y;  // row-major [M, weight->rows()]
    bool accumulate;
  };
  // Every product of X [M, cols] (the same cols for all) in one parallel region, as linear_rows_group.
  static void multiply_group(const float* X, std::int64_t M, std::span<const Product> products);

  // The int8 products (quantized_int8.cpp), as llama.cpp computes its CPU products: the input rows quantized to
  // 8 bits per block (Int8Rows) and each block's dot product with the matrix's block in integers, scaled by the
  // two blocks' scales. For Q4_0, Q4_1 and Q8_0 matrices (int8_products()); Y [M, rows()] ≈ X W^T within the
  // input's 8-bit rounding (relative ~1e-2 per value), the same on every kernel path up to the order of sums.
  bool int8_products() const;
  static void multiply_group_int8(const Int8Rows& X, std::span<const Product> products);

 private:
  gguf::TensorType type_;
  std::int64_t rows_, cols_;
  torch::Tensor blocks_;
};

// A model's quantized weights by Hugging Face name ("model.layers.0.mlp.up_proj.weight"), as the Transformer
// constructor takes them.
using QuantizedTensors = std::map<std::string, std::shared_ptr<const QuantizedMatrix>>;

// y = x W^T for x [..., cols] (fp32 or bf16, CPU), differentiable in x. W is dequantized per call (pieces of at most
// 4M values at a time, so a 49k x 576 unembedding never exists whole in fp32) and again in backward, so w must
// outlive the graph (the model that holds it does).
torch::Tensor quantized_linear(const torch::Tensor& x, std::shared_ptr<const QuantizedMatrix> w);

}  // namespace rlloop::engine
