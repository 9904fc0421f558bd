// ExpertParallelExecutor (expert_parallel_executor.hpp).
#include "session/expert_parallel_executor.hpp"

namespace rlloop::engine {

ExpertParallelExecutor::ExpertParallelExecutor(SessionCore& core, std::shared_ptr<dist::Coordinator> group)
    : LockstepExecutor(core, std::move(group)) {}

// The other ranks' experts: the checkpoint holds the whole model, as one rank's would.
void ExpertParallelExecutor::gather_state(dist::NamedState& state, bool with_optimizer, bool with_gradients) {
  auto others = group_->gather_experts(replica_, *core_.model, *core_.optimizer, with_optimizer, with_gradients);
  state.weights.merge(others.weights);
  state.optimizer.merge(others.optimizer);
  state.gradients.merge(others.gradients);
}

void ExpertParallelExecutor::distribute_state(const StateContents& checkpoint, bool with_optimizer) {
  group_->load_state(replica_, *core_.model, core_.optimizer, with_optimizer,
                     {checkpoint.weights, checkpoint.optimizer, checkpoint.gradients}, checkpoint.meta.step);
}

Future<SampleResponse> ExpertParallelExecutor::sample(const SampleRequest& request, SampleProgress on_step) {
  return sample_in_step(request, std::move(on_step));
}

Future<std::vector<double>> ExpertParallelExecutor::compute_logprobs(const ComputeLogprobsRequest& request) {
  return logprobs_in_step(request);
}

void ExpertParallelExecutor::require_whole_model(const std::string& operation) const {
  throw unsupported(operation + ": this session's experts are spread over the data-parallel ranks (expert "
                    "parallelism); save_state gathers them: load that checkpoint into a session without expert "
                    "parallelism to export");
}

// This rank holds 1/W of the experts, every other rank as many: the model's counts have W times this rank's experts.
void ExpertParallelExecutor::count_other_ranks(SessionInfo& info) const {
  Transformer& model = *core_.model;
  const std::int64_t others = group_->world_size() - 1;
  for (const auto& [n, t] : model.hf_state_dict())
    if (model.is_expert_tensor(n)) info.num_parameters += others * t.numel();
  for (auto& [n, t] : model.named_trainable_parameters())
    if (model.is_expert_tensor(n)) info.num_trainable_parameters += others * t.numel();
}

}  // namespace rlloop::engine
