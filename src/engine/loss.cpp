#include "loss.hpp"

namespace rlloop::engine {

LossValue builtin_loss(const LossSpec& spec, const torch::Tensor& lp, const LossTensors& in) {
  // Token weights mask the RL losses too (e.g. 0 on prompt tokens); all-ones gives exactly DESIGN.md's formulas.
  const torch::Tensor& m = spec.fn == LossFn::cross_entropy ? in.mask : in.mask * in.weights;
  auto zero = torch::zeros({}, lp.options());
  switch (spec.fn) {
    case LossFn::cross_entropy:
      return {-(lp * in.weights * in.mask).sum(), zero};
    case LossFn::importance_sampling: {
      auto r = torch::exp(lp - in.sampler_logprobs);
      return {-(r * in.advantages * m).sum(), zero};
    }
    case LossFn::ppo: {
      auto r = torch::exp(lp - in.sampler_logprobs);
      auto clipped_r = torch::clamp(r, spec.clip_low_threshold, spec.clip_high_threshold);
      auto objective = torch::min(r * in.advantages, clipped_r * in.advantages);
      auto was_clipped = ((clipped_r != r) * m).sum().to(lp.scalar_type());
      return {-(objective * m).sum(), was_clipped.detach()};
    }
    case LossFn::cispo: {
      auto r = torch::exp(lp - in.sampler_logprobs);
      auto clipped_r = torch::clamp(r, spec.clip_low_threshold, spec.clip_high_threshold).detach();
      auto was_clipped = ((clipped_r != r.detach()) * m).sum().to(lp.scalar_type());
      return {-(clipped_r * lp * in.advantages * m).sum(), was_clipped};
    }
    case LossFn::dro: {
      auto diff = lp - in.sampler_logprobs;
      return {-((lp * in.advantages - 0.5 * spec.beta * diff * diff) * m).sum(), zero};
    }
    case LossFn::value:
      throw invalid_argument("the value loss applies to values, not logprobs (see value_loss)");
  }
  throw invalid_argument("unknown loss function");
}

LossValue value_loss(const LossSpec& spec, const torch::Tensor& v, const torch::Tensor& returns,
                     const torch::Tensor& old_values, const torch::Tensor& m) {
  auto err = (v - returns).square();
  if (!old_values.defined() || spec.value_clip == 0.0) return {0.5 * (err * m).sum(), torch::zeros({}, v.options())};
  auto v_clip = old_values + torch::clamp(v - old_values, -spec.value_clip, spec.value_clip);
  auto err_clip = (v_clip - returns).square();
  auto clipped = ((err_clip > err) * m).sum().to(v.scalar_type());
  return {0.5 * (torch::max(err, err_clip) * m).sum(), clipped.detach()};
}

}  // namespace rlloop::engine
