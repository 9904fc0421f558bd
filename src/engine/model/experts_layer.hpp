// The sparse MLP of a model's layers as its forward runs it: routing (by the router, or replayed), the recording of
// the routes, and the dispatch of the routed rows to the experts, on this rank (run_experts) or across an
// expert-parallel group (run_experts_parallel), per model in a step of several (its adapters on the experts). The
// experts' weights are the model's (model_weights.hpp); the grouped products are experts.hpp's.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include <torch/torch.h>

#include "model/expert_parallel.hpp"
#include "model/experts.hpp"
#include "model/model_weights.hpp"
#include "model/step_context.hpp"

namespace rlloop::engine {

class ExpertsLayer {
 public:
  // The experts of sparse layer `li` of `w` over h [B, T, H] (rows [B * T, H] out): routed by the router, each row
  // through its experts. In a step of several groups whose adapters reach the router or the experts, each model's
  // rows run through its own (its own routes too); otherwise every row through the base's at once.
  torch::Tensor forward(const ModelWeights& w, std::size_t li, const torch::Tensor& h, const StepContext& in) const;
  // hidden_states' routing for `tokens` tokens: a model with experts, a mask of [tokens] and a replay of
  // [tokens, sparse layers, k] int64 expert ids in [0, num_experts) when given.
  static void check_routing(const ModelWeights& w, const ExpertRouting& routing, std::int64_t tokens);

  // Routes through `group` from now on (Transformer::set_expert_parallel): `w` must hold rank r's slice.
  void set_parallel(const ModelWeights& w, dist::Group& group);
  bool parallel() const { return shard_.group != nullptr; }
  // Whether `name` belongs to an expert of a sparse layer of `w` (Transformer::is_expert_tensor).
  static bool is_expert_tensor(const ModelWeights& w, const std::string& name);
  // The rank that holds expert tensor `name` under expert parallelism, else -1 (Transformer::expert_rank_of).
  int rank_of(const ModelWeights& w, const std::string& name) const;

 private:
  // Rows [row0, row0 + x's rows) through `layer`'s router and experts; `sparse_index`: the layer's place among the
  // sparse ones (its slice of the routing's [tokens, sparse layers, k]).
  torch::Tensor through(const ModelWeights& w, const Layer& layer, std::int64_t sparse_index, const torch::Tensor& x,
                        std::int64_t row0, bool step, ExpertRouting* routing) const;

  // Expert parallelism: the group and this rank's slice of the experts; no group: none.
  ExpertShard shard_;
};

}  // namespace rlloop::engine
