// Advantage policies for the policy-gradient core: how a group of rewards (one prompt, N samples) becomes
// one advantage per sample. Each is a type, so GRPO, Dr. GRPO and RLOO differ by a template argument.
#pragma once
#include <cmath>
#include <span>
#include <vector>

#include <rlloop/error.hpp>

namespace rlloop::algorithms {

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
