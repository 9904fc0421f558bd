// Per-token estimators of KL(policy || reference) from samples of the policy, with
// log_ratio = logprob_policy - logprob_reference at the sampled token (Schulman's k1 and k3). The policy-gradient
// loop (PolicyGradientOptions::kl_coef) subtracts kl_coef * k1 from each token's advantage, the per-token penalty
// of RLHF reward shaping, and reports the mean k3 (PolicyGradientStats::kl).
#pragma once
#include <cmath>

namespace rlloop::algorithms {

// Unbiased, high variance, can be negative.
inline double kl_k1(double log_ratio) { return log_ratio; }
// Unbiased, low variance, always >= 0: (r - 1) - log r with r = p_ref / p_policy.
inline double kl_k3(double log_ratio) { return std::expm1(-log_ratio) + log_ratio; }

}  // namespace rlloop::algorithms
