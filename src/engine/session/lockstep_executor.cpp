// LockstepExecutor (lockstep_executor.hpp).
#include "session/lockstep_executor.hpp"

#include "runtime/sampler.hpp"

namespace rlloop::engine {

LockstepExecutor::LockstepExecutor(SessionCore& core, std::shared_ptr<dist::Coordinator> group)
    : DataParallelExecutor(core, std::move(group)),
      lockstep_{core.service.max_batch_rows, core.service.kv_cache_mb << 20,
                [this](const std::vector<LockstepBatches::Entry>& batch) { return sample_in_lockstep(batch); }} {}

Future<SampleResponse> LockstepExecutor::sample_in_step(const SampleRequest& request, SampleProgress on_step) {
  return lockstep_.submit(*core_.lane, request, kv_bytes_needed(*core_.model, request, core_.decode_precision),
                          std::move(on_step));
}

// Rank 0 scores, the others take part in its exchanges.
Future<std::vector<double>> LockstepExecutor::logprobs_in_step(const ComputeLogprobsRequest& request) {
  return core_.lane->submit<std::vector<double>>([this, request] {
    Transformer& m = *core_.sampling_model(request.model_path).model;
    const auto tokens = core_.checked_logprob_tokens(request, m);
    if (tokens.size() < 2) return engine::compute_logprobs(m, tokens);  // no forward: nothing to exchange
    return group_->logprobs_in_lockstep(replica_, SessionCore::sampler_key(request.model_path), m, tokens);
  });
}

// Every rank decodes its share of each request (the shares placed as for any data-parallel request; streamed
// requests and prompt logprobs stay on rank 0, the others then taking part with no rows).
std::vector<LockstepBatches::Outcome> LockstepExecutor::sample_in_lockstep(
    const std::vector<LockstepBatches::Entry>& batch) {
  std::vector<LockstepBatches::Outcome> out(batch.size());
  const std::optional<std::string>& model_path = batch.front().request.model_path;  // the same for all
  SessionCore::SamplingModel& target = core_.sampling_model(model_path);
  dist::LockstepBatch mine;
  mine.model = target.model.get();
  mine.precision = core_.decode_precision;
  mine.rounded = core_.rounded_slot(target);
  mine.prefill_tokens = core_.service.prefill_chunk_tokens;
  mine.tensor_parallel = decodes_tensor_parallel(*target.model);
  mine.kv_capacity_bytes = core_.service.kv_cache_mb << 20;
  // The live model's slice is kept between batches (a slice has KV pools of its own: one per session, not per
  // sampler model).
  if (SessionCore::sampler_key(model_path).empty()) mine.slice = &target.slice;
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

void LockstepExecutor::add_share(dist::LockstepBatch& mine, const LockstepBatches::Entry& entry,
                                 const ModelConfig& cfg) {
  SessionCore::CheckedSample checked = core_.check_sample(entry.request, cfg);
  SampleRequest& req = checked.request;
  dist::LockstepShare share;
  share.stop_check = std::move(checked.stop_check);
  share.seed = checked.seed;
  const int ranks = group_->world_size();
  const bool spread = !entry.on_step && !req.include_prompt_logprobs && req.topk_prompt_logprobs == 0;
  dist::SamplePlacement placement{std::vector<int>(ranks, 0), std::vector<int>(ranks, 0)};
  if (mine.tensor_parallel)
    placement.count.assign(static_cast<std::size_t>(ranks), req.num_samples);  // every rank decodes all of them
  else if (spread)
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
