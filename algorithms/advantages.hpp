// Advantage policies for the policy-gradient core (policy_gradient.hpp): how scored completions become
// per-token advantages. Each is a type, so GRPO, Dr. GRPO, RLOO and PPO differ by a template argument. Two kinds
// satisfy AdvantagePolicy:
//   GroupAdvantage   a group of rewards (one prompt, N samples) -> one advantage per sample, from the rewards
//                    alone (GroupNormalized, GroupCentered, LeaveOneOut below)
//   CriticAdvantage  a learned value function scores every token and is trained alongside the policy
//                    (CriticGae in gae.hpp)
#pragma once
#include <cmath>
#include <concepts>
#include <span>
#include <vector>

#include <rlloop/clients.hpp>
#include <rlloop/error.hpp>

#include <rlloop/algorithms/rollout.hpp>

namespace rlloop::algorithms {

// Maps the rewards of one prompt's group to one advantage per sample, e.g.
//   struct Rank { std::vector<double> operator()(std::span<const double> rewards) const; };
template <class A>
concept GroupAdvantage = std::copy_constructible<A> && requires(const A& a, std::span<const double> rewards) {
  { a(rewards) } -> std::convertible_to<std::vector<double>>;
};

// What a critic reports about its fit to a batch.
struct CriticReport {
  double explained_variance = 0;  // of the returns by the rollout-time values: 1 = perfect critic
};

// A learned value function as the baseline. The loop calls
//   check_session(client)        once, at construction: throws when the session cannot serve the critic
//   estimate(client, rollouts)   per batch: each rollout's `advantages` holds its per-token rewards on entry;
//                                the critic fills values and returns and replaces the rewards by advantages
//   train(client, minibatch)     per minibatch, submitted before its optim_step: the critic's own loss
template <class C, class S>
concept CriticAdvantage = std::copy_constructible<C> && requires(const C& c, TrainingClient<S>& client,
                                                                 std::vector<Rollout>& rollouts,
                                                                 std::span<const Rollout> minibatch) {
  c.check_session(client);
  { c.estimate(client, rollouts) } -> std::same_as<CriticReport>;
  { c.train(client, minibatch) } -> std::same_as<Future<ForwardBackwardOutput>>;
};

template <class A, class S>
concept AdvantagePolicy = GroupAdvantage<A> || CriticAdvantage<A, S>;

namespace detail {
inline double mean_of(std::span<const double> v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0.0 : s / static_cast<double>(v.size());
}
// Population standard deviation (divides by N), as GRPO implementations compute it.
inline double std_of(std::span<const double> v) {
  const double m = mean_of(v);
  double s = 0;
  for (double x : v) s += (x - m) * (x - m);
  return v.empty() ? 0.0 : std::sqrt(s / static_cast<double>(v.size()));
}
}  // namespace detail

// GRPO: (r - mean) / (std + eps).
struct GroupNormalized {
  double eps = 1e-6;
  std::vector<double> operator()(std::span<const double> rewards) const {
    const double m = detail::mean_of(rewards), s = detail::std_of(rewards);
    std::vector<double> a;
    for (double r : rewards) a.push_back((r - m) / (s + eps));
    return a;
  }
};

// Dr. GRPO: r - mean (dividing by the std favours groups that are almost solved or almost failed).
struct GroupCentered {
  std::vector<double> operator()(std::span<const double> rewards) const {
    const double m = detail::mean_of(rewards);
    std::vector<double> a;
    for (double r : rewards) a.push_back(r - m);
    return a;
  }
};

// RLOO: r_i - mean of the other N-1 rewards (an unbiased baseline).
struct LeaveOneOut {
  std::vector<double> operator()(std::span<const double> rewards) const {
    const auto n = static_cast<double>(rewards.size());
    if (rewards.size() < 2) throw invalid_argument("LeaveOneOut advantages need groups of at least 2 samples");
    double total = 0;
    for (double r : rewards) total += r;
    std::vector<double> a;
    for (double r : rewards) a.push_back(r - (total - r) / (n - 1));
    return a;
  }
};

}  // namespace rlloop::algorithms
