// The executor of a fully sharded session (DataParallelOptions::shard "full", docs/distributed.md): every rank of the
// data-parallel group keeps 1/W of the model's weights and gathers each layer only while a pass computes it. Full
// fine-tuning shards the gradients and optimizer state too (Transformer::set_fully_sharded): the passes and steps are
// the replicated session's commands (the shares run their passes gathered, the step takes the reduce-scattered
// gradients as they are); a checkpoint is gathered whole on rank 0 (gather_state), and a loaded one cut into every
// rank's parts (load_parts). A LoRA session shares its base's shards and trains replicated adapters: it steps, saves
// and loads as a replicated session does. Its sharded models (the live one; a LoRA session's sampler models too, over
// the same base) sample on every rank in step (LockstepExecutor): tensor-parallel where the model can be cut over the
// group (every rank's slice cut from the shards, kept for the live model while its weights are unchanged, then every
// rank decodes the whole batch over its slice: tensor_parallel.hpp), each layer gathered per decoding step otherwise;
// they score with each layer gathered. A full fine-tuning session's saved sampler weights are whole models, sampled
// as any replicated session's. Exports that need the base whole are refused, naming the way (a checkpoint).
#pragma once
#include "session/lockstep_executor.hpp"

namespace rlloop::engine {

class FullyShardedExecutor final : public LockstepExecutor {
 public:
  // Opens the session's replica on every rank, each rank then keeping its shards; the optimizer is made afresh
  // over them.
  FullyShardedExecutor(SessionCore& core, std::shared_ptr<dist::Coordinator> group);

  void collect_gradients() override;
  void gather_state(dist::NamedState& state, bool with_optimizer, bool with_gradients) override;
  void distribute_state(const StateContents& checkpoint, bool with_optimizer) override;
  bool load_parts(const StateContents& checkpoint, bool with_optimizer) override;

  Future<SampleResponse> sample(const SampleRequest& request, SampleProgress on_step) override;
  Future<std::vector<double>> compute_logprobs(const ComputeLogprobsRequest& request) override;

  void require_whole_model(const std::string& operation) const override;
  void count_other_ranks(SessionInfo& info) const override;

 protected:
  // A sharded model decodes tensor-parallel where it can be cut over the group (the gathered layers otherwise).
  bool decodes_tensor_parallel(const Transformer& model) const override;

 private:
  // Whether the model of `model_path` (the live one: none) is sharded, so that it computes in step.
  bool sharded(const std::optional<std::string>& model_path) const;
  // Full fine-tuning: the shards are what trains.
  bool trains_shards() const { return core_.model->trains_shards(); }
};

}  // namespace rlloop::engine
