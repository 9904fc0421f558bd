// x W^T + b for the few rows of a decoding step on the CPU, through rlloop's few-row kernel (small_gemm.hpp) instead
// of BLAS: OpenBLAS packs the whole weight on every call, which for a handful of rows costs more than the
// arithmetic (the ATen decoding step spent twice the CPU decoder's time per token on one row). Used by the model's
// linears in a decoding step (Transformer::decode_step); training, prefill and scoring keep torch::linear, so their
// numbers do not depend on how many rows a call has.
#pragma once
#include <torch/torch.h>

namespace rlloop::engine {

// The most rows the few-row kernel takes here (a decoding step's batch; an expert's share of one).
inline constexpr std::int64_t kFewRows = 16;

// Whether few_rows_linear takes x and weight: fp32 on the CPU, weight contiguous [out, in], at most kFewRows rows
// of x, no graph recorded (grad mode off), and a shape the kernel runs on this CPU.
bool few_rows_linear_applies(const torch::Tensor& x, const torch::Tensor& weight);
// x [..., in] W^T (+ bias [out]) -> [..., out]; few_rows_linear_applies must hold.
torch::Tensor few_rows_linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias);

}  // namespace rlloop::engine
