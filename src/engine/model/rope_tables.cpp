#include "model/rope_tables.hpp"

#include <algorithm>
#include <cmath>
#include <tuple>

namespace rlloop::engine {

namespace {

// YaRN's frequencies from RoPE's (`wavelengths` [D / 2] fp32: theta^(2i / D)) and the factor cos and sin are
// scaled by, step for step as transformers' _compute_yarn_parameters: the dimensions that turn fewer than
// beta_slow times over the original context are interpolated (divided by `factor`), those that turn more than
// beta_fast times kept, a linear ramp between.
std::pair<torch::Tensor, double> yarn_frequencies(const ModelConfig& cfg, const torch::Tensor& wavelengths) {
  const ModelConfig::Yarn& y = *cfg.yarn;
  const double D = static_cast<double>(cfg.head_dim), base = cfg.rope_theta;
  const double original = static_cast<double>(y.original_max_position_embeddings);
  auto correction_dim = [&](double rotations) {
    return D * std::log(original / (rotations * 2 * M_PI)) / (2 * std::log(base));
  };
  double low = correction_dim(y.beta_fast), high = correction_dim(y.beta_slow);
  if (y.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, D - 1);
  if (low == high) high += 0.001;  // transformers' guard against a zero-width ramp
  const torch::Tensor ramp =
      ((torch::arange(wavelengths.size(0), wavelengths.options()) - low) / (high - low)).clamp(0, 1);
  const torch::Tensor extrapolation = 1 - ramp;
  const torch::Tensor interpolated = torch::reciprocal(wavelengths * y.factor);
  const torch::Tensor frequencies =
      interpolated * (1 - extrapolation) + torch::reciprocal(wavelengths) * extrapolation;
  const double scaling = y.attention_factor ? *y.attention_factor
                                            : (y.factor <= 1 ? 1.0 : 0.1 * std::log(y.factor) + 1.0);
  return {frequencies, scaling};
}

}  // namespace

std::pair<torch::Tensor, torch::Tensor> RopeTables::get(const ModelConfig& cfg, torch::Device device,
                                                        torch::ScalarType dtype) {
  std::lock_guard lock(mutex_);
  if (tables_.first.defined() && tables_.first.device() == device && tables_.first.scalar_type() == dtype)
    return tables_;
  // Normal tensors even when first called by the sampler: inference tensors cannot be saved for backward.
  c10::InferenceMode not_inference(false);
  torch::NoGradGuard no_grad;
  const std::int64_t D = cfg.head_dim;
  auto i64 = torch::TensorOptions().device(device).dtype(torch::kLong);
  const torch::Tensor wavelengths = torch::pow(cfg.rope_theta, torch::arange(0, D, 2, i64).to(torch::kFloat32) / D);
  torch::Tensor inv_freq = torch::reciprocal(wavelengths);
  double scaling = 1.0;
  if (cfg.yarn) std::tie(inv_freq, scaling) = yarn_frequencies(cfg, wavelengths);
  torch::Tensor positions = torch::arange(0, cfg.max_position_embeddings, i64).to(torch::kFloat32);
  torch::Tensor angles = positions.unsqueeze(1) * inv_freq.unsqueeze(0);
  torch::Tensor emb = torch::cat({angles, angles}, -1);
  torch::Tensor cos = emb.cos(), sin = emb.sin();
  if (scaling != 1.0) {
    cos = cos * scaling;
    sin = sin * scaling;
  }
  tables_ = {cos.to(dtype), sin.to(dtype)};
  return tables_;
}

}  // namespace rlloop::engine
