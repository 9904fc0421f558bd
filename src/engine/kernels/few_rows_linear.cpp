#include "kernels/few_rows_linear.hpp"

#include "kernels/small_gemm.hpp"

namespace rlloop::engine {

bool few_rows_linear_applies(const torch::Tensor& x, const torch::Tensor& weight) {
  if (torch::GradMode::is_enabled() || !x.device().is_cpu() || x.scalar_type() != torch::kFloat32 ||
      !weight.device().is_cpu() || weight.scalar_type() != torch::kFloat32 || weight.dim() != 2 ||
      !weight.is_contiguous() || x.dim() == 0 || x.size(-1) != weight.size(1))
    return false;
  const std::int64_t K = weight.size(1), M = K == 0 ? 0 : x.numel() / K;
  return M > 0 && M <= kFewRows && small_gemm_applies(M, K);
}

torch::Tensor few_rows_linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias) {
  const std::int64_t N = weight.size(0), K = weight.size(1), M = x.numel() / K;
  const torch::Tensor rows = x.contiguous();
  std::vector<std::int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  torch::Tensor y = torch::empty(shape, x.options());
  linear_rows(rows.data_ptr<float>(), M, weight.data_ptr<float>(), N, K, y.data_ptr<float>(), false);
  return bias.defined() ? y.add_(bias) : y;
}

}  // namespace rlloop::engine
