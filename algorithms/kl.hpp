// Per-token estimators of KL(policy || reference) from samples of the policy, with
// log_ratio = logprob_policy - logprob_reference at the sampled token (Schulman's k1, k2, k3).
#pragma once
#include <cmath>

namespace rlloop::algorithms {

// Unbiased, high variance, can be negative.
inline double kl_k1(double log_ratio) { return log_ratio; }
// Biased, low variance, always >= 0.
inline double kl_k2(double log_ratio) { return 0.5 * log_ratio * log_ratio; }
// Unbiased, low variance, always >= 0: (r - 1) - log r with r = p_ref / p_policy.
inline double kl_k3(double log_ratio) { return std::expm1(-log_ratio) + log_ratio; }

}  // namespace rlloop::algorithms
