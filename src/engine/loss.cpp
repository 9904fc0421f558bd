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
  }
  throw invalid_argument("unknown loss function");
}

}  // namespace rlloop::engine
