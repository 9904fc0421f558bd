// The executor of a session whose whole model lives in this process: every pass, step and request runs here.
#pragma once
#include "session/executor.hpp"
#include "session/session_core.hpp"

namespace rlloop::engine {

class SingleRankExecutor final : public Executor {
 public:
  explicit SingleRankExecutor(SessionCore& core) : core_(core) {}

  int ranks() const override { return 1; }
  ForwardBackwardOutput forward(const std::vector<Datum>& data, const LossSpec& loss, bool backward) override;
  ForwardBackwardOutput forward_custom(const std::vector<Datum>& data, const CustomLossFn& fn) override;
  bool holds_whole_gradient() const override { return true; }
  Metrics optim_step(const AdamParams& params) override;

  void collect_gradients() override {}  // they are all here
  void gather_state(dist::NamedState&, bool, bool) override {}
  void distribute_state(const StateContents&, bool) override {}

  void load_sampler(const std::string&, Transformer&, const TensorMap&) override {}
  void drop_sampler(const std::string&) override {}
  Future<SampleResponse> sample(const SampleRequest& request, SampleProgress on_step) override;
  Future<std::vector<double>> compute_logprobs(const ComputeLogprobsRequest& request) override;

  void require_whole_model(const std::string&) const override {}
  void count_other_ranks(SessionInfo&) const override {}
  void close() override {}

 private:
  SessionCore& core_;
};

}  // namespace rlloop::engine
