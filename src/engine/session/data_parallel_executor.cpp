// DataParallelExecutor (data_parallel_executor.hpp).
#include "session/data_parallel_executor.hpp"

#include "comm/codec.hpp"
#include "session/lane_requests.hpp"

namespace rlloop::engine {

DataParallelExecutor::DataParallelExecutor(SessionCore& core, std::shared_ptr<dist::Coordinator> group)
    : core_(core), group_(std::move(group)) {
  replica_ = group_->open(core_.options, {core_.shared_base, core_.model, core_.weights_hash});
}

ForwardBackwardOutput DataParallelExecutor::forward(const std::vector<Datum>& data, const LossSpec& loss,
                                                    bool backward) {
  return group_->forward(replica_, *core_.model, data, loss, backward);
}

ForwardBackwardOutput DataParallelExecutor::forward_custom(const std::vector<Datum>& data, const CustomLossFn& fn) {
  return group_->forward_custom(replica_, *core_.model, data, fn);
}

Metrics DataParallelExecutor::optim_step(const AdamParams& params) {
  return group_->optim_step(replica_, *core_.model, *core_.optimizer, params);
}

void DataParallelExecutor::collect_gradients() { group_->fold_gradients(replica_, *core_.model, *core_.optimizer); }

void DataParallelExecutor::distribute_state(const StateContents&, bool with_optimizer) {
  group_->sync_state(replica_, *core_.model, core_.optimizer, with_optimizer);
}

void DataParallelExecutor::load_sampler(const std::string& key, Transformer& model, const TensorMap& checkpoint) {
  if (group_->failure().empty()) group_->load_sampler(replica_, key, model, checkpoint);
}

void DataParallelExecutor::drop_sampler(const std::string& key) {
  try {
    group_->drop_sampler(replica_, key);
  } catch (const group_failure&) {
    // The group is gone, and its copies with it.
  }
}

// The live model's samples are shared out over the ranks (place_samples; the ranks take turns at the larger shares,
// so single samples go to each in turn), each rank decoding its own from the request's streams: the tokens are
// those of one rank. Sampler weights from a checkpoint too: the workers hold what rank 0's sampler cache holds.
// Staying on rank 0: streamed requests (their progress is rank 0's rows), prompt logprobs, and everything once the
// group has failed.
Future<SampleResponse> DataParallelExecutor::sample(const SampleRequest& request, SampleProgress on_step) {
  const bool spread = group_->failure().empty() && !on_step && !request.include_prompt_logprobs &&
                      request.topk_prompt_logprobs == 0 && request.num_samples >= 1;
  if (!spread)
    return sample_on_lane(core_, request, std::move(on_step), dist::SamplePlacement{{0}, {request.num_samples}},
                          nullptr);
  dist::SamplePlacement placement =
      dist::place_samples(request.num_samples, group_->world_size(), group_->next_turn());
  PostShares post = [this, placement, path = request.model_path](const SampleRequest& checked, std::uint64_t seed) {
    return group_->post_sample(replica_, SessionCore::sampler_key(path), checked, seed, core_.decode_precision,
                               placement);
  };
  return sample_on_lane(core_, request, std::move(on_step), std::move(placement), std::move(post));
}

// The prompts go to the ranks in turn (the workers hold the sampler models too).
Future<std::vector<double>> DataParallelExecutor::compute_logprobs(const ComputeLogprobsRequest& request) {
  const int rank = group_->failure().empty() ? group_->next_turn() : 0;
  if (rank == 0) return logprobs_on_lane(core_, request);
  return core_.lane->submit_deferred<std::vector<double>>([this, request, rank] {
    auto tokens = core_.checked_logprob_tokens(request, *core_.sampling_model(request.model_path).model);
    auto replies = group_->post_logprobs(replica_, SessionCore::sampler_key(request.model_path), tokens, rank);
    return EngineLoop::Deferred<std::vector<double>>{[replies] { return replies->ready(); },
                                                     [replies] {
                                                       const auto reply = replies->take();
                                                       dist::ByteReader r(reply[0]);
                                                       return r.get_vector<double>();
                                                     }};
  });
}

void DataParallelExecutor::close() {
  try {
    group_->close(replica_);
  } catch (const group_failure&) {
    // The group failed while closing: its replicas are gone with it.
  }
}

}  // namespace rlloop::engine
