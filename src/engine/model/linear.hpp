// The linear layer of the transformer's modules (an internal header of src/engine: transformer.cpp and the layer
// parts it composes, such as experts.cpp): a weight, dense or quantized, an optional bias and an optional LoRA
// adapter, with the products training and decoding need.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include <torch/torch.h>

#include "kernels/few_rows_linear.hpp"
#include "kernels/quantized_matrix.hpp"

namespace rlloop::engine {

// (x A^T) B^T as `dtype`, unscaled: an adapter's product. Adapters may be kept in a wider dtype than the base (fp32
// adapters over bf16 weights, as PEFT does): x goes to A's dtype first.
inline torch::Tensor low_rank_product(const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& b,
                                      torch::ScalarType dtype) {
  const torch::Tensor& xa = x.scalar_type() == a.scalar_type() ? x : x.to(a.scalar_type());
  torch::Tensor delta = torch::linear(torch::linear(xa, a), b);
  return delta.scalar_type() == dtype ? delta : delta.to(dtype);
}

// A linear layer y = x W^T + b, plus (alpha / rank) * B(A x) when an adapter is attached.
struct Linear {
  std::string name;        // HF module, e.g. "model.layers.0.self_attn.q_proj" (the family's names)
  std::string short_name;  // its name in LoRA's target_modules: "q_proj", ..., "lm_head"
  torch::Tensor weight;    // [out, in]; undefined when quantized
  std::shared_ptr<const QuantizedMatrix> quantized;  // the weight in its GGUF blocks (a frozen base), or null
  torch::Tensor bias;      // undefined without bias
  torch::Tensor lora_a;    // [rank, in]; undefined without LoRA
  torch::Tensor lora_b;    // [out, rank]
  double lora_scale = 0.0;

  // Whether the layer has this linear at all (a sparse layer has no dense gate, up and down).
  bool present() const { return weight.defined() || quantized != nullptr; }
  std::int64_t out_features() const { return quantized ? quantized->rows() : weight.size(0); }
  std::int64_t in_features() const { return quantized ? quantized->cols() : weight.size(1); }
  // The weight's values as a tensor: the parameter, or the quantized blocks dequantized to fp32.
  torch::Tensor dense_weight() const { return quantized ? quantized->dequantize() : weight; }

  // few_rows: a decoding step's product (one new token per row), which takes rlloop's few-row kernel on the CPU
  // (few_rows_linear.hpp) where it applies; other forwards keep torch::linear.
  torch::Tensor apply(const torch::Tensor& x, bool few_rows = false) const {
    torch::Tensor y = apply_base(x, few_rows);
    if (!lora_a.defined()) return y;
    // With B = 0 the delta is an exact zero and y + 0 == y: an untrained adapter reproduces the base bit for bit.
    return torch::add(y, adapter_delta(x, y.scalar_type()), lora_scale);
  }
  // x W^T + b: the product without the adapter.
  torch::Tensor apply_base(const torch::Tensor& x, bool few_rows = false) const {
    if (!quantized)
      return few_rows && few_rows_linear_applies(x, weight) ? few_rows_linear(x, weight, bias)
                                                            : torch::linear(x, weight, bias);
    torch::Tensor y = quantized_linear(x, quantized);
    return bias.defined() ? y + bias : y;
  }
  // (x A^T) B^T as `dtype`, unscaled (an adapter must be attached).
  torch::Tensor adapter_delta(const torch::Tensor& x, torch::ScalarType dtype) const {
    return low_rank_product(x, lora_a, lora_b, dtype);
  }

  // W + scale * B A (with an adapter), accumulated in fp32 (at least) and stored in W's dtype.
  torch::Tensor merged_weight() const {
    torch::NoGradGuard no_grad;
    auto acc = lora_a.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
    const torch::Tensor w = dense_weight();
    return (w.to(acc) + lora_scale * torch::matmul(lora_b.to(acc), lora_a.to(acc))).to(w.scalar_type());
  }
};

}  // namespace rlloop::engine
