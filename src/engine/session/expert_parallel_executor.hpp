// The executor of a session whose model's experts are spread over the ranks of a data-parallel group (expert
// parallelism): it trains as a data-parallel session does, but every forward — a sampling step, a scored prompt —
// runs on all ranks in step, since the sparse layers exchange rows at every step; a checkpoint gathers the other
// ranks' experts, and loading one sends each rank its experts. An export, which needs every expert on one rank, is
// refused.
#pragma once
#include <memory>
#include <vector>

#include "runtime/lockstep_batches.hpp"
#include "session/data_parallel_executor.hpp"

namespace rlloop::engine {

class ExpertParallelExecutor final : public DataParallelExecutor {
 public:
  ExpertParallelExecutor(SessionCore& core, std::shared_ptr<dist::Coordinator> group);

  void gather_state(dist::NamedState& state, bool with_optimizer, bool with_gradients) override;
  void distribute_state(const StateContents& checkpoint, bool with_optimizer) override;

  Future<SampleResponse> sample(const SampleRequest& request, SampleProgress on_step) override;
  Future<std::vector<double>> compute_logprobs(const ComputeLogprobsRequest& request) override;

  void require_whole_model(const std::string& operation) const override;
  void count_other_ranks(SessionInfo& info) const override;

 private:
  // A batch of sampling requests decoded by every rank in step, in one command of the group, run on the session's
  // lane (its base's engine loop waits meanwhile).
  std::vector<LockstepBatches::Outcome> sample_in_lockstep(const std::vector<LockstepBatches::Entry>& batch);
  // `entry`'s share of the batch `mine` (checked against `cfg`); throws what the request's checks throw.
  void add_share(dist::LockstepBatch& mine, const LockstepBatches::Entry& entry, const ModelConfig& cfg);

  // The session's sampling requests, batched (sample_in_lockstep runs each batch).
  LockstepBatches lockstep_;
};

}  // namespace rlloop::engine
