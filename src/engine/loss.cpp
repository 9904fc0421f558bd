#include "loss.hpp"

namespace rlloop::engine {

namespace {
// The number of loss-bearing tokens (m != 0) where `taken` holds.
torch::Tensor count_where(const torch::Tensor& taken, const torch::Tensor& m) {
  return (taken & (m != 0)).sum().to(m.scalar_type());
}
}  // namespace

ClipCounts LossValue::counts() const { return {clipped.item<double>(), bearing.item<double>()}; }

LossValue builtin_loss(const LossSpec& spec, const torch::Tensor& lp, const LossTensors& in) {
  // Token weights mask the RL losses too (e.g. 0 on prompt tokens); all-ones gives exactly the formulas of loss.hpp.
  const torch::Tensor m = (spec.fn == LossFn::cross_entropy ? in.mask : in.mask * in.weights).detach();
  auto zero = torch::zeros({}, lp.options());
  auto bearing = count_where(torch::ones_like(m, torch::kBool), m);
  switch (spec.fn) {
    case LossFn::cross_entropy:
      return {-(lp * in.weights * in.mask).sum(), zero, bearing};
    case LossFn::importance_sampling: {
      auto r = torch::exp(lp - in.sampler_logprobs);
      return {-(r * in.advantages * m).sum(), zero, bearing};
    }
    case LossFn::ppo: {
      auto r = torch::exp(lp - in.sampler_logprobs);
      auto clipped_r = torch::clamp(r, spec.min_ratio(), spec.max_ratio());
      auto unclipped_term = r * in.advantages, clipped_term = clipped_r * in.advantages;
      auto objective = torch::min(unclipped_term, clipped_term);
      return {-(objective * m).sum(), count_where((clipped_term < unclipped_term).detach(), m), bearing};
    }
    case LossFn::cispo: {
      auto r = torch::exp(lp - in.sampler_logprobs);
      auto clipped_r = torch::clamp(r, spec.min_ratio(), spec.max_ratio()).detach();
      return {-(clipped_r * lp * in.advantages * m).sum(), count_where(clipped_r != r.detach(), m), bearing};
    }
    case LossFn::dro: {
      auto diff = lp - in.sampler_logprobs;
      return {-((lp * in.advantages - 0.5 * spec.beta * diff * diff) * m).sum(), zero, bearing};
    }
    case LossFn::value:
      throw invalid_argument("the value loss applies to values, not logprobs (see value_loss)");
  }
  throw invalid_argument("unknown loss function");
}

LossValue value_loss(const LossSpec& spec, const torch::Tensor& v, const torch::Tensor& returns,
                     const torch::Tensor& old_values, const torch::Tensor& m) {
  auto err = (v - returns).square();
  auto bearing = count_where(torch::ones_like(m, torch::kBool), m);
  if (!old_values.defined() || spec.value_clip == 0.0)
    return {0.5 * (err * m).sum(), torch::zeros({}, v.options()), bearing};
  auto v_clip = old_values + torch::clamp(v - old_values, -spec.value_clip, spec.value_clip);
  auto err_clip = (v_clip - returns).square();
  return {0.5 * (torch::max(err, err_clip) * m).sum(), count_where((err_clip > err).detach(), m), bearing};
}

}  // namespace rlloop::engine
