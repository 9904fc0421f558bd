// The executor of a session replicated on every rank of a data-parallel group (dist::Coordinator): a pass splits its
// batch over the ranks, the step sums their gradients, a checkpoint loaded here is sent to the replicas, and
// sampling requests and compute_logprobs prompts are shared out over the ranks while the group works (after it
// failed, everything stays on this rank).
#pragma once
#include <memory>

#include "dist/coordinator.hpp"
#include "session/executor.hpp"
#include "session/session_core.hpp"

namespace rlloop::engine {

class DataParallelExecutor : public Executor {
 public:
  // Opens the session's replica on every rank.
  DataParallelExecutor(SessionCore& core, std::shared_ptr<dist::Coordinator> group);

  int ranks() const override { return group_->world_size(); }
  ForwardBackwardOutput forward(const std::vector<Datum>& data, const LossSpec& loss, bool backward) override;
  ForwardBackwardOutput forward_custom(const std::vector<Datum>& data, const CustomLossFn& fn) override;
  // Each rank holds only its share until the step sums them.
  bool holds_whole_gradient() const override { return false; }
  Metrics optim_step(const AdamParams& params) override;

  void collect_gradients() override;
  void gather_state(dist::NamedState&, bool, bool) override {}  // every rank holds the whole model
  void distribute_state(const StateContents& checkpoint, bool with_optimizer) override;

  void load_sampler(const std::string& key, Transformer& model, const TensorMap& checkpoint) override;
  void drop_sampler(const std::string& key) override;
  Future<SampleResponse> sample(const SampleRequest& request, SampleProgress on_step) override;
  Future<std::vector<double>> compute_logprobs(const ComputeLogprobsRequest& request) override;

  void require_whole_model(const std::string&) const override {}
  void count_other_ranks(SessionInfo&) const override {}
  void close() override;

 protected:
  SessionCore& core_;
  std::shared_ptr<dist::Coordinator> group_;
  std::uint64_t replica_ = 0;  // the session's id in the group
};

}  // namespace rlloop::engine
