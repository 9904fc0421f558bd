// The built-in losses (their formulas below): one row of kLossKernels per row of kLosses (rlloop/loss.hpp), kept
// apart from the model so the math is tested on its own in double precision.
#pragma once
#include <torch/torch.h>

#include <rlloop/loss.hpp>

namespace rlloop::engine {

// Per-token loss inputs, all the same shape as the logprobs ([B, T], padding positions masked out); a loss reads
// those its row of kLosses names (the others may be undefined).
struct LossTensors {
  torch::Tensor mask;        // 1 for real tokens, 0 for padding
  torch::Tensor weights;     // token weights: cross_entropy's w; for the others a per-token factor (1 = as written)
  torch::Tensor advantages;  // A
  torch::Tensor sampler_logprobs;  // q
  torch::Tensor returns;           // R (value)
  torch::Tensor old_values;        // the values the returns were computed with (value; undefined: no clipping)
  // gspo: the tokens of each sequence's ratio (nonzero: in), NaN on the rows of datums without a
  // sequence_ratio_mask (their loss-bearing tokens then); undefined when no datum has one.
  torch::Tensor ratio_mask;
};

// clip_fraction = clipped / bearing: the share of loss-bearing tokens (mask * weight != 0) where the clipped
// branch of the objective is the one taken — ppo: the clipped term is the smaller of min(r A, clamp(r) A); cispo:
// the clamp is active; stable_reinforce: r > C; value: the clipped error is the larger of max(err, err_clip).
// Counts, not weighted sums.
// The counts behind a clip fraction: summed over the shards of a batch they give the whole batch's fraction.
struct ClipCounts {
  double clipped = 0;
  double bearing = 0;
  double fraction() const { return bearing > 0 ? clipped / bearing : 0.0; }
};

struct LossValue {
  torch::Tensor loss;     // scalar, summed over tokens
  // scalar: loss-bearing tokens where the clipped branch was taken (ppo, cispo, gspo, stable_reinforce, value), else 0
  torch::Tensor clipped;
  torch::Tensor bearing;  // scalar: loss-bearing tokens
  double clip_fraction() const { return counts().fraction(); }
  ClipCounts counts() const;
};

// x is the model output the loss's row names (LossInfo::output), carrying the graph: lp, the logprob of each target
// token under the current weights, or v, the value head's values. The RL losses multiply each token's term by its
// weight (datums without "weights" get 1), so weight 0 leaves prompt tokens out.
//   cross_entropy        -(lp * w).sum()
//   importance_sampling  -(r * A).sum()                       r = exp(lp - q)
//   ppo                  -min(r * A, clamp(r, lo, hi) * A).sum()   lo = 1 - epsilon_low, hi = 1 + epsilon_high
//   cispo                -(stopgrad(clamp(r, lo, hi)) * lp * A).sum()
//   dro                  -(lp * A - 0.5 * beta * (lp - q)^2).sum()
//   value                value_loss below, with m = mask * w
//   gspo                 ppo's with r_t = stopgrad(s) * exp(lp_t - stopgrad(lp_t)), s = exp(mean(lp - q)) over the
//                        datum's loss-bearing tokens (weight != 0): every token of a sequence has its ratio's value,
//                        each its own gradient (GSPO-token, Zheng et al. 2025, eq. 13)
//   stable_reinforce     -(stopgrad(min(r, C)) * lp * A - kl_coeff * ((r - 1) - log r)).sum()   C = truncation
//                        (rlloop's reading of Tinker's unpublished objective: docs/algorithms.md)
LossValue builtin_loss(const LossSpec& spec, const torch::Tensor& x, const LossTensors& in);

// The critic's loss on values v [B, T]: 0.5 * sum(m * max((v - R)^2, (v_clip - R)^2)) with
// v_clip = old + clamp(v - old, -clip, clip); without old values (undefined tensor) or with clip 0 it is the plain
// squared error. m = mask * weights. `clipped` counts tokens where the clipped error was the larger one.
LossValue value_loss(const LossSpec& spec, const torch::Tensor& v, const torch::Tensor& returns,
                     const torch::Tensor& old_values, const torch::Tensor& m);

// A loss's code: the row of kLossKernels (loss.cpp) for the row of kLosses with the same LossFn.
struct LossKernel {
  LossFn fn;
  LossValue (*apply)(const LossSpec& spec, const torch::Tensor& x, const LossTensors& in);
  // Whether the loss takes its clipped branch at one token, on host doubles (the service metric actor/pg_clipfrac,
  // computed from the returned logprobs): lp, q, A as above, and log s, the mean of lp - q over its sequence's
  // loss-bearing tokens (gspo's ratio); false for a loss that never clips.
  bool (*clips_token)(const LossSpec& spec, double lp, double q, double advantage, double sequence_log_ratio);
};

// The kernel of a loss; an `fn` that is no enumerator throws invalid_argument.
const LossKernel& loss_kernel(LossFn fn);

}  // namespace rlloop::engine
