// Expert parallelism: the experts of every sparse layer spread over the ranks of a c10d group, rank r of W holding
// experts [r E / W, (r + 1) E / W) (Transformer's ExpertRange), each rank routing its own tokens. A sparse layer
// sends every routed row to the rank that holds its expert and gets the expert's output back, by two all-to-alls
// (Gloo on the CPU, NCCL on GPUs; the counts travel on the rows' device), differentiable: backward sends the
// gradients back the way the rows came, so each expert's weights get the gradient of every rank's tokens, as on one
// rank.
#pragma once
#include <cstdint>
#include <vector>

#include <torch/torch.h>

#include "model/experts.hpp"

namespace rlloop::engine {

namespace dist {
class Group;
}

// The experts this rank holds and the group that holds the others.
struct ExpertShard {
  dist::Group* group = nullptr;
  std::int64_t first = 0;     // this rank's first expert
  std::int64_t per_rank = 0;  // experts per rank (E / W)
  // Rank r's slice of `num_experts`; invalid_argument when the group's size does not divide them.
  static ExpertShard of(dist::Group& group, std::int64_t num_experts);
};

// run_experts with the experts spread over `shard`'s group: x [N, H] this rank's tokens (N may be 0), routes by
// global expert id, `local` this rank's experts (shard.first onwards) and `adapters` (null: none) theirs. Every rank
// of the group must call it for the same layer at the same time. The outputs add up per token in expert order, as
// run_experts adds them.
torch::Tensor run_experts_parallel(const torch::Tensor& x, const Routes& routes, const std::vector<Expert>& local,
                                   const ExpertAdapters* adapters, const ExpertShard& shard,
                                   const ExpertActivation& activation);

}  // namespace rlloop::engine
