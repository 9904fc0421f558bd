#include "runtime/lockstep_batches.hpp"

#include <algorithm>
#include <utility>

#include <rlloop/error.hpp>

namespace rlloop::engine {

struct LockstepBatches::Batch {
  std::string model;  // the requests' model_path ("" for the session's model)
  int rows = 0;
  std::int64_t kv_bytes = 0;
  // The lane's submissions() just after the batch was queued; 0 when another operation may have been queued
  // between its submit and that count: nothing joins it then.
  std::uint64_t queued_at = 0;
  bool started = false;
  std::vector<Entry> entries;
  std::vector<std::shared_ptr<Promise<SampleResponse>>> promises;
};

LockstepBatches::LockstepBatches(int max_rows, std::int64_t max_kv_bytes, Run run)
    : max_rows_(std::max(max_rows, 1)), max_kv_bytes_(std::max<std::int64_t>(max_kv_bytes, 0)), run_(std::move(run)) {}

Future<SampleResponse> LockstepBatches::submit(EngineLoop::Lane& lane, SampleRequest request, std::int64_t kv_bytes,
                                               Progress on_step) {
  auto promise = std::make_shared<Promise<SampleResponse>>();
  Future<SampleResponse> future = promise->future();
  const std::string model = request.model_path.value_or("");
  const int rows = std::max(request.num_samples, 1);
  std::lock_guard lock(mu_);
  auto join = [&](Batch& batch) {
    batch.rows += rows;
    batch.kv_bytes += kv_bytes;
    batch.entries.push_back({std::move(request), std::move(on_step)});
    batch.promises.push_back(std::move(promise));
  };
  const bool fits = last_ && last_->rows + rows <= max_rows_ &&
                    (max_kv_bytes_ == 0 || last_->kv_bytes + kv_bytes <= max_kv_bytes_);
  if (fits && !last_->started && last_->model == model && last_->queued_at == lane.submissions()) {
    join(*last_);
    return future;
  }
  auto batch = std::make_shared<Batch>();
  batch->model = model;
  join(*batch);
  const std::uint64_t before = lane.submissions();
  lane.submit<bool>([this, batch] {
    run_batch(*batch);
    return true;
  });
  const std::uint64_t after = lane.submissions();
  batch->queued_at = after == before + 1 ? after : 0;
  last_ = std::move(batch);
  return future;
}

void LockstepBatches::run_batch(Batch& batch) {
  {
    std::lock_guard lock(mu_);  // no request joins from now on
    batch.started = true;
  }
  std::vector<Outcome> outcomes;
  try {
    outcomes = run_(batch.entries);
    if (outcomes.size() != batch.entries.size())
      throw io_error("expert-parallel sampling: " + std::to_string(outcomes.size()) + " outcomes for a batch of " +
                     std::to_string(batch.entries.size()) + " requests");
  } catch (...) {
    outcomes.assign(batch.entries.size(), Outcome{{}, std::current_exception()});
  }
  for (std::size_t i = 0; i < outcomes.size(); ++i) {
    if (outcomes[i].error)
      batch.promises[i]->set_exception(outcomes[i].error);
    else
      batch.promises[i]->set_value(std::move(outcomes[i].response));
  }
  batch.entries.clear();  // the batch may stay `last_` for long: its prompts go now
  batch.promises.clear();
}

}  // namespace rlloop::engine
