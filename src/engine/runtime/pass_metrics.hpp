// The metrics the SageMaker training-session service reports for a forward / forward_backward pass, beside
// rlloop's own ("loss:sum", "clip_fraction"): the names and semantics of the SageMaker SDK's
// ForwardBackwardOutput.metrics (docs/wire.md, "Metrics"). Each is a per-datum mean, except global_token_num
// (a total), so that the SDK's way of folding the chunks of a large batch (a datum-weighted mean of each
// metric, a sum of global_token_num) gives what the whole batch gives.
#pragma once
#include <cstdint>
#include <vector>

#include <rlloop/loss.hpp>
#include <rlloop/types.hpp>

#include "model/model_config.hpp"

namespace rlloop::engine {

// What a pass cost and could have cost.
struct PassCost {
  double seconds = 0;          // wall time of the pass
  double peak_flops = 0;       // the devices' peak FLOP/s (all ranks); 0: unknown, no promised_flops or mfu
  bool base_frozen = false;    // LoRA: the base's weight gradients are not computed
};

// Model FLOPs of a forward pass over sequences of these lengths: 2 per multiply-add of every projection and the
// unembedding, plus causal attention's two products (scores and the weighted sum, each s(s+1)/2 dot products
// of the query width per layer). Embedding lookups, norms and activations are left out, as in PaLM's MFU.
double forward_flops(const ModelConfig& cfg, const std::vector<std::int64_t>& lengths);

// Adds loss, global_token_num, estimated_flops, promised_flops, mfu and, for the policy losses, actor/pg_loss,
// actor/ppo_kl and actor/pg_clipfrac to out.metrics. `out` holds the pass's per-datum logprobs and its
// "loss:sum"; `backward` says whether gradients were computed.
void add_service_metrics(ForwardBackwardOutput& out, const std::vector<Datum>& data, const LossSpec* loss,
                         const ModelConfig& cfg, bool backward, const PassCost& cost);

}  // namespace rlloop::engine
