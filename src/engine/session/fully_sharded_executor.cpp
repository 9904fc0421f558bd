// FullyShardedExecutor (fully_sharded_executor.hpp).
#include "session/fully_sharded_executor.hpp"

#include <rlloop/error.hpp>

#include "session/session_core.hpp"

namespace rlloop::engine {

namespace {
// Where a fully sharded session's live weights cannot go, the way there.
std::string live_weights_unsupported(const std::string& operation) {
  return operation + ": this session is fully sharded (each rank holds 1/W of its weights), and its live weights "
                     "are not sampled yet: save_weights_for_sampler and give its path";
}
}  // namespace

FullyShardedExecutor::FullyShardedExecutor(SessionCore& core, std::shared_ptr<dist::Coordinator> group)
    : DataParallelExecutor(core, std::move(group)) {
  core_.build_optimizer();  // over the shards open() left
}

void FullyShardedExecutor::gather_state(dist::NamedState& state, bool with_optimizer, bool with_gradients) {
  // Whole tensors under the same names replace the shards rank 0 read from its own model.
  dist::NamedState whole =
      group_->gather_shards(replica_, *core_.model, *core_.optimizer, with_optimizer, with_gradients);
  for (auto& [name, t] : whole.weights) state.weights[name] = std::move(t);
  if (with_optimizer)
    for (auto& [name, t] : whole.optimizer) state.optimizer[name] = std::move(t);
  state.gradients.clear();
  if (with_gradients) state.gradients = std::move(whole.gradients);
}

bool FullyShardedExecutor::load_parts(const StateContents& checkpoint, bool with_optimizer) {
  const dist::NamedState whole{.weights = checkpoint.weights,
                               .optimizer = with_optimizer ? checkpoint.optimizer : TensorMap{},
                               .gradients = with_optimizer ? checkpoint.gradients : TensorMap{}};
  group_->load_shards(replica_, *core_.model, core_.optimizer, with_optimizer, whole, checkpoint.meta.step);
  return true;
}

Future<SampleResponse> FullyShardedExecutor::sample(const SampleRequest& request, SampleProgress on_step) {
  if (!request.model_path) throw unsupported(live_weights_unsupported("sample"));
  return DataParallelExecutor::sample(request, std::move(on_step));
}

Future<std::vector<double>> FullyShardedExecutor::compute_logprobs(const ComputeLogprobsRequest& request) {
  if (!request.model_path) throw unsupported(live_weights_unsupported("compute_logprobs"));
  return DataParallelExecutor::compute_logprobs(request);
}

void FullyShardedExecutor::require_whole_model(const std::string& operation) const {
  throw unsupported(operation + ": this session is fully sharded (each rank holds 1/W of its weights); save_state "
                                "gathers them: export that checkpoint, or load it into a session that is not sharded");
}

// The model's own counts are this rank's shards (its module's full weights are 0-element placeholders).
void FullyShardedExecutor::count_other_ranks(SessionInfo& info) const {
  const std::int64_t whole = core_.model->sharded_elements();
  std::int64_t mine = 0;
  for (auto& [name, t] : core_.model->named_trainable_parameters()) mine += t.numel();
  info.num_parameters += whole;
  info.num_trainable_parameters += whole - mine;
}

}  // namespace rlloop::engine
