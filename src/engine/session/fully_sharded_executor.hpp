// The executor of a fully sharded session (DataParallelOptions::shard "full", docs/distributed.md): every rank of
// the data-parallel group keeps 1/W of the session's weights, gradients and optimizer state
// (Transformer::set_fully_sharded) and gathers each layer only while a pass computes it. Its passes and steps are
// the replicated session's commands (the shares run their passes gathered, the step takes the reduce-scattered
// gradients as they are); a checkpoint is gathered whole on rank 0 (gather_state), and a loaded one cut into every
// rank's parts (load_parts). Sampling and scoring take sampler weights saved to a path (whole, as any replicated
// session's); the live shards are not sampled yet, and exports need a checkpoint.
#pragma once
#include "session/data_parallel_executor.hpp"

namespace rlloop::engine {

class FullyShardedExecutor : public DataParallelExecutor {
 public:
  // Opens the session's replica on every rank, each rank then keeping its shards; the optimizer is made afresh
  // over them.
  FullyShardedExecutor(SessionCore& core, std::shared_ptr<dist::Coordinator> group);

  // The shards hold the summed gradients already: nothing to fold.
  void collect_gradients() override {}
  void gather_state(dist::NamedState& state, bool with_optimizer, bool with_gradients) override;
  void distribute_state(const StateContents&, bool) override {}  // load_parts did it
  bool load_parts(const StateContents& checkpoint, bool with_optimizer) override;

  Future<SampleResponse> sample(const SampleRequest& request, SampleProgress on_step) override;
  Future<std::vector<double>> compute_logprobs(const ComputeLogprobsRequest& request) override;

  void require_whole_model(const std::string& operation) const override;
  void count_other_ranks(SessionInfo& info) const override;
};

}  // namespace rlloop::engine
