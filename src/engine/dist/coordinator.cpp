#include "dist/coordinator.hpp"

#include <spawn.h>
#include <sys/wait.h>
#include <csignal>
#include <thread>

#include <torch/torch.h>

#include <rlloop/error.hpp>

#include "runtime/batch.hpp"
#include "comm/codec.hpp"
#include "dist/operation_commands.hpp"
#include "dist/replica_ops.hpp"

extern char** environ;

namespace rlloop::engine::dist {

namespace {

// Command C for replica `id`, sent while running the operations Ops (none: the replica's lifecycle). Compiles only
// where operation_commands.hpp's table lists C for each of them.
template <Command C, class... Ops>
ByteWriter command_for(std::uint64_t id) {
  static_assert(sizeof...(Ops) > 0 ? (sends<Ops>(C) && ...) : is_lifecycle(C),
                "this command is not in the GroupCommands entry of the operation it is sent for");
  ByteWriter w;
  w.put(C);
  w.put(id);
  return w;
}

// A local worker's device: with CUDA, one device per rank (the ranks after rank 0's, wrapping around).
std::string worker_device(const DeviceChoice& dev, int rank) {
  if (!dev.device.is_cuda()) return "cpu";
  const int count = static_cast<int>(torch::cuda::device_count());
  return "cuda:" + std::to_string((std::max<int>(dev.device.index(), 0) + rank) % std::max(count, 1));
}

// The messages that carry each worker's share (rank 0's own is not sent).
std::vector<std::string> encode_all(const std::vector<Share>& shares) {
  std::vector<std::string> out(shares.size());
  for (std::size_t r = 1; r < shares.size(); ++r) out[r] = encode(shares[r]);
  return out;
}

// How long the workers get to exit after the shutdown command before they are killed.
constexpr auto kWorkerExitGrace = std::chrono::seconds(10);

}  // namespace

std::string group_fingerprint(const DeviceChoice& dev, const std::string& backend, const LocalServiceOptions& service) {
  std::string experts;
  if (service.data_parallel.expert_parallel)
    experts = service.activation_checkpointing ? ", expert-parallel, activation checkpointing" : ", expert-parallel";
  const std::string sharded = service.data_parallel.shard == "full" ? ", fully sharded" : "";
  return std::string("libtorch ") + TORCH_VERSION + " on " + (dev.device.is_cuda() ? "cuda" : "cpu") + " as " +
         c10::toString(dev.dtype) + " over " + backend + experts + sharded;
}

void check_shard_mode(const std::string& shard) {
  if (shard != "none" && shard != "full")
    throw invalid_argument("data_parallel.shard is '" + shard + "'; expected none or full");
}

bool shards_sessions(const std::string& shard) { return shard == "full"; }

bool is_loopback(const std::string& host) {
  return host == "localhost" || host == "::1" || host == "[::1]" || host.rfind("127.", 0) == 0;
}

std::string resolve_tensor_backend(const std::string& requested, const DeviceChoice& dev, int local_ranks, int gpus,
                                   bool nccl_built) {
  if (requested != "auto" && requested != "gloo" && requested != "nccl")
    throw invalid_argument("data_parallel.backend must be auto, gloo or nccl, got '" + requested + "'");
  const bool cuda = dev.device.is_cuda();
  const bool own_gpu = local_ranks <= gpus;
  if (requested == "nccl") {
    if (!cuda) throw invalid_argument("data_parallel.backend nccl needs the weights on CUDA (--device cuda)");
    if (!nccl_built) throw invalid_argument("data_parallel.backend nccl: this LibTorch was built without NCCL");
    if (!own_gpu)
      throw invalid_argument("data_parallel.backend nccl needs one GPU per rank: " + std::to_string(local_ranks) +
                             " ranks on this host, " + std::to_string(gpus) +
                             " GPU(s); backend gloo runs several ranks on one GPU");
    return "nccl";
  }
  if (requested == "auto" && cuda && nccl_built && own_gpu) return "nccl";
  return "gloo";
}

std::string tensor_backend_here(const std::string& requested, const DeviceChoice& dev,
                                const std::string& rendezvous_host, int world_size, int ranks_known_here) {
  const int gpus = dev.device.is_cuda() ? static_cast<int>(torch::cuda::device_count()) : 0;
  const int here = is_loopback(rendezvous_host) ? world_size : ranks_known_here;
  return resolve_tensor_backend(requested, dev, here, gpus, nccl_built());
}

Coordinator::Coordinator(const LocalServiceOptions& service, const DeviceChoice& dev) {
  const auto& dp = service.data_parallel;
  if (dp.world_size < 2) throw invalid_argument("data_parallel.world_size must be at least 2 for a group");
  const int local = dp.local_workers < 0 ? dp.world_size - 1 : dp.local_workers;
  if (local > dp.world_size - 1)
    throw invalid_argument("data_parallel.local_workers is " + std::to_string(local) + ", more than the " +
                           std::to_string(dp.world_size - 1) + " workers of world size " +
                           std::to_string(dp.world_size));
  if (local > 0 && dp.worker_program.empty())
    throw invalid_argument("data_parallel.worker_program must name the rlloop executable to start local workers");
  check_shard_mode(dp.shard);
  GroupOptions go;
  std::tie(go.host, go.port) = parse_host_port(dp.rendezvous, "data_parallel.rendezvous");
  // Rank 0's collectives listen on the rendezvous host, and the workers connect to what it advertises there.
  if (go.host == "0.0.0.0" || go.host == "::" || go.host == "[::]")
    throw invalid_argument("data_parallel.rendezvous: '" + dp.rendezvous +
                           "' is a wildcard; give an address of this host that every worker reaches");
  go.rank = 0;
  go.world_size = dp.world_size;
  go.timeout = timeout_of(dp.timeout_s, "data_parallel.timeout_s");
  backend_ = tensor_backend_here(dp.backend, dev, go.host, dp.world_size, local + 1);  // rank 0 and its workers
  go.fingerprint = group_fingerprint(dev, backend_, service);
  expert_parallel_ = dp.expert_parallel;
  shard_ = dp.shard;
  go.nccl = backend_ == "nccl";
  go.external_store = dp.external_store;
  go.store_prefix = dp.store_prefix;
  if (go.external_store && go.port == 0)
    throw invalid_argument("data_parallel.rendezvous: port 0 names no store; an external store needs its port");
  group_ = Group::listen(go);
  start_local_workers(service, dev, local);
  try {
    group_->wait_for_ranks();
  } catch (...) {
    stop_local_workers();
    throw;
  }
}

Coordinator::~Coordinator() {
  std::lock_guard lock(mu_);
  if (!group_->failed()) {
    try {
      group_->post_command(command_for<Command::shutdown>(0).take());
      acknowledge(*group_);
    } catch (const std::exception&) {
      // A worker already gone: it is reaped below.
    }
  }
  stop_local_workers();
}

void Coordinator::start_local_workers(const LocalServiceOptions& service, const DeviceChoice& dev, int count) {
  const auto& dp = service.data_parallel;
  for (int rank = 1; rank <= count; ++rank) {
    std::vector<std::string> args{dp.worker_program,  "worker",
                                  "--rendezvous",     group_->address(),
                                  "--rank",           std::to_string(rank),
                                  "--world-size",     std::to_string(dp.world_size),
                                  "--timeout-s",      std::to_string(dp.timeout_s),
                                  "--device",         worker_device(dev, rank),
                                  "--dtype",          dev.dtype == torch::kBFloat16 ? "bf16" : "fp32",
                                  "--backend",        backend_,
                                  "--threads",        std::to_string(at::get_num_threads()),
                                  "--max-batch-rows", std::to_string(service.max_batch_rows),
                                  "--kv-cache-mb",    std::to_string(service.kv_cache_mb),
                                  "--prefill-chunk-tokens", std::to_string(service.prefill_chunk_tokens)};
    // The options every rank's models must share with rank 0's. (Flags copied from named strings: GCC 12 reports
    // a std::string built from a literal inside push_back as out of bounds, a false -Warray-bounds at -O3.)
    static const std::string dequantize = "--dequantize-base", checkpointing = "--activation-checkpointing",
                             expert_parallel = "--expert-parallel", shard = "--shard";
    if (!service.quantized_base) args.push_back(dequantize);
    if (dp.shard != "none") {
      args.push_back(shard);
      args.push_back(dp.shard);
    }
    if (service.activation_checkpointing) args.push_back(checkpointing);
    if (dp.expert_parallel) args.push_back(expert_parallel);
    for (const auto& [name, dir] : service.base_models) {
      args.push_back("--base-model");
      args.push_back(name + "=" + dir);
    }
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t pid = 0;
    if (const int rc = posix_spawn(&pid, dp.worker_program.c_str(), nullptr, nullptr, argv.data(), environ); rc != 0) {
      stop_local_workers();
      throw io_error("cannot start data-parallel worker '" + dp.worker_program + "': " + std::strerror(rc));
    }
    workers_.push_back(pid);
  }
}

void Coordinator::stop_local_workers() {
  const auto deadline = std::chrono::steady_clock::now() + kWorkerExitGrace;
  for (pid_t pid : workers_) {
    for (;;) {
      int status = 0;
      const pid_t done = waitpid(pid, &status, WNOHANG);
      if (done == pid || done < 0) break;
      if (std::chrono::steady_clock::now() > deadline || group_->failed()) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  workers_.clear();
}

std::uint64_t Coordinator::open(const SessionOptions& options, const SessionModel& made) {
  std::lock_guard lock(mu_);
  const std::uint64_t id = ++next_id_;
  auto c = command_for<Command::open>(id);
  c.put(options);
  noting_failure([&] {
    group_->post_command(c.take());
    open_replica(*group_, &made, {}, options.base_model, shards_sessions(shard_));
  });
  return id;
}

void Coordinator::close(std::uint64_t id) {
  std::lock_guard lock(mu_);
  if (group_->failed()) return;  // nothing left to close on the other ranks
  noting_failure([&] {
    group_->post_command(command_for<Command::close>(id).take());
    acknowledge(*group_);
  });
}

ForwardBackwardOutput Coordinator::forward(std::uint64_t id, Transformer& model, const std::vector<Datum>& data,
                                           const LossSpec& loss, bool backward) {
  // Checked here, over the whole batch, so a bad datum is the caller's 400 naming it (as with one rank), not
  // a rank's failure.
  validate_builtin_batch(model.config(), data, loss);
  check_loss_fits_model(model, loss);
  const auto shares = shares_of(data, world_size());
  std::lock_guard lock(mu_);
  auto c = command_for<Command::forward, op::Forward, op::ForwardBackward>(id);
  c.put(backward);
  c.put(loss);
  return noting_failure([&] {
    group_->post_command(c.take(), encode_all(shares));
    return forward_share(*group_, model, shares[0].data, loss, backward);
  });
}

ForwardBackwardOutput Coordinator::forward_custom(std::uint64_t id, Transformer& model, const std::vector<Datum>& data,
                                                  const CustomLossFn& fn) {
  if (!fn) throw invalid_argument("forward_backward_custom: no loss function given");
  validate_custom_input(model.config(), data);
  const auto shares = shares_of(data, world_size());
  std::lock_guard lock(mu_);
  return noting_failure([&] {
    group_->post_command(command_for<Command::forward_custom, op::ForwardBackwardCustom>(id).take(),
                         encode_all(shares));
    return custom_share(*group_, model, shares[0], &data, &fn);
  });
}

Metrics Coordinator::optim_step(std::uint64_t id, Transformer& model, AdamW& optimizer, const AdamParams& params) {
  validate(params);  // before the gradients are summed: a refused step must leave them as they were
  std::lock_guard lock(mu_);
  auto c = command_for<Command::optim_step, op::OptimStep>(id);
  c.put(params);
  return noting_failure([&] {
    group_->post_command(c.take());
    return optim_step_share(*group_, model, optimizer, params);
  });
}

void Coordinator::sync_state(std::uint64_t id, Transformer& model, std::unique_ptr<AdamW>& optimizer,
                             bool with_optimizer) {
  std::lock_guard lock(mu_);
  auto c = command_for<Command::sync_state, op::LoadState>(id);
  c.put(with_optimizer);
  noting_failure([&] {
    group_->post_command(c.take());
    sync_state_share(*group_, model, optimizer, with_optimizer);
  });
}

void Coordinator::fold_gradients(std::uint64_t id, Transformer& model, AdamW& optimizer) {
  std::lock_guard lock(mu_);
  noting_failure([&] {
    group_->post_command(command_for<Command::fold_gradients, op::SaveState>(id).take());
    fold_gradients_share(*group_, model, optimizer);
  });
}

NamedState Coordinator::gather_experts(std::uint64_t id, Transformer& model, AdamW& optimizer, bool with_optimizer,
                                       bool with_gradients) {
  std::lock_guard lock(mu_);
  auto c = command_for<Command::gather_experts, op::SaveState, op::SaveWeightsForSampler>(id);
  c.put(with_optimizer);
  c.put(with_gradients);
  return noting_failure([&] {
    group_->post_command(c.take());
    return gather_experts_share(*group_, model, optimizer, with_optimizer, with_gradients);
  });
}

NamedState Coordinator::gather_shards(std::uint64_t id, Transformer& model, AdamW& optimizer, bool with_optimizer,
                                      bool with_gradients) {
  std::lock_guard lock(mu_);
  auto c = command_for<Command::gather_shards, op::SaveState, op::SaveWeightsForSampler>(id);
  c.put(with_optimizer);
  c.put(with_gradients);
  return noting_failure([&] {
    group_->post_command(c.take());
    return gather_shards_share(*group_, model, optimizer, with_optimizer, with_gradients);
  });
}

void Coordinator::load_shards(std::uint64_t id, Transformer& model, std::unique_ptr<AdamW>& optimizer,
                              bool with_optimizer, const NamedState& state, std::int64_t step) {
  std::lock_guard lock(mu_);
  auto c = command_for<Command::load_shards, op::LoadState>(id);
  c.put(with_optimizer);
  noting_failure([&] {
    group_->post_command(c.take());
    load_shards_share(*group_, model, optimizer, with_optimizer, &state, step);
  });
}

void Coordinator::load_state(std::uint64_t id, Transformer& model, std::unique_ptr<AdamW>& optimizer,
                             bool with_optimizer, const NamedState& state, std::int64_t step) {
  std::lock_guard lock(mu_);
  auto c = command_for<Command::load_state, op::LoadState>(id);
  c.put(with_optimizer);
  noting_failure([&] {
    group_->post_command(c.take());
    load_state_share(*group_, model, optimizer, with_optimizer, &state, step);
  });
}

std::shared_ptr<Replies> Coordinator::post_sample(std::uint64_t id, const std::string& sampler,
                                                  const SampleRequest& req, std::uint64_t seed,
                                                  DecodePrecision precision, const SamplePlacement& placement) {
  std::vector<int> ranks;
  for (int r = 1; r < world_size(); ++r)
    if (placement.count[r] > 0) ranks.push_back(r);
  if (ranks.empty()) return nullptr;
  std::lock_guard lock(mu_);
  auto c = command_for<Command::sample, op::Sample>(id);
  c.put(sampler);
  c.put(seed);
  c.put(precision);
  c.put(placement.first);
  c.put(placement.count);
  c.put(req);
  noting_failure([&] { group_->post_command(c.take()); });
  const std::uint64_t tag = group_->command_number();
  for (const int r : ranks) remote_samples_ += static_cast<std::uint64_t>(placement.count[r]);
  return std::make_shared<Replies>(*this, tag, std::move(ranks));
}

std::shared_ptr<Replies> Coordinator::post_logprobs(std::uint64_t id, const std::string& sampler,
                                                    const std::vector<token_id>& tokens, int rank) {
  std::lock_guard lock(mu_);
  auto c = command_for<Command::logprobs, op::ComputeLogprobs>(id);
  c.put(sampler);
  c.put(rank);
  c.put(tokens);
  noting_failure([&] { group_->post_command(c.take()); });
  const std::uint64_t tag = group_->command_number();
  ++remote_logprobs_;
  return std::make_shared<Replies>(*this, tag, std::vector<int>{rank});
}

std::vector<LockstepOutcome> Coordinator::sample_in_lockstep(std::uint64_t id, const std::string& sampler,
                                                             LockstepBatch& mine) {
  std::lock_guard lock(mu_);
  auto c = command_for<Command::sample_lockstep, op::Sample>(id);
  c.put(sampler);
  c.put(mine.precision);
  c.put(mine.prefill_tokens);
  c.put(mine.tensor_parallel);
  c.put(static_cast<std::uint64_t>(mine.shares.size()));
  for (std::size_t i = 0; i < mine.shares.size(); ++i) {
    const LockstepShare& share = mine.shares[i];
    const SamplePlacement& placement = mine.placements.at(i);
    c.put(share.seed);
    c.put(share.at_once);
    c.put(placement.first);
    c.put(placement.count);
    c.put(share.req);  // rank 0's share of the request: a worker takes its count from the placement
    for (std::size_t r = 1; r < placement.count.size(); ++r)
      remote_samples_ += static_cast<std::uint64_t>(placement.count[r]);
  }
  return noting_failure([&] {
    group_->post_command(c.take());
    return sample_lockstep_share(*group_, mine);
  });
}

std::vector<double> Coordinator::logprobs_in_lockstep(std::uint64_t id, const std::string& sampler,
                                                      Transformer& model, const std::vector<token_id>& tokens) {
  std::lock_guard lock(mu_);
  auto c = command_for<Command::logprobs_lockstep, op::ComputeLogprobs>(id);
  c.put(sampler);
  return noting_failure([&] {
    group_->post_command(c.take());
    return logprobs_lockstep_share(*group_, model, tokens);
  });
}

void Coordinator::load_sampler(std::uint64_t id, const std::string& key, Transformer& model,
                               const TensorMap& checkpoint) {
  std::lock_guard lock(mu_);
  auto c = command_for<Command::load_sampler, op::Sample, op::ComputeLogprobs>(id);
  c.put(key);
  noting_failure([&] {
    group_->post_command(c.take());
    load_sampler_share(*group_, model, &checkpoint);
  });
}

void Coordinator::drop_sampler(std::uint64_t id, const std::string& key) {
  std::lock_guard lock(mu_);
  if (group_->failed()) return;  // nothing left to drop on the other ranks
  auto c =
      command_for<Command::drop_sampler, op::Sample, op::ComputeLogprobs, op::SaveState, op::SaveWeightsForSampler>(id);
  c.put(key);
  noting_failure([&] { group_->post_command(c.take()); });
}

int Coordinator::next_turn() {
  std::lock_guard lock(mu_);
  const int rank = turn_;
  turn_ = (turn_ + 1) % world_size();
  return rank;
}

void Coordinator::note_failure(const std::string& message) {
  group_->mark_failed(message);  // also when a share failed after the others changed their replicas
  std::lock_guard lock(failure_mu_);
  if (failure_.empty()) failure_ = message;
}

std::string Coordinator::exited_local_worker() const {
  for (std::size_t i = 0; i < workers_.size(); ++i) {
    siginfo_t info{};
    // WNOWAIT: the exit stays for stop_local_workers to reap.
    if (waitid(P_PID, static_cast<id_t>(workers_[i]), &info, WEXITED | WNOHANG | WNOWAIT) == 0 && info.si_pid != 0) {
      const std::string how = info.si_code == CLD_EXITED ? "with status " + std::to_string(info.si_status)
                                                         : "killed by signal " + std::to_string(info.si_status);
      return "rank " + std::to_string(i + 1) + " exited (" + how + ")";
    }
  }
  return {};
}

Replies::Replies(Coordinator& coordinator, std::uint64_t tag, std::vector<int> ranks)
    : coordinator_(coordinator), tag_(tag), ranks_(std::move(ranks)), replies_(ranks_.size()) {}

bool Replies::ready() {
  if (error_) return true;
  try {
    bool all = true;
    for (std::size_t i = 0; i < ranks_.size(); ++i) {
      if (!replies_[i]) replies_[i] = coordinator_.group_->poll_reply(tag_, ranks_[i]);
      all = all && replies_[i].has_value();
    }
    if (all) return true;
    if (const std::string exited = coordinator_.exited_local_worker(); !exited.empty())
      throw group_failure("data-parallel group of " + std::to_string(coordinator_.world_size()) +
                          " ranks failed during a share of samples or logprobs: " + exited);
    return false;
  } catch (const group_failure& e) {
    coordinator_.note_failure(e.what());
    error_ = std::current_exception();
  } catch (...) {
    error_ = std::current_exception();
  }
  return true;
}

std::vector<std::string> Replies::take() {
  if (error_) std::rethrow_exception(error_);
  std::vector<std::string> out;
  for (std::size_t i = 0; i < ranks_.size(); ++i) out.push_back(reply_result(*replies_[i], ranks_[i]));
  return out;
}

std::string Coordinator::failure() const {
  std::lock_guard lock(failure_mu_);
  return failure_;
}

DataParallelStats Coordinator::stats() const {
  std::lock_guard lock(mu_);
  const auto s = group_->stats();
  return {group_->size(),    s.allreduce_calls, s.allreduce_bytes,      s.allreduce_seconds,
          s.broadcast_bytes, remote_samples_,   remote_logprobs_,       s.alltoall_calls,
          s.alltoall_bytes,  s.scatter_bytes,   s.allgather_bytes,      s.reduce_scatter_bytes,
          s.reduce_scatter_sent_bytes};
}

}  // namespace rlloop::engine::dist
