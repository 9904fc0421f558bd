// A data-parallel worker: the replicas of rank 0's sessions, and the loop that runs rank 0's commands on them.
#include <map>

#include <rlloop/error.hpp>
#include <rlloop/local.hpp>

#include "base_models.hpp"
#include "dist/codec.hpp"
#include "dist/coordinator.hpp"
#include "dist/replica_ops.hpp"
#include "session_model.hpp"

namespace rlloop {

namespace {

struct Replica {
  engine::SessionModel model;
  std::unique_ptr<engine::AdamW> optimizer;
};

class Worker {
 public:
  Worker(const DataParallelWorkerOptions& options, engine::DeviceChoice dev, std::unique_ptr<engine::dist::Group> group)
      : options_(options), dev_(dev), group_(std::move(group)), bases_(engine::EngineLoopOptions{}) {}

  // Runs commands until the shutdown command.
  void run() {
    using engine::dist::Command;
    for (;;) {
      const std::string bytes = group_->next_command();
      engine::dist::ByteReader r(bytes);
      const auto command = r.get<Command>();
      const auto id = r.get<std::uint64_t>();
      switch (command) {
        case Command::open:
          open(id, r.get_session_options());
          break;
        case Command::close:
          replicas_.erase(id);
          engine::dist::acknowledge(*group_);
          break;
        case Command::forward: {
          const bool backward = r.get<bool>();
          const LossSpec loss = r.get_loss_spec();
          const auto data = r.get_data();
          engine::dist::forward_share(*group_, *replica(id).model.model, data, loss, backward);
          break;
        }
        case Command::forward_custom:
          engine::dist::custom_share(*group_, *replica(id).model.model, r.get_data(), nullptr);
          break;
        case Command::optim_step:
          engine::dist::optim_step_share(*group_, *replica(id).optimizer, r.get_adam_params());
          break;
        case Command::sync_state: {
          Replica& rep = replica(id);
          engine::dist::sync_state_share(*group_, *rep.model.model, rep.optimizer, r.get<bool>());
          break;
        }
        case Command::shutdown:
          engine::dist::acknowledge(*group_);
          return;
      }
    }
  }

 private:
  void open(std::uint64_t id, const SessionOptions& options) {
    Replica rep;
    std::string error;
    try {
      rep.model =
          engine::make_session_model(bases_, resolve_base_model(options_.service, options.base_model), dev_, options);
      rep.optimizer = engine::make_optimizer(*rep.model.model);
    } catch (const std::exception& e) {
      error = e.what();
    }
    try {
      engine::dist::open_replica(*group_, rep.model.model ? &rep.model : nullptr, error, options.base_model);
    } catch (const invalid_argument&) {
      return;  // some rank could not hold it: rank 0 reports why, and no rank keeps it
    }
    replicas_.emplace(id, std::move(rep));
  }

  // Rank 0 only sends commands for sessions it opened on every rank.
  Replica& replica(std::uint64_t id) {
    auto it = replicas_.find(id);
    if (it == replicas_.end())
      throw group_failure("data-parallel worker " + std::to_string(group_->rank()) + ": rank 0 named session " +
                          std::to_string(id) + ", which this rank does not hold");
    return it->second;
  }

  DataParallelWorkerOptions options_;
  engine::DeviceChoice dev_;
  std::unique_ptr<engine::dist::Group> group_;
  engine::BaseModelRegistry bases_;  // the frozen bases the replicas share (its engine loops go unused)
  std::map<std::uint64_t, Replica> replicas_;
};

}  // namespace

void run_data_parallel_worker(const DataParallelWorkerOptions& options) {
  const auto dev = engine::choose_device(options.service.device);
  engine::dist::GroupOptions go;
  std::tie(go.host, go.port) = engine::dist::parse_host_port(options.rendezvous, "worker --rendezvous");
  if (go.port == 0) throw invalid_argument("worker --rendezvous: port 0 is for rank 0 alone; give rank 0's port");
  go.rank = options.rank;
  go.world_size = options.world_size;
  go.timeout = engine::dist::timeout_of(options.timeout_s, "worker --timeout-s");
  go.fingerprint = engine::dist::group_fingerprint(dev);
  go.cuda = dev.device.is_cuda();
  Worker worker(options, dev, engine::dist::Group::join(go));
  worker.run();
}

}  // namespace rlloop
