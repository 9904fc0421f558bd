#include "runtime/optimizer.hpp"

#include <cmath>

#include <rlloop/error.hpp>

namespace rlloop::engine {
namespace {
bool low_precision(const torch::Tensor& t) {
  return t.scalar_type() == torch::kBFloat16 || t.scalar_type() == torch::kHalf;
}

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
    master_.push_back(low_precision(p.tensor) ? p.tensor.detach().to(torch::kFloat32) : torch::Tensor());
    grad32_.emplace_back();
  }
}

void AdamW::absorb_gradients() {
  for (std::size_t i = 0; i < params_.size(); ++i) absorb(i);
}

void AdamW::absorb(std::size_t i) {
  auto& p = params_[i].tensor;
  if (!master_[i].defined() || !p.grad().defined()) return;
  torch::NoGradGuard no_grad;
  if (grad32_[i].defined())
    grad32_[i].add_(p.grad());
  else
    grad32_[i] = p.grad().to(torch::kFloat32);
  p.mutable_grad().reset();
}

torch::Tensor AdamW::gradient(std::size_t i) {
  absorb(i);
  return master_[i].defined() ? grad32_[i] : params_[i].tensor.grad();
}

void AdamW::set_gradient(std::size_t i, const torch::Tensor& g) {
  torch::NoGradGuard no_grad;
  auto& p = params_[i].tensor;
  if (master_[i].defined()) {
    p.mutable_grad().reset();
    grad32_[i] = g.detach().to(p.device(), torch::kFloat32, /*non_blocking=*/false, /*copy=*/true);
  } else if (p.grad().defined()) {
    p.mutable_grad().copy_(g);
  } else {
    p.mutable_grad() = g.detach().to(p.device(), p.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
  }
}

void AdamW::zero_grad() {
  for (std::size_t i = 0; i < params_.size(); ++i) clear_gradient(i);
}

void AdamW::clear_gradient(std::size_t i) {
  auto& p = params_[i].tensor;
  if (p.grad().defined()) p.mutable_grad().zero_();
  grad32_[i].reset();
}

double AdamW::grad_norm() {
  torch::NoGradGuard no_grad;
  // Global L2 norm over every gradient, accumulated on the device: one host sync.
  torch::Tensor sq_sum;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const torch::Tensor g = gradient(i);
    if (!g.defined()) continue;
    auto s = g.to(torch::kFloat32).pow(2).sum();
    sq_sum = sq_sum.defined() ? sq_sum + s : s;
  }
  return sq_sum.defined() ? std::sqrt(sq_sum.item<double>()) : 0.0;
}

Metrics AdamW::step(const AdamParams& hp) { return step(hp, grad_norm()); }

Metrics AdamW::step(const AdamParams& hp, double grad_norm) {
  validate(hp);
  torch::NoGradGuard no_grad;
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
    const torch::Tensor grad = gradient(i);
    if (!grad.defined()) continue;
    auto& p = params_[i].tensor;
    // The weight the update applies to: the fp32 master of a bf16/fp16 parameter, else the parameter.
    torch::Tensor& w = master_[i].defined() ? master_[i] : p;
    const double lr = params_[i].lora_b ? hp.learning_rate * hp.lora_plus_lr_ratio : hp.learning_rate;
    auto g = grad.to(torch::kFloat32);
    if (clip_scale != 1.0) g = g * clip_scale;
    exp_avg_[i].mul_(hp.beta1).add_(g, 1.0 - hp.beta1);
    exp_avg_sq_[i].mul_(hp.beta2).addcmul_(g, g, 1.0 - hp.beta2);
    auto denom = (exp_avg_sq_[i] / bias2).sqrt_().add_(hp.eps);
    auto update = (exp_avg_[i] / bias1).div_(denom);
    // Decoupled weight decay (AdamW): shrink the weight itself, not the gradient.
    if (hp.weight_decay != 0.0) w.mul_(1.0 - lr * hp.weight_decay);
    w.add_(update.to(w.scalar_type()), -lr);
    if (master_[i].defined()) p.copy_(master_[i]);
  }
  zero_grad();
  return {{"grad_norm", grad_norm}, {"lr", hp.learning_rate}, {"step", static_cast<double>(step_)}};
}

std::string AdamW::parameter_of_state(const std::string& entry) {
  for (const char* suffix : {".exp_avg_sq", ".exp_avg", ".master"})  // the names state_tensors() gives
    if (entry.ends_with(suffix)) return entry.substr(0, entry.size() - std::string(suffix).size());
  throw invalid_argument("optimizer state entry '" + entry + "' is not a parameter's moment or master");
}

std::vector<std::pair<std::string, torch::Tensor>> AdamW::state_tensors() const {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    out.emplace_back(params_[i].name + ".exp_avg", exp_avg_[i].cpu());
    out.emplace_back(params_[i].name + ".exp_avg_sq", exp_avg_sq_[i].cpu());
    if (master_[i].defined()) out.emplace_back(params_[i].name + ".master", master_[i].cpu());
  }
  return out;
}

std::vector<torch::Tensor> AdamW::state() const {
  std::vector<torch::Tensor> out = exp_avg_;
  out.insert(out.end(), exp_avg_sq_.begin(), exp_avg_sq_.end());
  for (const auto& m : master_)
    if (m.defined()) out.push_back(m);
  return out;
}

void AdamW::sync_parameters() {
  torch::NoGradGuard no_grad;
  for (std::size_t i = 0; i < params_.size(); ++i)
    if (master_[i].defined()) params_[i].tensor.copy_(master_[i]);
}

void AdamW::load_state_tensors(const std::map<std::string, torch::Tensor>& tensors, std::int64_t step) {
  torch::NoGradGuard no_grad;
  auto find = [&](const std::string& key, const torch::Tensor& like) -> const torch::Tensor* {
    auto it = tensors.find(key);
    if (it == tensors.end()) return nullptr;
    if (it->second.sizes() != like.sizes()) throw io_error("optimizer state tensor '" + key + "' has the wrong shape");
    return &it->second;
  };
  for (std::size_t i = 0; i < params_.size(); ++i) {
    for (auto [suffix, dst] : {std::pair{".exp_avg", &exp_avg_[i]}, std::pair{".exp_avg_sq", &exp_avg_sq_[i]}}) {
      const torch::Tensor* saved = find(params_[i].name + suffix, *dst);
      if (!saved) throw io_error("optimizer state lacks tensor '" + params_[i].name + suffix + "'");
      dst->copy_(*saved);
    }
    if (!master_[i].defined()) continue;
    if (const torch::Tensor* saved = find(params_[i].name + ".master", master_[i]))
      master_[i].copy_(*saved);
    else
      master_[i].copy_(params_[i].tensor);
  }
  sync_parameters();
  step_ = step;
}

}  // namespace rlloop::engine
