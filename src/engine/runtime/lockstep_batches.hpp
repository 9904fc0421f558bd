// An expert-parallel session's sampling requests, gathered into batches that the data-parallel group decodes
// together (dist::sample_lockstep_share: one command of the group, every request's rows in each step) instead of one
// request per command. A request joins the batch queued last on the session's lane when that batch has not started,
// nothing else was queued on the lane after it (the session's operations keep their order: a request made after an
// optim_step samples the stepped weights), it samples the same model, and the batch's rows and KV cache stay within
// the limits; otherwise it opens a batch of its own.
#pragma once
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <rlloop/future.hpp>
#include <rlloop/types.hpp>

#include "runtime/engine_loop.hpp"

namespace rlloop::engine {

class LockstepBatches {
 public:
  using Progress = std::function<void(const SampleResponse&)>;
  struct Entry {
    SampleRequest request;
    Progress on_step;  // streaming, when asked for
  };
  // What became of one request: its response, or its error.
  struct Outcome {
    SampleResponse response;
    std::exception_ptr error;
  };
  // Decodes a batch when its turn on the lane comes: one outcome per entry, in order. What it throws fails every
  // request of the batch.
  using Run = std::function<std::vector<Outcome>(const std::vector<Entry>& batch)>;

  // `max_rows`: the most samples (rows) in one batch; `max_kv_bytes`: the most KV cache its requests may take
  // together (kv_bytes_needed; 0: no limit). A request over either runs alone.
  LockstepBatches(int max_rows, std::int64_t max_kv_bytes, Run run);

  // Queues `request` (which may take `kv_bytes` of KV cache) on `lane`, in a new batch or the last one queued (see
  // above).
  Future<SampleResponse> submit(EngineLoop::Lane& lane, SampleRequest request, std::int64_t kv_bytes,
                                Progress on_step);

 private:
  struct Batch;
  void run_batch(Batch& batch);

  int max_rows_;
  std::int64_t max_kv_bytes_;
  Run run_;
  std::mutex mu_;
  std::shared_ptr<Batch> last_;  // the batch queued last
};

}  // namespace rlloop::engine
