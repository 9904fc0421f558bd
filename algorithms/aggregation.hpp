// Loss-aggregation policies. The engine sums per-token losses; how GRPO variants average them is expressed
// as a per-token weight that multiplies each token's term (weights in the datum):
//   SequenceMean        GRPO:     mean over sequences of the mean over each sequence's tokens -> 1 / (len_i * N)
//   ConstantNormalizer  Dr. GRPO: sum over all tokens / (N * max_tokens)                       -> 1 / (N * max_tokens)
//   TokenMean           DAPO, PPO: sum over all tokens / total tokens                          -> 1 / sum(len)
// Each policy maps a minibatch's completion lengths (and SamplingParams::max_tokens) to one weight per completion.
#pragma once
#include <concepts>
#include <cstddef>
#include <numeric>
#include <vector>

namespace rlloop::algorithms {

template <class G>
concept AggregationPolicy =
    std::copy_constructible<G> && requires(const G& g, const std::vector<std::size_t>& lengths, int max_tokens) {
      { g(lengths, max_tokens) } -> std::convertible_to<std::vector<double>>;
    };

struct SequenceMean {
  std::vector<double> operator()(const std::vector<std::size_t>& lengths, int /*max_tokens*/) const {
    std::vector<double> w;
    for (auto len : lengths) w.push_back(1.0 / (static_cast<double>(len) * static_cast<double>(lengths.size())));
    return w;
  }
};

struct ConstantNormalizer {
  std::vector<double> operator()(const std::vector<std::size_t>& lengths, int max_tokens) const {
    return std::vector<double>(lengths.size(),
                               1.0 / (static_cast<double>(lengths.size()) * static_cast<double>(max_tokens)));
  }
};

struct TokenMean {
  std::vector<double> operator()(const std::vector<std::size_t>& lengths, int /*max_tokens*/) const {
    const double total = static_cast<double>(std::accumulate(lengths.begin(), lengths.end(), std::size_t{0}));
    return std::vector<double>(lengths.size(), 1.0 / total);
  }
};

}  // namespace rlloop::algorithms
