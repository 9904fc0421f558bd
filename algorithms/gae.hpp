// Generalised advantage estimation and the clipped value loss of PPO with a critic, as free functions on plain
// arrays: the math a PPO-with-critic loop needs once the engine can score values (see the report in issue 4).
//
//   delta_t = r_t + gamma * V_{t+1} * (1 - done_t) - V_t
//   A_t     = delta_t + gamma * lambda * (1 - done_t) * A_{t+1}
//   R_t     = A_t + V_t                                  (the critic's regression target)
//
// done_t = 1 means the episode ended after step t: nothing after it is bootstrapped or credited. V_T (the value
// after the last step of a truncated trajectory) is `bootstrap_value`.
#pragma once
#include <algorithm>
#include <cmath>
#include <span>
#include <string>
#include <vector>

#include <rlloop/error.hpp>

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

// Sequence-level reward as per-token rewards: zero everywhere except the last token (the usual LLM setting,
// where the reward model or verifier scores the whole completion).
inline std::vector<double> terminal_rewards(std::size_t length, double reward) {
  if (length == 0) throw invalid_argument("terminal_rewards: length must be >= 1");
  std::vector<double> r(length, 0.0);
  r.back() = reward;
  return r;
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

// PPO's clipped value loss for one token: the new value may move at most `clip` away from the value at
// rollout time, and the worse of the clipped and unclipped errors is taken (so clipping never helps the loss):
//   v_clip = old + clamp(v - old, -clip, clip)
//   loss   = 0.5 * max((v - R)^2, (v_clip - R)^2)
// grad is d loss / d v (0 when the clipped error is the larger one and the clamp is active).
struct ValueLossTerm {
  double loss = 0, grad = 0;
  bool clipped = false;  // the clipped error was the one used
};

inline ValueLossTerm clipped_value_loss(double value, double old_value, double target, double clip) {
  if (!(clip > 0)) throw invalid_argument("clipped_value_loss: clip must be > 0");
  const double v_clip = old_value + std::clamp(value - old_value, -clip, clip);
  const double e = value - target, ec = v_clip - target;
  if (e * e >= ec * ec) return {0.5 * e * e, e, false};
  const bool clamp_active = std::abs(value - old_value) > clip;
  return {0.5 * ec * ec, clamp_active ? 0.0 : ec, true};
}

}  // namespace rlloop::algorithms
