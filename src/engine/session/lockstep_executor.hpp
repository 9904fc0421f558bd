// The part of a data-parallel session's executor whose model computes on every rank at once, so that each forward
// runs on all ranks in step (expert parallelism: the sparse layers exchange rows at every step; fully sharded
// parallelism: every layer is gathered from the ranks): sampling requests are batched and decoded by every rank
// together, each rank its share of the samples (or, where decodes_tensor_parallel, every rank all of them over its
// slice of the model: tensor_parallel.hpp), and a scored prompt is scored by rank 0 while the others run the model
// over no rows.
#pragma once
#include <memory>
#include <vector>

#include "runtime/lockstep_batches.hpp"
#include "session/data_parallel_executor.hpp"

namespace rlloop::engine {

class LockstepExecutor : public DataParallelExecutor {
 public:
  LockstepExecutor(SessionCore& core, std::shared_ptr<dist::Coordinator> group);

 protected:
  // Whether `model`'s samples are decoded tensor-parallel.
  virtual bool decodes_tensor_parallel(const Transformer&) const { return false; }
  Future<SampleResponse> sample_in_step(const SampleRequest& request, SampleProgress on_step);
  Future<std::vector<double>> logprobs_in_step(const ComputeLogprobsRequest& request);

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
