// One data-parallel process group: the ranks of a LocalService (rank 0, the process the clients talk to) and its
// workers, joined over LibTorch's c10d — a TCPStore on rank 0 for the rendezvous and the command channel, a Gloo
// process group for the collectives (NCCL for CUDA tensors where LibTorch has it).
//
// Commands travel through the store, so an idle worker waits for the next one without a timeout. A training
// command's work between ranks is collectives, which fail within the group's timeout; an asynchronous one (a
// share of samples or logprobs) is answered by replies through the store, which rank 0 polls while it watches the
// workers' heartbeats. A failed collective leaves the group unusable (c10d cannot resume a group whose peer
// vanished mid-operation): it throws group_failure naming the ranks that stopped answering, and so does every
// later use.
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/types.h>

#include <rlloop/local.hpp>

namespace rlloop::engine::dist {

struct GroupOptions {
  int rank = 0;
  int world_size = 1;
  std::string host = "127.0.0.1";  // where rank 0's store listens (rank 0 binds it, the others connect)
  int port = 0;                    // 0, on rank 0 only: a free port (port() says which)
  std::chrono::milliseconds timeout{60'000};
  bool nccl = false;  // the tensors' collectives use NCCL (resolve_tensor_backend), else Gloo
  // What every rank must agree on to compute the same thing (build, device kind, dtype): a rank whose
  // fingerprint differs is refused at the rendezvous with both values in the message.
  std::string fingerprint;
  // The store at host:port is hosted by a process that outlives the group (torchrun's elastic agent): rank 0
  // connects to it as the other ranks do instead of opening it.
  bool external_store = false;
  // Put before every key the group writes in the store, so that a store shared with other groups (a launcher's,
  // which the next attempt of a restarted job uses again) holds each group's keys apart. Empty: none.
  std::string store_prefix;
};

// "HOST:PORT" split, and a timeout in seconds made milliseconds; invalid_argument naming `what` otherwise.
std::pair<std::string, int> parse_host_port(const std::string& address, const std::string& what);
std::chrono::milliseconds timeout_of(double seconds, const std::string& what);

// Time and volume of the tensor collectives, for benchmarks.
struct CollectiveStats {
  std::uint64_t allreduce_calls = 0;
  std::uint64_t allreduce_bytes = 0;
  double allreduce_seconds = 0;
  std::uint64_t broadcast_bytes = 0;
  std::uint64_t scatter_bytes = 0;  // sent by rank 0 to the other ranks in scatter(), each its own message
  std::uint64_t alltoall_calls = 0;
  std::uint64_t alltoall_bytes = 0;  // sent by this rank (expert parallelism's rows, and their gradients)
  // Fully sharded parallelism's collectives. Logical bytes: what this rank receives from the others in an
  // all-gather ((W - 1) shards) and what a ring reduce-scatter sends ((W - 1) / W of the full tensor); the bytes
  // this rank's reduce-scatters actually sent beside them (equal but where the transport adds its own, e.g. bf16
  // widened to fp32 for Gloo).
  std::uint64_t allgather_calls = 0;
  std::uint64_t allgather_bytes = 0;
  std::uint64_t allgather_prefetches = 0;  // of the calls, those started ahead of their use (start_all_gather)
  std::uint64_t reduce_scatter_calls = 0;
  std::uint64_t reduce_scatter_bytes = 0;
  std::uint64_t reduce_scatter_sent_bytes = 0;
};

// An all-gather under way (Group::start_all_gather): the transfer proceeds (on c10d's own thread, or NCCL's
// stream) while the caller computes. wait() returns what Group::all_gather would have, once; dropped unwaited, the
// transfer still completes. It must not outlive its group.
class PendingGather {
 public:
  bool pending() const { return static_cast<bool>(finish_); }
  torch::Tensor wait();

 private:
  friend class Group;
  std::function<torch::Tensor()> finish_;
};

// Whether this LibTorch has c10d's NCCL backend (USE_C10D_NCCL).
bool nccl_built();

class Group {
 public:
  // Rank 0: opens the store. The other ranks may connect from now on; wait_for_ranks() waits for them.
  static std::unique_ptr<Group> listen(const GroupOptions& options);
  // Ranks 1..W-1: connects to rank 0's store, checks world size and fingerprint, and joins the process group.
  static std::unique_ptr<Group> join(const GroupOptions& options);
  ~Group();

  // Rank 0: waits until every rank has joined, then forms the process group. Throws naming the ranks missing
  // after the timeout, or the first rank refused (its reason).
  void wait_for_ranks();

  int rank() const;
  int size() const;
  int port() const;  // of rank 0's store
  std::string address() const;

  // Rank 0 posts the next command; every other rank receives it, in order. A command ends in a collective, or
  // (an asynchronous one) in replies.
  // `shares`, when given, holds one more message per rank (index = rank; rank 0's is not sent) that only that
  // rank reads, with take_share() after next_command(): the part of a batch that rank computes.
  void post_command(const std::string& bytes, const std::vector<std::string>& shares = {});
  std::string next_command();
  std::string take_share();
  // The number of the last command posted (rank 0) or received (the others): the tag of its replies.
  std::uint64_t command_number() const;

  // Replies to an asynchronous command, through the store on a connection of their own: a worker posts its
  // reply from any thread; rank 0 polls from any thread without blocking. poll_reply takes the reply away once
  // it is there; while it is not, a rank whose heartbeat has stopped for longer than the group's timeout fails
  // the group (group_failure naming the rank).
  void post_reply(std::uint64_t tag, const std::string& bytes);
  std::optional<std::string> poll_reply(std::uint64_t tag, int rank);

  // Collectives: every rank calls the same ones in the same order.
  std::vector<std::string> gather(const std::string& mine);   // rank 0: every rank's bytes, by rank; others: {}
  void broadcast(std::string& bytes);                         // from rank 0
  // From rank 0, which passes one message per rank (index = rank), to each rank its own: every rank returns its
  // message (rank 0 its own, sent nowhere). The others pass nothing.
  std::string scatter(const std::vector<std::string>& per_rank);
  void broadcast(const std::vector<torch::Tensor>& tensors);  // from rank 0, into every rank's tensors in place
  void allreduce_sum(torch::Tensor& flat);                    // in place
  // Rank r sends rows [sum(send[..j]), + send[j]) of `rows` (dim 0) to rank j and returns what every rank sent it,
  // recv[j] rows from rank j, in rank order. send and recv have one count per rank.
  torch::Tensor all_to_all(const torch::Tensor& rows, const std::vector<std::int64_t>& send,
                           const std::vector<std::int64_t>& recv);
  // Fully sharded parallelism's pair, over flat (1-D) tensors cut into W equal parts, rank r's part being
  // elements [r n, (r + 1) n): all_gather returns every rank's `shard` (n elements each) concatenated in rank
  // order; reduce_scatter_sum returns this rank's part of the sum over the ranks of `full` (W n elements). The
  // results have the inputs' dtype and device. NCCL runs both natively; on Gloo (whose LibTorch 1.13 has no
  // reduce-scatter) the reduce-scatter is a ring of W - 1 sends and receives of n elements per rank, the bytes a
  // native ring sends.
  torch::Tensor all_gather(const torch::Tensor& shard);
  torch::Tensor reduce_scatter_sum(const torch::Tensor& full);
  // all_gather started and not waited for: every rank starts the same ones in the same order, among its other
  // collectives, as with the blocking ones.
  PendingGather start_all_gather(const torch::Tensor& shard);

  CollectiveStats stats() const;
  // Set when a collective failed, a rank stopped answering, or by mark_failed (the ranks' replicas went apart);
  // every later command and collective throws it again. Safe from any thread.
  bool failed() const;
  void mark_failed(const std::string& message);

 private:
  struct Impl;
  explicit Group(std::unique_ptr<Impl> impl);
  PendingGather start_gather(const torch::Tensor& shard);
  std::unique_ptr<Impl> impl_;
};

}  // namespace rlloop::engine::dist
