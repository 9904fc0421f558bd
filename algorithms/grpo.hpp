// GRPO and its variants as type choices over the policy-gradient core (policy_gradient.hpp).
#pragma once
#include <rlloop/algorithms/policy_gradient.hpp>

namespace rlloop::algorithms {

// GRPO: group-normalised advantages, per-sequence mean of token losses.
template <Session S>
using GRPO = PolicyGradient<S, GroupNormalized, SequenceMean>;

// Dr. GRPO: mean-centred advantages (no std), a constant normaliser instead of the sequence length.
template <Session S>
using DrGRPO = PolicyGradient<S, GroupCentered, ConstantNormalizer>;

// DAPO's aggregation: token mean over the batch (pair it with epsilon_high > epsilon_low, e.g. 0.28 / 0.2).
template <Session S>
using DAPO = PolicyGradient<S, GroupNormalized, TokenMean>;

// RLOO: leave-one-out baseline, per-sequence mean.
template <Session S>
using RLOO = PolicyGradient<S, LeaveOneOut, SequenceMean>;

}  // namespace rlloop::algorithms
