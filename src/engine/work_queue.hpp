// A single worker thread that runs submitted jobs in submission order: a session's operations execute
// strictly in sequence while the caller keeps submitting.
#pragma once
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include <rlloop/future.hpp>

namespace rlloop::engine {

class WorkQueue {
 public:
  WorkQueue() : worker_([this] { run(); }) {}
  ~WorkQueue() {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }
  WorkQueue(const WorkQueue&) = delete;
  WorkQueue& operator=(const WorkQueue&) = delete;

  // Queues fn; its result or exception arrives through the returned future.
  template <class T, class Fn>
  Future<T> submit(Fn fn) {
    auto promise = std::make_shared<Promise<T>>();
    Future<T> future = promise->future();
    {
      std::lock_guard lock(mu_);
      jobs_.push_back([promise, fn = std::move(fn)]() mutable { promise->fulfil(fn); });
    }
    cv_.notify_one();
    return future;
  }

 private:
  void run() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
        if (jobs_.empty()) return;  // stopping, and everything submitted has run
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      job();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  bool stopping_ = false;
  std::thread worker_;
};

}  // namespace rlloop::engine
