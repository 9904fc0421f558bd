// Rank 0 of a data-parallel group: starts the local workers, waits for every rank, and runs each command of
// its sessions on all ranks (replica_ops.hpp). Commands run one at a time, in the order they are called, from
// any thread (each base model's engine loop calls in for its sessions).
#pragma once
#include <sys/types.h>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <rlloop/error.hpp>
#include <rlloop/local.hpp>

#include "device.hpp"
#include "dist/group.hpp"
#include "optimizer.hpp"
#include "session_model.hpp"
#include "transformer.hpp"

namespace rlloop::engine::dist {

// What every rank must share to compute the same thing: LibTorch's version, the device kind and the dtype.
std::string group_fingerprint(const DeviceChoice& dev);

class Coordinator {
 public:
  Coordinator(const LocalServiceOptions& service, const DeviceChoice& dev);
  // Tells the workers to exit (unless the group failed) and reaps the local ones.
  ~Coordinator();
  Coordinator(const Coordinator&) = delete;
  Coordinator& operator=(const Coordinator&) = delete;

  int world_size() const { return group_->size(); }

  // A session's replica on every rank, made from `options`; `made` is rank 0's (already made). Returns the
  // replica's id for the calls below.
  std::uint64_t open(const SessionOptions& options, const SessionModel& made);
  void close(std::uint64_t id);
  ForwardBackwardOutput forward(std::uint64_t id, Transformer& model, const std::vector<Datum>& data,
                                const LossSpec& loss, bool backward);
  ForwardBackwardOutput forward_custom(std::uint64_t id, Transformer& model, const std::vector<Datum>& data,
                                       const CustomLossFn& fn);
  Metrics optim_step(std::uint64_t id, AdamW& optimizer, const AdamParams& params);
  // After load_state on rank 0.
  void sync_state(std::uint64_t id, Transformer& model, std::unique_ptr<AdamW>& optimizer, bool with_optimizer);

  DataParallelStats stats() const;
  // Empty while the group works; readable while a command runs.
  std::string failure() const;

 private:
  void start_local_workers(const LocalServiceOptions& service, const DeviceChoice& dev, int count);
  void stop_local_workers();

  // Runs a command's share, noting a group failure where failure() can read it without waiting for mu_.
  template <class Fn>
  auto noting_failure(Fn fn) {
    try {
      return fn();
    } catch (const group_failure& e) {
      group_->mark_failed(e.what());  // also when a share failed after the others changed their replicas
      std::lock_guard lock(failure_mu_);
      if (failure_.empty()) failure_ = e.what();
      throw;
    }
  }

  mutable std::mutex mu_;  // one command at a time
  mutable std::mutex failure_mu_;
  std::string failure_;
  std::unique_ptr<Group> group_;
  std::vector<pid_t> workers_;
  std::uint64_t next_id_ = 0;
};

}  // namespace rlloop::engine::dist
