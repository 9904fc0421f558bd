// Rank 0 of a data-parallel group: starts the local workers, waits for every rank, and runs each command of
// its sessions on all ranks (replica_ops.hpp). Commands run one at a time, in the order they are called, from
// any thread (each base model's engine loop calls in for its sessions).
#pragma once
#include <sys/types.h>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <rlloop/error.hpp>
#include <rlloop/local.hpp>

#include "model/cpu_decoder.hpp"
#include "kernels/device.hpp"
#include "comm/group.hpp"
#include "dist/replica_ops.hpp"
#include "runtime/optimizer.hpp"
#include "runtime/session_model.hpp"
#include "model/transformer.hpp"

namespace rlloop::engine::dist {

// What every rank must share to compute the same thing: LibTorch's version, the device kind, the dtype, the
// tensors' collective backend, whether the experts are spread over the ranks and, if they are, whether layers are
// recomputed in backward (activation checkpointing: its recomputation runs a sparse layer's exchanges again, so
// every rank must do it alike).
std::string group_fingerprint(const DeviceChoice& dev, const std::string& backend, const LocalServiceOptions& service);

// DataParallelOptions::shard: invalid_argument unless "none" or "full".
void check_shard_mode(const std::string& shard);
// Whether sessions are fully sharded under DataParallelOptions::shard `shard` (a LoRA session's frozen base is, its
// adapters stay replicated).
bool shards_sessions(const std::string& shard);

// Whether `host` is this machine's loopback address: a group that meets there has every rank on this host.
bool is_loopback(const std::string& host);

// The tensors' collective backend, "gloo" or "nccl", for DataParallelOptions::backend `requested` ("auto", "gloo",
// "nccl"), with `local_ranks` ranks on this host (rank 0 included) and `gpus` CUDA devices visible here. NCCL needs
// CUDA weights, a LibTorch built with it (`nccl_built`) and one GPU per rank; an impossible request is an
// invalid_argument saying which.
std::string resolve_tensor_backend(const std::string& requested, const DeviceChoice& dev, int local_ranks, int gpus,
                                   bool nccl_built);
// The same for a rank of this process: this host's GPUs and LibTorch, and the ranks that share them — all
// `world_size` when the group meets on the loopback address `rendezvous_host`, else `ranks_known_here`.
std::string tensor_backend_here(const std::string& requested, const DeviceChoice& dev,
                                const std::string& rendezvous_host, int world_size, int ranks_known_here);

class Coordinator;

// The replies of the workers that run an asynchronous share of an operation (samples, a compute_logprobs
// prompt). The session's engine loop polls ready() between its turns; it never blocks.
class Replies {
 public:
  Replies(Coordinator& coordinator, std::uint64_t tag, std::vector<int> ranks);
  // True once every rank has replied, or the group failed meanwhile (take() then throws).
  bool ready();
  // Each rank's reply, in the order of ranks; throws the group's failure, or the first rank whose share failed
  // (its message).
  std::vector<std::string> take();

 private:
  Coordinator& coordinator_;
  std::uint64_t tag_;
  std::vector<int> ranks_;
  std::vector<std::optional<std::string>> replies_;
  std::exception_ptr error_;
};

class Coordinator {
 public:
  Coordinator(const LocalServiceOptions& service, const DeviceChoice& dev);
  // Tells the workers to exit (unless the group failed) and reaps the local ones.
  ~Coordinator();
  Coordinator(const Coordinator&) = delete;
  Coordinator& operator=(const Coordinator&) = delete;

  int world_size() const { return group_->size(); }
  // The group a session model's experts are spread over (make_session_model's expert_group), null without expert
  // parallelism. Its forwards run only inside this class's commands, on every rank together.
  Group* expert_group() const { return expert_parallel_ ? group_.get() : nullptr; }
  // The group a LoRA session's base is fully sharded over (make_session_model's shard_group), null unless the
  // sessions are sharded.
  Group* shard_group() const { return shards_sessions(shard_) ? group_.get() : nullptr; }

  // A session's replica on every rank, made from `options`; `made` is rank 0's (already made). Returns the
  // replica's id for the calls below.
  std::uint64_t open(const SessionOptions& options, const SessionModel& made);
  void close(std::uint64_t id);
  ForwardBackwardOutput forward(std::uint64_t id, Transformer& model, const std::vector<Datum>& data,
                                const LossSpec& loss, bool backward);
  ForwardBackwardOutput forward_custom(std::uint64_t id, Transformer& model, const std::vector<Datum>& data,
                                       const CustomLossFn& fn);
  Metrics optim_step(std::uint64_t id, Transformer& model, AdamW& optimizer, const AdamParams& params);
  // After load_state on rank 0.
  void sync_state(std::uint64_t id, Transformer& model, std::unique_ptr<AdamW>& optimizer, bool with_optimizer);
  // fold_gradients_share: rank 0 holds the gradients every rank accumulated (before saving them), an
  // expert-parallel model's experts' excepted.
  void fold_gradients(std::uint64_t id, Transformer& model, AdamW& optimizer);
  // An expert-parallel session's checkpoints (replica_ops.hpp): the other ranks' experts for save_state, and
  // load_state's checkpoint (after rank 0 loaded its part) for every rank instead of sync_state.
  NamedState gather_experts(std::uint64_t id, Transformer& model, AdamW& optimizer, bool with_optimizer,
                            bool with_gradients);
  void load_state(std::uint64_t id, Transformer& model, std::unique_ptr<AdamW>& optimizer, bool with_optimizer,
                  const NamedState& state, std::int64_t step);
  // A fully sharded session's checkpoints (replica_ops.hpp): every rank's shards whole on rank 0 (save_state), and
  // each rank's part of the checkpoint rank 0 read (load_state).
  NamedState gather_shards(std::uint64_t id, Transformer& model, AdamW& optimizer, bool with_optimizer,
                           bool with_gradients);
  void load_shards(std::uint64_t id, Transformer& model, std::unique_ptr<AdamW>& optimizer, bool with_optimizer,
                   const NamedState& state, std::int64_t step);

  // Each worker's samples of `req` (as rank 0 decodes it: validated, its stop ids complete) to that worker,
  // drawn with the request's streams from `seed` (sample_stream.hpp) at `precision`, from the session's model or
  // (`sampler` not empty) the sampler model loaded under that key; the replies come in the order of the workers
  // that have any. Null when rank 0 has every sample.
  std::shared_ptr<Replies> post_sample(std::uint64_t id, const std::string& sampler, const SampleRequest& req,
                                       std::uint64_t seed, DecodePrecision precision, const SamplePlacement& placement);
  // compute_logprobs of `tokens` (validated) on worker `rank`, with the session's model or a sampler model.
  std::shared_ptr<Replies> post_logprobs(std::uint64_t id, const std::string& sampler,
                                         const std::vector<token_id>& tokens, int rank);
  // A batch of an expert-parallel session's sampling requests (validated, their stop ids complete) decoded by every
  // rank in step (sample_lockstep_share): rank 0's part is `mine` (its shares and the requests' placements), the
  // workers' are made from them as post_sample's are. Blocks until every rank's samples have stopped; the commands
  // of other sessions wait meanwhile. One outcome per request.
  std::vector<LockstepOutcome> sample_in_lockstep(std::uint64_t id, const std::string& sampler, LockstepBatch& mine);
  // An expert-parallel session's compute_logprobs of `tokens` (validated, at least 2) with `model` (the session's or
  // the sampler model under `sampler`): rank 0 scores, the others take part in its exchanges.
  std::vector<double> logprobs_in_lockstep(std::uint64_t id, const std::string& sampler, Transformer& model,
                                           const std::vector<token_id>& tokens);
  // A sampler model rank 0 loaded from a checkpoint (`model`, from the checkpoint's weights `checkpoint`), to every
  // worker under `key`; and one it dropped.
  void load_sampler(std::uint64_t id, const std::string& key, Transformer& model, const TensorMap& checkpoint);
  void drop_sampler(std::uint64_t id, const std::string& key);
  // The rank whose turn it is to take the next compute_logprobs prompt, or the larger shares of the next sampling
  // request (place_samples): the ranks take turns, in the order the requests were submitted.
  int next_turn();

  DataParallelStats stats() const;
  // Empty while the group works; readable while a command runs.
  std::string failure() const;

 private:
  friend class Replies;
  void note_failure(const std::string& message);
  // "rank R exited (...)" for a local worker that has exited, else empty: rank 0 learns of it at once, where a
  // heartbeat (all it has of a remote rank) takes the timeout to tell.
  std::string exited_local_worker() const;

  void start_local_workers(const LocalServiceOptions& service, const DeviceChoice& dev, int count);
  void stop_local_workers();

  std::string backend_;  // the tensors' collectives: "gloo" or "nccl" (resolve_tensor_backend)
  bool expert_parallel_ = false;
  std::string shard_;  // DataParallelOptions::shard

  // Runs a command's share, noting a group failure where failure() can read it without waiting for mu_.
  template <class Fn>
  auto noting_failure(Fn fn) {
    try {
      return fn();
    } catch (const group_failure& e) {
      note_failure(e.what());
      throw;
    }
  }

  mutable std::mutex mu_;  // one command at a time
  mutable std::mutex failure_mu_;
  std::string failure_;
  std::unique_ptr<Group> group_;
  std::vector<pid_t> workers_;
  std::uint64_t next_id_ = 0;
  int turn_ = 0;
  // What the workers were given to do asynchronously, for stats().
  std::uint64_t remote_samples_ = 0;
  std::uint64_t remote_logprobs_ = 0;
};

}  // namespace rlloop::engine::dist
