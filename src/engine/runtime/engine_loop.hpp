// The engine loop of one base model: a single thread that runs the operations of every session on that base,
// so sessions take turns on the device instead of competing for it, and that decodes their sampling requests
// together (continuous batching).
//
// Each session has a Lane: its operations start in submission order, and one at a time, except that consecutive
// sampling requests run side by side (they only read the session's model, so a session's own requests batch
// together as other sessions' do); the operation after them waits until they are done. Across lanes the loop
// interleaves: every turn it admits the sampling requests at the head of idle lanes (oldest first) while
// the batch has room, advances every admitted request by one token in one batched step (decode_step; the prompts
// of requests just admitted are rows of the same step, a chunk at a time: chunked prefill), and
// runs one other operation (training, logprobs, checkpoints) of the lane that has waited longest. A request
// that does not fit waits, and younger requests wait behind it, so none starves; a request larger than the
// whole budget runs alone. The budget is the rows of a step and the KV memory (each request counted at the
// most it can take, so that a request admitted always has the blocks it needs: nothing is preempted).
//
// With data parallelism part of an operation runs on other ranks: a sampling request's other samples, a
// compute_logprobs prompt. Such an operation leaves its lane busy until the other ranks' results are in; the
// loop polls for them between its turns (Deferred) and decodes and trains meanwhile.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include <rlloop/future.hpp>
#include <rlloop/types.hpp>

#include "runtime/sampler.hpp"

namespace rlloop::engine {

struct EngineLoopOptions {
  // Most sample rows (sequences) decoded in one step. Within the few-row product kernels' limit (64) a row's
  // numbers depend on the rows beside it only in the last digits (docs/engine.md).
  int max_batch_rows = 64;
  // The KV cache memory the decoding requests may take together, in bytes, each counted at the most it can take
  // (kv_bytes_needed); 0: no limit but the rows.
  std::int64_t kv_cache_bytes = 0;
  // Most prompt tokens prefilled in one step, across the requests prefilling (decode_step's prefill_tokens).
  std::int64_t prefill_chunk_tokens = kPrefillChunkTokens;
};

// What the loop is doing, for `rlloop info`-style reporting and tests.
struct EngineLoopStats {
  int lanes = 0;                   // sessions using the loop
  int active_requests = 0;         // sampling requests being decoded
  int active_rows = 0;             // their rows in the current batch
  int queued_operations = 0;       // operations waiting in lanes
  int peak_batch_rows = 0;         // the largest batch decoded so far
  int peak_batch_requests = 0;     // the most requests in one step so far
  std::int64_t kv_reserved_bytes = 0;       // KV memory the decoding requests may take (kv_bytes_needed)
  std::int64_t peak_kv_reserved_bytes = 0;  // its largest value so far
  std::uint64_t decode_steps = 0;  // batched steps run
};

class EngineLoop {
  struct Job;
  struct LaneState;

 public:
  // An operation whose result arrives from elsewhere: ready() polls (without blocking, on the loop thread) and
  // take() then returns the result or throws the error. ready() must not throw: an error waits in take().
  template <class T>
  struct Deferred {
    std::function<bool()> ready;
    std::function<T()> take;
  };

  explicit EngineLoop(EngineLoopOptions options = {});
  // Runs every queued operation, then stops the thread.
  ~EngineLoop();
  EngineLoop(const EngineLoop&) = delete;
  EngineLoop& operator=(const EngineLoop&) = delete;

  // A session's queue on the loop. Destroying it waits until its queued operations have run.
  class Lane {
   public:
    ~Lane();
    Lane(const Lane&) = delete;
    Lane& operator=(const Lane&) = delete;

    // Queues fn; its result or exception arrives through the returned future.
    template <class T, class Fn>
    Future<T> submit(Fn fn) {
      auto promise = std::make_shared<Promise<T>>();
      Future<T> future = promise->future();
      enqueue([promise, fn = std::move(fn)]() mutable { promise->fulfil(fn); });
      return future;
    }

    // Queues fn, which starts an operation that finishes elsewhere and returns its Deferred<T>; the lane's next
    // operation waits until it is ready.
    template <class T, class Fn>
    Future<T> submit_deferred(Fn fn) {
      auto promise = std::make_shared<Promise<T>>();
      Future<T> future = promise->future();
      Job job;
      job.defer = [promise, fn = std::move(fn)]() mutable -> Pending {
        try {
          Deferred<T> d = fn();
          return {nullptr, std::move(d.ready), [promise, take = std::move(d.take)] { promise->fulfil(take); }};
        } catch (...) {
          promise->set_exception(std::current_exception());
          return {};
        }
      };
      loop_->push(state_, std::move(job));
      return future;
    }

    // A sampling request: `start` runs on the loop when the request's turn comes and returns its run (validation
    // happens there, and the prefill of a run made with Prefill::at_start; an exception fails this request alone);
    // the run then prefills (Prefill::in_steps) and decodes beside the other
    // sessions' requests; `finish` turns the finished run into the response (billing happens there). `rows`:
    // the rows the request occupies in the batch (its num_samples); `kv_bytes`: the KV cache it may take at most
    // (kv_bytes_needed). Optional: `ready`, polled once the run is
    // done (or failed), holds the request back until the rest of its samples have arrived from other ranks;
    // `on_error` hears of a failure (of `start` or of a step) that the returned future carries.
    Future<SampleResponse> submit_sample(int rows, std::int64_t kv_bytes,
                                         std::function<std::unique_ptr<DecodeRun>()> start,
                                         std::function<SampleResponse(DecodeRun&)> finish,
                                         std::function<bool()> ready = nullptr,
                                         std::function<void(std::exception_ptr)> on_error = nullptr);

    // How many operations have been queued on the lane so far. A caller that saw it move by exactly one across its
    // own submit knows that nothing else was queued in between (LockstepBatches).
    std::uint64_t submissions() const;

   private:
    friend class EngineLoop;
    Lane(std::shared_ptr<EngineLoop> loop, std::shared_ptr<LaneState> state);
    void enqueue(std::function<void()> run);
    std::shared_ptr<EngineLoop> loop_;
    std::shared_ptr<LaneState> state_;
  };

  // The loop is shared by its lanes: it lives while any of them does.
  static std::unique_ptr<Lane> open_lane(const std::shared_ptr<EngineLoop>& loop);

  EngineLoopStats stats() const;

 private:
  // A started operation waiting for results from elsewhere; `complete` delivers them once `ready`.
  struct Pending {
    std::shared_ptr<LaneState> lane;
    std::function<bool()> ready;  // null: nothing to wait for
    std::function<void()> complete;
    bool sampling = false;  // a sampling request's (else an operation's)
  };
  struct Job {
    std::function<void()> run;       // an operation run to completion
    std::function<Pending()> defer;  // or one that finishes elsewhere (submit_deferred)
    int rows = 0;                    // or a sampling request: the batch rows it needs
    std::int64_t kv_bytes = 0;       // and the KV cache it may take
    std::function<std::unique_ptr<DecodeRun>()> start;
    std::function<SampleResponse(DecodeRun&)> finish;
    std::function<bool()> ready;
    std::function<void(std::exception_ptr)> on_error;
    std::shared_ptr<Promise<SampleResponse>> promise;
    bool sampling() const { return static_cast<bool>(start); }
  };
  struct LaneState {
    std::deque<Job> jobs;
    int running = 0;               // its jobs started and not finished (decoding, or waiting for other ranks)
    int running_sampling = 0;      // how many of them are sampling requests
    std::uint64_t head_since = 0;  // when its head job became the head: lanes are served oldest first
    std::uint64_t pushed = 0;      // jobs ever queued (Lane::submissions)
    // Its head job may start when nothing of the lane runs, or when it is a sampling request and so is every
    // running job.
    bool head_can_start() const {
      return !jobs.empty() && (running == 0 || (jobs.front().sampling() && running == running_sampling));
    }
  };
  struct Active {
    std::shared_ptr<LaneState> lane;
    std::unique_ptr<DecodeRun> run;
    Job job;
  };

  void push(const std::shared_ptr<LaneState>& lane, Job job);
  void close(const std::shared_ptr<LaneState>& lane);
  void run();
  // The idle lane whose head job (a sampling one or not, as asked) has waited longest; null if none.
  std::shared_ptr<LaneState> oldest_head(bool sampling) const;
  // Pops the lane's head job and makes its next job the head (called with mu_ held).
  Job pop_head(LaneState& lane);
  // A started job of the lane (a sampling request or not) is done.
  void finish_job(LaneState& lane, bool sampling);
  // Starts the sampling requests that fit; unlocks around each start.
  void admit(std::unique_lock<std::mutex>& lock);
  // One batched decoding step of every active request; finishes those done. Runs unlocked.
  void step_active();
  // A sampling request whose run is done or failed (`error`): completed now, or pending until job.ready(). True
  // when completed (its lane is then finished by the caller).
  bool complete_or_defer(std::shared_ptr<LaneState> lane, Job& job, std::unique_ptr<DecodeRun> run,
                         std::exception_ptr error);
  // Completes the pending operations that are ready. Runs unlocked.
  void poll_pending();

  EngineLoopOptions options_;
  mutable std::mutex mu_;
  std::condition_variable work_cv_;  // the loop waits here for jobs
  std::condition_variable idle_cv_;  // closing lanes wait here for their jobs to finish
  std::list<std::shared_ptr<LaneState>> lanes_;
  std::vector<Active> active_;    // touched by the loop thread only (active_rows_ mirrors it under mu_)
  std::vector<Pending> pending_;  // touched by the loop thread only
  int active_rows_ = 0;
  std::int64_t active_kv_bytes_ = 0;  // the active requests' kv_bytes (under mu_)
  std::uint64_t clock_ = 0;
  EngineLoopStats stats_;
  bool stopping_ = false;
  std::thread worker_;  // last: started once everything above exists
};

}  // namespace rlloop::engine
