// ExpertParallelExecutor (expert_parallel_executor.hpp).
#include "session/expert_parallel_executor.hpp"

#include "runtime/sampler.hpp"

namespace rlloop::engine {

ExpertParallelExecutor::ExpertParallelExecutor(SessionCore& core, std::shared_ptr<dist::Coordinator> group)
    : DataParallelExecutor(core, std::move(group)),
      lockstep_{core.service.max_batch_rows, core.service.kv_cache_mb << 20,
                [this](const std::vector<LockstepBatches::Entry>& batch) { return sample_in_lockstep(batch); }} {}

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
  return lockstep_.submit(*core_.lane, request, kv_bytes_needed(*core_.model, request, core_.decode_precision),
                          std::move(on_step));
}

// Rank 0 scores, the others take part in its exchanges.
Future<std::vector<double>> ExpertParallelExecutor::compute_logprobs(const ComputeLogprobsRequest& request) {
  return core_.lane->submit<std::vector<double>>([this, request] {
    Transformer& m = *core_.sampling_model(request.model_path).model;
    const auto tokens = core_.checked_logprob_tokens(request, m);
    if (tokens.size() < 2) return engine::compute_logprobs(m, tokens);  // no forward: nothing to exchange
    return group_->logprobs_in_lockstep(replica_, SessionCore::sampler_key(request.model_path), m, tokens);
  });
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

// Every rank decodes its share of each request (the shares placed as for any data-parallel request; streamed
// requests and prompt logprobs stay on rank 0, the others then taking part with no rows).
std::vector<LockstepBatches::Outcome> ExpertParallelExecutor::sample_in_lockstep(
    const std::vector<LockstepBatches::Entry>& batch) {
  std::vector<LockstepBatches::Outcome> out(batch.size());
  const std::optional<std::string>& model_path = batch.front().request.model_path;  // the same for all
  SessionCore::SamplingModel& target = core_.sampling_model(model_path);
  dist::LockstepBatch mine;
  mine.model = target.model.get();
  mine.precision = core_.decode_precision;
  mine.rounded = core_.rounded_slot(target);
  mine.prefill_tokens = core_.service.prefill_chunk_tokens;
  std::vector<std::size_t> entry_of;  // the batch entry of each share
  for (std::size_t i = 0; i < batch.size(); ++i) {
    try {
      add_share(mine, batch[i], target.model->config());
      entry_of.push_back(i);
    } catch (...) {
      out[i].error = std::current_exception();  // this request alone
    }
  }
  if (mine.shares.empty()) return out;
  std::vector<dist::LockstepOutcome> outcomes;
  try {
    outcomes = group_->sample_in_lockstep(replica_, SessionCore::sampler_key(model_path), mine);
  } catch (...) {
    for (std::size_t i : entry_of) out[i].error = std::current_exception();
    return out;
  }
  for (std::size_t k = 0; k < outcomes.size(); ++k) {
    LockstepBatches::Outcome& o = out[entry_of[k]];
    if (!outcomes[k].error.empty()) {
      o.error = std::make_exception_ptr(io_error("data-parallel sample failed on " + outcomes[k].error));
      continue;
    }
    o.response = std::move(outcomes[k].response);
    core_.bill_sample(static_cast<std::int64_t>(mine.shares[k].req.prompt.length()), o.response.sequences);
  }
  return out;
}

void ExpertParallelExecutor::add_share(dist::LockstepBatch& mine, const LockstepBatches::Entry& entry,
                                       const ModelConfig& cfg) {
  SessionCore::CheckedSample checked = core_.check_sample(entry.request, cfg);
  SampleRequest& req = checked.request;
  dist::LockstepShare share;
  share.stop_check = std::move(checked.stop_check);
  share.seed = checked.seed;
  const int ranks = group_->world_size();
  const bool spread = !entry.on_step && !req.include_prompt_logprobs && req.topk_prompt_logprobs == 0;
  dist::SamplePlacement placement{std::vector<int>(ranks, 0), std::vector<int>(ranks, 0)};
  if (spread)
    placement = dist::place_samples(req.num_samples, ranks, group_->next_turn());
  else
    placement.count[0] = req.num_samples;
  share.at_once = prefills_at_once(req);
  share.req = std::move(req);
  share.req.num_samples = placement.count[0];
  share.stream = SampleStream(share.seed, placement.first[0]);
  share.on_step = entry.on_step;
  mine.shares.push_back(std::move(share));
  mine.placements.push_back(std::move(placement));
}

}  // namespace rlloop::engine
