#include "runtime/engine_loop.hpp"

#include <algorithm>
#include <chrono>

#include <rlloop/error.hpp>

namespace rlloop::engine {

EngineLoop::EngineLoop(EngineLoopOptions options) : options_(options) {
  if (options_.max_batch_rows < 1)
    throw invalid_argument("EngineLoopOptions.max_batch_rows must be at least 1, got " +
                           std::to_string(options_.max_batch_rows));
  if (options_.kv_cache_bytes < 0)
    throw invalid_argument("EngineLoopOptions.kv_cache_bytes must not be negative, got " +
                           std::to_string(options_.kv_cache_bytes));
  if (options_.prefill_chunk_tokens < 1)
    throw invalid_argument("EngineLoopOptions.prefill_chunk_tokens must be at least 1, got " +
                           std::to_string(options_.prefill_chunk_tokens));
  worker_ = std::thread([this] { run(); });
}

EngineLoop::~EngineLoop() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  worker_.join();
}

std::unique_ptr<EngineLoop::Lane> EngineLoop::open_lane(const std::shared_ptr<EngineLoop>& loop) {
  auto state = std::make_shared<LaneState>();
  {
    std::lock_guard lock(loop->mu_);
    loop->lanes_.push_back(state);
  }
  return std::unique_ptr<Lane>(new Lane(loop, std::move(state)));
}

EngineLoopStats EngineLoop::stats() const {
  std::lock_guard lock(mu_);
  EngineLoopStats s = stats_;
  s.lanes = static_cast<int>(lanes_.size());
  s.queued_operations = 0;
  for (const auto& lane : lanes_) s.queued_operations += static_cast<int>(lane->jobs.size());
  return s;
}

// ------------------------------------------------------------------------------------------------ lanes

EngineLoop::Lane::Lane(std::shared_ptr<EngineLoop> loop, std::shared_ptr<LaneState> state)
    : loop_(std::move(loop)), state_(std::move(state)) {}

EngineLoop::Lane::~Lane() { loop_->close(state_); }

void EngineLoop::Lane::enqueue(std::function<void()> run) {
  Job job;
  job.run = std::move(run);
  loop_->push(state_, std::move(job));
}

std::uint64_t EngineLoop::Lane::submissions() const {
  std::lock_guard lock(loop_->mu_);
  return state_->pushed;
}

Future<SampleResponse> EngineLoop::Lane::submit_sample(int rows, std::int64_t kv_bytes,
                                                       std::function<std::unique_ptr<DecodeRun>()> start,
                                                       std::function<SampleResponse(DecodeRun&)> finish,
                                                       std::function<bool()> ready,
                                                       std::function<void(std::exception_ptr)> on_error) {
  Job job;
  job.rows = std::max(rows, 1);
  job.kv_bytes = std::max<std::int64_t>(kv_bytes, 0);
  job.start = std::move(start);
  job.finish = std::move(finish);
  job.ready = std::move(ready);
  job.on_error = std::move(on_error);
  job.promise = std::make_shared<Promise<SampleResponse>>();
  Future<SampleResponse> future = job.promise->future();
  loop_->push(state_, std::move(job));
  return future;
}

void EngineLoop::push(const std::shared_ptr<LaneState>& lane, Job job) {
  {
    std::lock_guard lock(mu_);
    if (lane->jobs.empty()) lane->head_since = ++clock_;
    lane->jobs.push_back(std::move(job));
    ++lane->pushed;
  }
  work_cv_.notify_one();
}

void EngineLoop::close(const std::shared_ptr<LaneState>& lane) {
  std::unique_lock lock(mu_);
  idle_cv_.wait(lock, [&] { return lane->jobs.empty() && lane->running == 0; });
  lanes_.remove(lane);
}

// ------------------------------------------------------------------------------------------------- loop

std::shared_ptr<EngineLoop::LaneState> EngineLoop::oldest_head(bool sampling) const {
  std::shared_ptr<LaneState> best;
  for (const auto& lane : lanes_) {
    if (!lane->head_can_start()) continue;
    if (lane->jobs.front().sampling() != sampling) continue;
    if (!best || lane->head_since < best->head_since) best = lane;
  }
  return best;
}

EngineLoop::Job EngineLoop::pop_head(LaneState& lane) {
  Job job = std::move(lane.jobs.front());
  lane.jobs.pop_front();
  ++lane.running;
  if (job.sampling()) ++lane.running_sampling;
  // Its next job queues behind the heads that waited meanwhile: lanes take turns.
  if (!lane.jobs.empty()) lane.head_since = ++clock_;
  return job;
}

void EngineLoop::finish_job(LaneState& lane, bool sampling) {
  --lane.running;
  if (sampling) --lane.running_sampling;
  if (lane.running == 0 && !lane.jobs.empty()) lane.head_since = ++clock_;
  idle_cv_.notify_all();
}

bool EngineLoop::complete_or_defer(std::shared_ptr<LaneState> lane, Job& job, std::unique_ptr<DecodeRun> run,
                                   std::exception_ptr error) {
  if (error && job.on_error) job.on_error(error);
  std::shared_ptr<DecodeRun> done = std::move(run);
  auto complete = [promise = job.promise, finish = job.finish, done, error] {
    if (error)
      promise->set_exception(error);
    else
      promise->fulfil([&] { return finish(*done); });
  };
  // Even a failed request waits for its other ranks: they still read the session's model until they are done.
  if (job.ready && !job.ready()) {
    pending_.push_back({std::move(lane), job.ready, std::move(complete), /*sampling=*/true});
    return false;
  }
  complete();
  return true;
}

void EngineLoop::admit(std::unique_lock<std::mutex>& lock) {
  for (;;) {
    std::shared_ptr<LaneState> lane = oldest_head(/*sampling=*/true);
    if (!lane) return;
    // The oldest request waits for room, rows and KV memory (and so do younger ones: none overtakes it); alone it
    // always fits.
    const Job& next = lane->jobs.front();
    const bool rows_full = active_rows_ + next.rows > options_.max_batch_rows;
    const bool kv_full = options_.kv_cache_bytes > 0 && active_kv_bytes_ + next.kv_bytes > options_.kv_cache_bytes;
    if (active_rows_ > 0 && (rows_full || kv_full)) return;
    Job job = pop_head(*lane);
    lock.unlock();
    std::unique_ptr<DecodeRun> run;
    std::exception_ptr error;
    try {
      run = job.start();
    } catch (...) {
      error = std::current_exception();
    }
    const bool decoding = run && !run->done() && !error;
    const bool completed = !decoding && complete_or_defer(lane, job, std::move(run), error);
    lock.lock();
    if (!decoding) {
      if (completed) finish_job(*lane, /*sampling=*/true);
      continue;
    }
    active_rows_ += static_cast<int>(run->rows());
    active_kv_bytes_ += job.kv_bytes;
    stats_.kv_reserved_bytes = active_kv_bytes_;
    stats_.peak_kv_reserved_bytes = std::max(stats_.peak_kv_reserved_bytes, active_kv_bytes_);
    active_.push_back({std::move(lane), std::move(run), std::move(job)});
  }
}

void EngineLoop::step_active() {
  std::vector<DecodeRun*> runs;
  int rows = 0;
  for (auto& a : active_) {
    runs.push_back(a.run.get());
    rows += static_cast<int>(a.run->rows());
  }
  std::exception_ptr error;
  try {
    decode_step(runs, options_.prefill_chunk_tokens);
  } catch (...) {
    // A step fails only for what no request could be checked for beforehand (memory, a device error): every
    // request in it gets the error, and the loop goes on.
    error = std::current_exception();
  }
  std::vector<Active> finished;
  for (auto it = active_.begin(); it != active_.end();) {
    if (error || it->run->done()) {
      finished.push_back(std::move(*it));
      it = active_.erase(it);
    } else {
      ++it;
    }
  }
  std::vector<std::shared_ptr<LaneState>> completed;
  for (auto& a : finished)
    if (complete_or_defer(a.lane, a.job, std::move(a.run), error)) completed.push_back(a.lane);
  std::lock_guard lock(mu_);
  ++stats_.decode_steps;
  stats_.peak_batch_rows = std::max(stats_.peak_batch_rows, rows);
  stats_.peak_batch_requests = std::max(stats_.peak_batch_requests, static_cast<int>(runs.size()));
  active_rows_ = 0;
  active_kv_bytes_ = 0;
  for (const auto& a : active_) {
    active_rows_ += static_cast<int>(a.run->rows());
    active_kv_bytes_ += a.job.kv_bytes;
  }
  stats_.kv_reserved_bytes = active_kv_bytes_;
  stats_.active_requests = static_cast<int>(active_.size());
  stats_.active_rows = active_rows_;
  for (auto& lane : completed) finish_job(*lane, /*sampling=*/true);
}

void EngineLoop::poll_pending() {
  std::vector<std::pair<std::shared_ptr<LaneState>, bool>> completed;  // the lane, and whether a sampling request's
  for (auto it = pending_.begin(); it != pending_.end();) {
    if (it->ready()) {
      it->complete();
      completed.emplace_back(std::move(it->lane), it->sampling);
      it = pending_.erase(it);
    } else {
      ++it;
    }
  }
  if (completed.empty()) return;
  std::lock_guard lock(mu_);
  for (auto& [lane, sampling] : completed) finish_job(*lane, sampling);
}

void EngineLoop::run() {
  // How often the loop polls for other ranks' results when it has nothing else to do.
  constexpr auto kPendingPoll = std::chrono::milliseconds(1);
  std::unique_lock lock(mu_);
  for (;;) {
    if (!pending_.empty()) {
      lock.unlock();
      poll_pending();
      lock.lock();
    }
    admit(lock);
    stats_.active_requests = static_cast<int>(active_.size());
    stats_.active_rows = active_rows_;
    if (!active_.empty()) {
      lock.unlock();
      step_active();
      lock.lock();
    }
    // One other operation per turn, between decoding steps: sampling requests keep moving during training.
    if (std::shared_ptr<LaneState> lane = oldest_head(/*sampling=*/false)) {
      Job job = pop_head(*lane);
      lock.unlock();
      // A submitted job delivers its own exceptions through its future.
      Pending pending;
      if (job.defer)
        pending = job.defer();
      else
        job.run();
      const bool waits = static_cast<bool>(pending.ready);
      if (waits) {
        pending.lane = lane;
        pending_.push_back(std::move(pending));
      }
      lock.lock();
      if (!waits) finish_job(*lane, /*sampling=*/false);
      continue;
    }
    if (!active_.empty() || oldest_head(/*sampling=*/true)) continue;
    if (!pending_.empty()) {
      work_cv_.wait_for(lock, kPendingPoll);
      continue;
    }
    if (stopping_) return;
    work_cv_.wait(lock);
  }
}

}  // namespace rlloop::engine
