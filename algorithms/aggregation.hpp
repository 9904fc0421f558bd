// Loss-aggregation policies. The engine sums per-token losses; how GRPO variants average them is expressed
// as a per-token weight that multiplies each token's term (weights in the datum):
//   SequenceMean        GRPO:     mean over sequences of the mean over each sequence's tokens -> 1 / (len_i * N)
//   ConstantNormalizer  Dr. GRPO: sum over all tokens / (N * max_tokens)                       -> 1 / (N * max_tokens)
//   TokenMean           DAPO:     sum over all tokens / total tokens                           -> 1 / sum(len)
#pragma once
#include <cstddef>
#include <numeric>
#include <vector>

namespace rlloop::algorithms {

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
