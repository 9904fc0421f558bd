// The logistic function and its log, written to stay finite and accurate for large |x| (the preference losses
// evaluate them far in the tails once a margin grows).
#pragma once
#include <cmath>

namespace rlloop::algorithms::detail {

inline double sigmoid(double x) { return x >= 0 ? 1 / (1 + std::exp(-x)) : std::exp(x) / (1 + std::exp(x)); }

// log sigmoid(x) = -log1p(exp(-x)).
inline double log_sigmoid(double x) { return x >= 0 ? -std::log1p(std::exp(-x)) : x - std::log1p(std::exp(x)); }

}  // namespace rlloop::algorithms::detail
