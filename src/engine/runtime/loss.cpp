#include "runtime/loss.hpp"

#include <algorithm>
#include <array>
#include <cmath>

namespace rlloop::engine {

namespace {
// The number of loss-bearing tokens (m != 0) where `taken` holds.
torch::Tensor count_where(const torch::Tensor& taken, const torch::Tensor& m) {
  return (taken & (m != 0)).sum().to(m.scalar_type());
}

torch::Tensor count_bearing(const torch::Tensor& m) { return count_where(torch::ones_like(m, torch::kBool), m); }

// The RL losses' token factor: weights mask them too (e.g. 0 on prompt tokens); all-ones gives exactly the formulas
// of loss.hpp.
torch::Tensor weighted_mask(const LossTensors& in) { return (in.mask * in.weights).detach(); }

torch::Tensor ratio(const torch::Tensor& lp, const LossTensors& in) { return torch::exp(lp - in.sampler_logprobs); }

// ---- one function per loss (the formulas: loss.hpp) ----------------------------------------------------------

LossValue cross_entropy(const LossSpec&, const torch::Tensor& lp, const LossTensors& in) {
  // Weighted by w, but every real token bears the loss (weight 0 included): the mask alone counts.
  return {-(lp * in.weights * in.mask).sum(), torch::zeros({}, lp.options()), count_bearing(in.mask.detach())};
}

LossValue importance_sampling(const LossSpec&, const torch::Tensor& lp, const LossTensors& in) {
  const auto m = weighted_mask(in);
  return {-(ratio(lp, in) * in.advantages * m).sum(), torch::zeros({}, lp.options()), count_bearing(m)};
}

LossValue ppo(const LossSpec& spec, const torch::Tensor& lp, const LossTensors& in) {
  const auto m = weighted_mask(in);
  auto r = ratio(lp, in);
  auto clipped_r = torch::clamp(r, spec.min_ratio(), spec.max_ratio());
  auto unclipped_term = r * in.advantages, clipped_term = clipped_r * in.advantages;
  auto objective = torch::min(unclipped_term, clipped_term);
  return {-(objective * m).sum(), count_where((clipped_term < unclipped_term).detach(), m), count_bearing(m)};
}

LossValue cispo(const LossSpec& spec, const torch::Tensor& lp, const LossTensors& in) {
  const auto m = weighted_mask(in);
  auto r = ratio(lp, in);
  auto clipped_r = torch::clamp(r, spec.min_ratio(), spec.max_ratio()).detach();
  return {-(clipped_r * lp * in.advantages * m).sum(), count_where(clipped_r != r.detach(), m), count_bearing(m)};
}

LossValue dro(const LossSpec& spec, const torch::Tensor& lp, const LossTensors& in) {
  const auto m = weighted_mask(in);
  auto diff = lp - in.sampler_logprobs;
  return {-((lp * in.advantages - 0.5 * spec.beta * diff * diff) * m).sum(), torch::zeros({}, lp.options()),
          count_bearing(m)};
}

LossValue gspo(const LossSpec& spec, const torch::Tensor& lp, const LossTensors& in) {
  const auto m = weighted_mask(in);
  auto bearing = (m != 0).to(lp.scalar_type());  // [B, T]: the tokens of each sequence's ratio
  if (in.ratio_mask.defined())  // Tinker's sequence_ratio_mask, on the rows that have one (within the real tokens)
    bearing = torch::where(torch::isnan(in.ratio_mask), bearing, (in.ratio_mask != 0).to(lp.scalar_type()) * in.mask);
  const auto log_s = ((lp - in.sampler_logprobs).detach() * bearing).sum(1, true) / bearing.sum(1, true).clamp_min(1);
  const auto r = torch::exp(log_s) * torch::exp(lp - lp.detach());
  auto clipped_r = torch::clamp(r, spec.min_ratio(), spec.max_ratio());
  auto unclipped_term = r * in.advantages, clipped_term = clipped_r * in.advantages;
  auto objective = torch::min(unclipped_term, clipped_term);
  return {-(objective * m).sum(), count_where((clipped_term < unclipped_term).detach(), m), count_bearing(m)};
}

// cispo's form with the weight capped above only (min(r, C)), plus the k3 estimate of KL(sampler || policy) over the
// sampled tokens, (r - 1) - log r: nonnegative, 0 where the policy still is the sampler, its gradient (r - 1) lp'.
LossValue stable_reinforce(const LossSpec& spec, const torch::Tensor& lp, const LossTensors& in) {
  const auto m = weighted_mask(in);
  const auto log_r = lp - in.sampler_logprobs;
  const auto r = torch::exp(log_r);
  const auto weight = torch::clamp_max(r, spec.truncation).detach();
  auto objective = weight * lp * in.advantages;
  if (spec.kl_coeff != 0.0) objective = objective - spec.kl_coeff * ((r - 1) - log_r);
  return {-(objective * m).sum(), count_where((r > spec.truncation).detach(), m), count_bearing(m)};
}

LossValue value(const LossSpec& spec, const torch::Tensor& v, const LossTensors& in) {
  return value_loss(spec, v, in.returns, in.old_values, weighted_mask(in));
}

// ---- whether a token is clipped, on host values (the service metrics) ----------------------------------------

bool never(const LossSpec&, double, double, double, double) { return false; }

// PPO takes the clipped term when it is the smaller.
bool ppo_clips(const LossSpec& spec, double lp, double q, double advantage, double) {
  const double r = std::exp(lp - q), c = std::clamp(r, spec.min_ratio(), spec.max_ratio());
  return c * advantage < r * advantage;
}

// GSPO as PPO, with the sequence's ratio.
bool gspo_clips(const LossSpec& spec, double, double, double advantage, double sequence_log_ratio) {
  return ppo_clips(spec, sequence_log_ratio, 0.0, advantage, 0.0);
}

// CISPO clips whenever the clamp is active.
bool cispo_clips(const LossSpec& spec, double lp, double q, double, double) {
  const double r = std::exp(lp - q);
  return std::clamp(r, spec.min_ratio(), spec.max_ratio()) != r;
}

// stable_reinforce truncates a weight above its cap.
bool truncates(const LossSpec& spec, double lp, double q, double, double) { return std::exp(lp - q) > spec.truncation; }

// One row per row of kLosses, in the same order (checked below).
constexpr std::array<LossKernel, kLossCount> kLossKernels{{
    {LossFn::cross_entropy, cross_entropy, never},
    {LossFn::importance_sampling, importance_sampling, never},
    {LossFn::ppo, ppo, ppo_clips},
    {LossFn::cispo, cispo, cispo_clips},
    {LossFn::dro, dro, never},
    {LossFn::value, value, never},
    {LossFn::gspo, gspo, gspo_clips},
    {LossFn::stable_reinforce, stable_reinforce, truncates},
}};

constexpr bool kernels_follow_the_table() {
  for (std::size_t i = 0; i < kLossKernels.size(); ++i)
    if (kLossKernels[i].fn != kLosses[i].fn || !kLossKernels[i].apply || !kLossKernels[i].clips_token) return false;
  return true;
}
static_assert(kernels_follow_the_table(), "kLossKernels: row i is the code of kLosses[i], with both functions");
}  // namespace

ClipCounts LossValue::counts() const { return {clipped.item<double>(), bearing.item<double>()}; }

const LossKernel& loss_kernel(LossFn fn) { return kLossKernels[static_cast<std::size_t>(loss_info(fn).fn)]; }

LossValue builtin_loss(const LossSpec& spec, const torch::Tensor& x, const LossTensors& in) {
  return loss_kernel(spec.fn).apply(spec, x, in);
}

LossValue value_loss(const LossSpec& spec, const torch::Tensor& v, const torch::Tensor& returns,
                     const torch::Tensor& old_values, const torch::Tensor& m) {
  auto err = (v - returns).square();
  auto bearing = count_bearing(m);
  if (!old_values.defined() || spec.value_clip == 0.0)
    return {0.5 * (err * m).sum(), torch::zeros({}, v.options()), bearing};
  auto v_clip = old_values + torch::clamp(v - old_values, -spec.value_clip, spec.value_clip);
  auto err_clip = (v_clip - returns).square();
  return {0.5 * (torch::max(err, err_clip) * m).sum(), count_where((err_clip > err).detach(), m), bearing};
}

}  // namespace rlloop::engine
