// Generalised advantage estimation as free functions on plain arrays, and CriticGae: the advantage policy that
// makes the policy-gradient loop PPO (ppo.hpp). The critic's clipped value loss is the engine's built-in `value`
// loss (LossSpec::value, src/engine/runtime/loss.hpp), so it runs on the same tensors as the policy loss.
//
//   delta_t = r_t + gamma * V_{t+1} * (1 - done_t) - V_t
//   A_t     = delta_t + gamma * lambda * (1 - done_t) * A_{t+1}
//   R_t     = A_t + V_t                                  (the critic's regression target)
//
// done_t = 1 means the episode ended after step t: nothing after it is bootstrapped or credited. V_T (the value
// after the last step of a truncated trajectory) is `bootstrap_value`.
#pragma once
#include <cmath>
#include <span>
#include <string>
#include <vector>

#include <rlloop/clients.hpp>
#include <rlloop/error.hpp>

#include <rlloop/algorithms/advantages.hpp>
#include <rlloop/algorithms/rollout.hpp>

namespace rlloop::algorithms {

struct GaeOptions {
  double gamma = 1.0;  // LLM RL usually does not discount within a completion
  double lambda = 0.95;

  void validate() const {
    if (!(gamma >= 0 && gamma <= 1)) throw invalid_argument("GaeOptions::gamma must be in [0, 1]");
    if (!(lambda >= 0 && lambda <= 1)) throw invalid_argument("GaeOptions::lambda must be in [0, 1]");
  }
};

struct GaeResult {
  std::vector<double> advantages;
  std::vector<double> returns;
};

inline GaeResult gae(std::span<const double> rewards, std::span<const double> values, std::span<const double> dones,
                     const GaeOptions& options, double bootstrap_value = 0.0) {
  options.validate();
  const std::size_t n = rewards.size();
  if (values.size() != n || dones.size() != n)
    throw invalid_argument("gae: rewards, values and dones must have the same length (got " + std::to_string(n) + ", " +
                           std::to_string(values.size()) + ", " + std::to_string(dones.size()) + ")");
  for (double d : dones)
    if (d != 0.0 && d != 1.0) throw invalid_argument("gae: dones must be 0 or 1");
  GaeResult out{std::vector<double>(n), std::vector<double>(n)};
  double next_value = bootstrap_value, next_advantage = 0.0;
  for (std::size_t k = n; k-- > 0;) {
    const double live = 1.0 - dones[k];
    const double delta = rewards[k] + options.gamma * next_value * live - values[k];
    out.advantages[k] = delta + options.gamma * options.lambda * live * next_advantage;
    out.returns[k] = out.advantages[k] + values[k];
    next_value = values[k];
    next_advantage = out.advantages[k];
  }
  return out;
}

// (a - mean) / (std + eps) over a batch of advantages (population std), as PPO implementations normalise them.
inline std::vector<double> whiten(std::span<const double> a, double eps = 1e-8) {
  if (a.empty()) return {};
  double mean = 0;
  for (double x : a) mean += x;
  mean /= static_cast<double>(a.size());
  double var = 0;
  for (double x : a) var += (x - mean) * (x - mean);
  const double sd = std::sqrt(var / static_cast<double>(a.size()));
  std::vector<double> out;
  for (double x : a) out.push_back((x - mean) / (sd + eps));
  return out;
}

// 1 - Var(target - predicted) / Var(target): the share of the targets' variance a predictor explains (1 = all of
// it, 0 = no better than their mean, negative = worse).
inline double explained_variance(std::span<const double> predicted, std::span<const double> target) {
  if (target.size() != predicted.size())
    throw invalid_argument("explained_variance: " + std::to_string(predicted.size()) + " predictions for " +
                           std::to_string(target.size()) + " targets");
  if (target.size() < 2) return 0.0;
  std::vector<double> residual;
  for (std::size_t i = 0; i < target.size(); ++i) residual.push_back(target[i] - predicted[i]);
  const double var_target = std::pow(detail::std_of(target), 2);
  return var_target > 0 ? 1.0 - std::pow(detail::std_of(residual), 2) / var_target : 0.0;
}

// PPO's critic (a CriticAdvantage): per-token values from the session's value head (SessionOptions::value_head,
// local sessions), GAE over each completion with the reward at its last token, advantages whitened over the
// batch, and the clipped built-in `value` loss on the same weights as the policy, one per minibatch.
struct CriticGae {
  GaeOptions gae{};
  double value_clip = 0.2;  // the critic may move this far from its rollout-time values per batch
  double value_coef = 0.5;  // weight of the value loss against the policy loss
  bool whiten_advantages = true;

  void validate() const {
    gae.validate();
    if (!(value_clip >= 0)) throw invalid_argument("CriticGae::value_clip must be >= 0");
    if (!(value_coef > 0)) throw invalid_argument("CriticGae::value_coef must be > 0");
  }

  template <Session S>
  void check_session(TrainingClient<S>& client) const {
    validate();
    if (!client.get_info().value_head)
      throw invalid_argument(
          "CriticGae: the session needs a value head (create it with SessionOptions::value_head = true)");
  }

  // One forward pass scores the rollout-time values of every completion; GAE turns the per-token rewards that
  // `advantages` holds on entry into advantages and the critic's returns.
  template <Session S>
  CriticReport estimate(TrainingClient<S>& client, std::vector<Rollout>& rollouts) const {
    std::vector<Datum> probe;
    for (auto& r : rollouts) {
      r.values.assign(r.completion.size(), 0.0);
      r.returns.assign(r.completion.size(), 0.0);
      probe.push_back(value_datum(r, 0.0));
    }
    const auto out = client.forward(probe, LossSpec::value(value_clip)).get();
    std::vector<double> all_advantages, all_returns, all_values;
    for (std::size_t k = 0; k < rollouts.size(); ++k) {
      auto& r = rollouts[k];
      const auto v = out.loss_fn_outputs[k].at("values").as_doubles();
      const std::size_t start = r.prompt.size() - 1, n = r.completion.size();
      for (std::size_t j = 0; j < n; ++j) r.values[j] = v[start + j];
      std::vector<double> dones(n, 0.0);
      dones.back() = 1.0;
      auto g = algorithms::gae(r.advantages, r.values, dones, gae);  // the free function, not the member
      r.advantages = std::move(g.advantages);
      r.returns = std::move(g.returns);
      all_advantages.insert(all_advantages.end(), r.advantages.begin(), r.advantages.end());
      all_returns.insert(all_returns.end(), r.returns.begin(), r.returns.end());
      all_values.insert(all_values.end(), r.values.begin(), r.values.end());
    }
    if (whiten_advantages) {
      const auto w = whiten(all_advantages);
      std::size_t i = 0;
      for (auto& r : rollouts)
        for (auto& a : r.advantages) a = w[i++];
    }
    return {explained_variance(all_values, all_returns)};
  }

  // The value loss of one minibatch, a token mean scaled by value_coef.
  template <Session S>
  Future<ForwardBackwardOutput> train(TrainingClient<S>& client, std::span<const Rollout> minibatch) const {
    std::size_t tokens = 0;
    for (const auto& r : minibatch) tokens += r.completion.size();
    std::vector<Datum> batch;
    for (const auto& r : minibatch) batch.push_back(value_datum(r, value_coef / static_cast<double>(tokens)));
    return client.forward_backward(batch, LossSpec::value(value_clip));
  }
};

}  // namespace rlloop::algorithms
