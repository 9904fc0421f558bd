// SingleRankExecutor (single_rank_executor.hpp).
#include "session/single_rank_executor.hpp"

#include "session/lane_requests.hpp"
#include "runtime/batch.hpp"
#include "runtime/loss.hpp"

namespace rlloop::engine {

ForwardBackwardOutput SingleRankExecutor::forward(const std::vector<Datum>& data, const LossSpec& loss,
                                                  bool backward) {
  return run_builtin_loss(*core_.model, data, loss, backward);
}

ForwardBackwardOutput SingleRankExecutor::forward_custom(const std::vector<Datum>& data, const CustomLossFn& fn) {
  return run_custom_loss(*core_.model, data, fn);
}

Metrics SingleRankExecutor::optim_step(const AdamParams& params) { return core_.optimizer->step(params); }

Future<SampleResponse> SingleRankExecutor::sample(const SampleRequest& request, SampleProgress on_step) {
  return sample_on_lane(core_, request, std::move(on_step), dist::SamplePlacement{{0}, {request.num_samples}},
                        nullptr);
}

Future<std::vector<double>> SingleRankExecutor::compute_logprobs(const ComputeLogprobsRequest& request) {
  return logprobs_on_lane(core_, request);
}

}  // namespace rlloop::engine
