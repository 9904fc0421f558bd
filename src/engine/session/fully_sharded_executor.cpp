// FullyShardedExecutor (fully_sharded_executor.hpp).
#include "session/fully_sharded_executor.hpp"

#include <rlloop/error.hpp>

#include "session/session_core.hpp"

namespace rlloop::engine {

FullyShardedExecutor::FullyShardedExecutor(SessionCore& core, std::shared_ptr<dist::Coordinator> group)
    : LockstepExecutor(core, std::move(group)) {
  core_.build_optimizer();  // over the shards open() left
}

// Sharded gradients hold the summed gradients already: nothing to fold. Adapters are folded as replicas' are.
void FullyShardedExecutor::collect_gradients() {
  if (!trains_shards()) DataParallelExecutor::collect_gradients();
}

void FullyShardedExecutor::gather_state(dist::NamedState& state, bool with_optimizer, bool with_gradients) {
  if (!trains_shards()) return;  // the adapters are whole on every rank
  // Whole tensors under the same names replace the shards rank 0 read from its own model.
  dist::NamedState whole =
      group_->gather_shards(replica_, *core_.model, *core_.optimizer, with_optimizer, with_gradients);
  for (auto& [name, t] : whole.weights) state.weights[name] = std::move(t);
  if (with_optimizer)
    for (auto& [name, t] : whole.optimizer) state.optimizer[name] = std::move(t);
  state.gradients.clear();
  if (with_gradients) state.gradients = std::move(whole.gradients);
}

void FullyShardedExecutor::distribute_state(const StateContents& checkpoint, bool with_optimizer) {
  if (!trains_shards()) DataParallelExecutor::distribute_state(checkpoint, with_optimizer);  // load_parts did it
}

bool FullyShardedExecutor::load_parts(const StateContents& checkpoint, bool with_optimizer) {
  if (!trains_shards()) return false;
  const dist::NamedState whole{.weights = checkpoint.weights,
                               .optimizer = with_optimizer ? checkpoint.optimizer : TensorMap{},
                               .gradients = with_optimizer ? checkpoint.gradients : TensorMap{}};
  group_->load_shards(replica_, *core_.model, core_.optimizer, with_optimizer, whole, checkpoint.meta.step);
  return true;
}

// A LoRA session's models all share the sharded base; a full fine-tuning session's saved sampler weights are whole.
bool FullyShardedExecutor::sharded(const std::optional<std::string>& model_path) const {
  return !trains_shards() || SessionCore::sampler_key(model_path).empty();
}

bool FullyShardedExecutor::decodes_tensor_parallel(const Transformer& model) const {
  return model.fully_sharded() && model.why_not_tensor_parallel(group_->world_size()).empty();
}

Future<SampleResponse> FullyShardedExecutor::sample(const SampleRequest& request, SampleProgress on_step) {
  if (sharded(request.model_path)) return sample_in_step(request, std::move(on_step));
  return DataParallelExecutor::sample(request, std::move(on_step));
}

Future<std::vector<double>> FullyShardedExecutor::compute_logprobs(const ComputeLogprobsRequest& request) {
  if (sharded(request.model_path)) return logprobs_in_step(request);
  return DataParallelExecutor::compute_logprobs(request);
}

void FullyShardedExecutor::require_whole_model(const std::string& operation) const {
  if (trains_shards())
    throw unsupported(operation + ": this session is fully sharded (each rank holds 1/W of its weights); save_state "
                                  "gathers them: export that checkpoint, or load it into a session that is not "
                                  "sharded");
  throw unsupported(operation + ": this session's base is fully sharded (each rank holds 1/W of it); its adapters "
                                "are whole: export them (PEFT), or load its checkpoint into a session that is not "
                                "sharded");
}

// The model's own counts hold this rank's shards (its module's full weights are 0-element placeholders).
void FullyShardedExecutor::count_other_ranks(SessionInfo& info) const {
  const std::int64_t whole = core_.model->sharded_elements();
  info.num_parameters += whole;
  if (!trains_shards()) return;
  std::int64_t mine = 0;
  for (auto& [name, t] : core_.model->named_trainable_parameters()) mine += t.numel();
  info.num_trainable_parameters += whole - mine;
}

}  // namespace rlloop::engine
