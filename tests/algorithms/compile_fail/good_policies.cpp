// Control for the bad_*.cpp snippets: the same declarations with policies that fit compile.
#include <cstddef>
#include <span>
#include <vector>

#include <rlloop/algorithms/callbacks.hpp>
#include <rlloop/algorithms/grpo.hpp>
#include <rlloop/algorithms/ppo.hpp>
#include <rlloop/algorithms/sft.hpp>
#include <rlloop/session.hpp>

// A user's own group advantage: the rank of each reward within its group.
struct RankAdvantage {
  std::vector<double> operator()(std::span<const double> rewards) const {
    std::vector<double> a;
    for (double r : rewards) {
      double below = 0;
      for (double other : rewards) below += other < r ? 1.0 : 0.0;
      a.push_back(below);
    }
    return a;
  }
};

// A user's own aggregation: every token weighs the same.
struct UnitWeights {
  std::vector<double> operator()(const std::vector<std::size_t>& lengths, int /*max_tokens*/) const {
    return std::vector<double>(lengths.size(), 1.0);
  }
};

using MyGrpo = rlloop::algorithms::PolicyGradient<rlloop::AnySession, RankAdvantage, UnitWeights>;
static_assert(rlloop::algorithms::AdvantagePolicy<rlloop::algorithms::CriticGae, rlloop::AnySession>);
static_assert(rlloop::algorithms::StepStats<rlloop::algorithms::SftStats>);

int train_sft(rlloop::algorithms::Sft<rlloop::AnySession>& sft, const std::vector<rlloop::Datum>& batch) {
  return static_cast<int>(rlloop::algorithms::train(sft, 10, [&] { return batch; }).step);
}

int main() {
  MyGrpo* algo = nullptr;
  return algo == nullptr ? 0 : 1;
}
