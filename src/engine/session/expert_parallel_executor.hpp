// The executor of a session whose model's experts are spread over the ranks of a data-parallel group (expert
// parallelism): it trains as a data-parallel session does, but every forward — a sampling step, a scored prompt —
// runs on all ranks in step (LockstepExecutor), since the sparse layers exchange rows at every step; a checkpoint
// gathers the other ranks' experts, and loading one sends each rank its experts. An export, which needs every
// expert on one rank, is refused.
#pragma once
#include <memory>

#include "session/lockstep_executor.hpp"

namespace rlloop::engine {

class ExpertParallelExecutor final : public LockstepExecutor {
 public:
  ExpertParallelExecutor(SessionCore& core, std::shared_ptr<dist::Coordinator> group);

  void gather_state(dist::NamedState& state, bool with_optimizer, bool with_gradients) override;
  void distribute_state(const StateContents& checkpoint, bool with_optimizer) override;

  Future<SampleResponse> sample(const SampleRequest& request, SampleProgress on_step) override;
  Future<std::vector<double>> compute_logprobs(const ComputeLogprobsRequest& request) override;

  void require_whole_model(const std::string& operation) const override;
  void count_other_ranks(SessionInfo& info) const override;
};

}  // namespace rlloop::engine
