#include "optimizer.hpp"

#include <cmath>

#include <rlloop/error.hpp>

namespace rlloop::engine {
namespace {
void check_range(const char* field, double v, double lo, double hi) {
  if (!(v >= lo && v <= hi))
    throw invalid_argument(std::string("AdamParams.") + field + " must be in [" + std::to_string(lo) + ", " +
                           std::to_string(hi) + "], got " + std::to_string(v));
}
}  // namespace

void validate(const AdamParams& p) {
  if (!(p.learning_rate >= 0.0 && std::isfinite(p.learning_rate)))
    throw invalid_argument("AdamParams.learning_rate must be >= 0, got " + std::to_string(p.learning_rate));
  check_range("beta1", p.beta1, 0.0, 0.999999);
  check_range("beta2", p.beta2, 0.0, 0.999999);
  check_range("eps", p.eps, 1e-16, 0.01);
  check_range("weight_decay", p.weight_decay, 0.0, 1.0);
  if (p.grad_clip_norm) check_range("grad_clip_norm", *p.grad_clip_norm, 0.0, 100.0);
  check_range("lora_plus_lr_ratio", p.lora_plus_lr_ratio, 1.0, 100.0);
}

AdamW::AdamW(std::vector<NamedParameter> params) : params_(std::move(params)) {
  torch::NoGradGuard no_grad;
  for (const auto& p : params_) {
    exp_avg_.push_back(torch::zeros_like(p.tensor, torch::kFloat32));
    exp_avg_sq_.push_back(torch::zeros_like(p.tensor, torch::kFloat32));
  }
}

void AdamW::zero_grad() {
  for (auto& p : params_)
    if (p.tensor.grad().defined()) p.tensor.mutable_grad().zero_();
}

double AdamW::grad_norm() const {
  torch::NoGradGuard no_grad;
  // Global L2 norm over every gradient, accumulated on the device: one host sync.
  torch::Tensor sq_sum;
  for (const auto& p : params_) {
    if (!p.tensor.grad().defined()) continue;
    auto s = p.tensor.grad().to(torch::kFloat32).pow(2).sum();
    sq_sum = sq_sum.defined() ? sq_sum + s : s;
  }
  return sq_sum.defined() ? std::sqrt(sq_sum.item<double>()) : 0.0;
}

Metrics AdamW::step(const AdamParams& hp) {
  validate(hp);
  torch::NoGradGuard no_grad;
  const double grad_norm = this->grad_norm();
  if (!std::isfinite(grad_norm)) {
    zero_grad();
    throw invalid_argument("optim_step: the gradient norm is not finite; the step was skipped and gradients cleared");
  }
  double clip_scale = 1.0;
  if (hp.grad_clip_norm && *hp.grad_clip_norm > 0.0 && grad_norm > *hp.grad_clip_norm)
    clip_scale = *hp.grad_clip_norm / (grad_norm + 1e-6);

  ++step_;
  const double bias1 = 1.0 - std::pow(hp.beta1, static_cast<double>(step_));
  const double bias2 = 1.0 - std::pow(hp.beta2, static_cast<double>(step_));
  for (std::size_t i = 0; i < params_.size(); ++i) {
    auto& p = params_[i].tensor;
    if (!p.grad().defined()) continue;
    const double lr = params_[i].lora_b ? hp.learning_rate * hp.lora_plus_lr_ratio : hp.learning_rate;
    auto g = p.grad().to(torch::kFloat32);
    if (clip_scale != 1.0) g = g * clip_scale;
    exp_avg_[i].mul_(hp.beta1).add_(g, 1.0 - hp.beta1);
    exp_avg_sq_[i].mul_(hp.beta2).addcmul_(g, g, 1.0 - hp.beta2);
    auto denom = (exp_avg_sq_[i] / bias2).sqrt_().add_(hp.eps);
    auto update = (exp_avg_[i] / bias1).div_(denom);
    // Decoupled weight decay (AdamW): shrink the weight itself, not the gradient.
    if (hp.weight_decay != 0.0) p.mul_(1.0 - lr * hp.weight_decay);
    p.add_(update.to(p.scalar_type()), -lr);
  }
  zero_grad();
  return {{"grad_norm", grad_norm}, {"lr", hp.learning_rate}, {"step", static_cast<double>(step_)}};
}

std::vector<std::pair<std::string, torch::Tensor>> AdamW::state_tensors() const {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    out.emplace_back(params_[i].name + ".exp_avg", exp_avg_[i].cpu());
    out.emplace_back(params_[i].name + ".exp_avg_sq", exp_avg_sq_[i].cpu());
  }
  return out;
}

std::vector<torch::Tensor> AdamW::moments() const {
  std::vector<torch::Tensor> out = exp_avg_;
  out.insert(out.end(), exp_avg_sq_.begin(), exp_avg_sq_.end());
  return out;
}

void AdamW::load_state_tensors(const std::map<std::string, torch::Tensor>& tensors, std::int64_t step) {
  torch::NoGradGuard no_grad;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    using Slot = std::pair<const char*, torch::Tensor*>;
    for (auto [suffix, dst] : {Slot{".exp_avg", &exp_avg_[i]}, Slot{".exp_avg_sq", &exp_avg_sq_[i]}}) {
      const std::string key = params_[i].name + suffix;
      auto it = tensors.find(key);
      if (it == tensors.end()) throw io_error("optimizer state lacks tensor '" + key + "'");
      if (it->second.sizes() != dst->sizes())
        throw io_error("optimizer state tensor '" + key + "' has the wrong shape");
      dst->copy_(it->second);
    }
  }
  step_ = step;
}

}  // namespace rlloop::engine
