#include "comm/group.hpp"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <thread>

#include <torch/torch.h>

#include <rlloop/error.hpp>

#ifdef USE_C10D_GLOO
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#endif
#ifdef USE_C10D_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include "comm/codec.hpp"

namespace rlloop::engine::dist {

torch::Tensor PendingGather::wait() {
  if (!finish_) throw std::logic_error("PendingGather::wait: no all-gather under way");
  const auto finish = std::move(finish_);
  finish_ = nullptr;
  return finish();
}

bool nccl_built() {
#ifdef USE_C10D_NCCL
  return true;
#else
  return false;
#endif
}

std::pair<std::string, int> parse_host_port(const std::string& address, const std::string& what) {
  const auto colon = address.rfind(':');
  int port = -1;
  if (colon != std::string::npos && colon > 0) {
    try {
      std::size_t used = 0;
      port = std::stoi(address.substr(colon + 1), &used);
      if (used != address.size() - colon - 1) port = -1;
    } catch (const std::exception&) {
      port = -1;
    }
  }
  if (port < 0 || port > 65535)
    throw invalid_argument(what + ": '" + address + "' is not HOST:PORT with a port in 0..65535");
  return {address.substr(0, colon), port};
}

std::chrono::milliseconds timeout_of(double seconds, const std::string& what) {
  if (!(seconds > 0)) throw invalid_argument(what + " must be positive, got " + std::to_string(seconds));
  return std::chrono::milliseconds(static_cast<std::int64_t>(seconds * 1000));
}

#ifdef USE_C10D_GLOO

namespace {

// Store keys. Commands are numbered from 1; "joined/R" holds "" once rank R is in, a refused rank leaves its
// reason under "refused/N".
const std::string kGroupKey = "rlloop/group";
std::string joined_key(int rank) { return "rlloop/joined/" + std::to_string(rank); }
std::string claim_key(int rank) { return "rlloop/claim/" + std::to_string(rank); }
std::string alive_key(int rank) { return "rlloop/alive/" + std::to_string(rank); }
std::string command_key(std::uint64_t n) { return "rlloop/command/" + std::to_string(n); }
std::string read_key(std::uint64_t n) { return "rlloop/read/" + std::to_string(n); }
std::string share_key(std::uint64_t n, int rank) {
  return "rlloop/share/" + std::to_string(n) + "/" + std::to_string(rank);
}
std::string reply_key(std::uint64_t tag, int rank) {
  return "rlloop/reply/" + std::to_string(tag) + "/" + std::to_string(rank);
}
const std::string kRefusals = "rlloop/refusals";
std::string refusal_key(std::int64_t n) { return "rlloop/refused/" + std::to_string(n); }

// How often a worker tells rank 0 it is alive, and how long rank 0 watches after a failure to see who is not.
constexpr auto kHeartbeat = std::chrono::milliseconds(200);
constexpr auto kHeartbeatWatch = std::chrono::milliseconds(1000);
// What a group failure found by poll_reply says the group was doing.
const char* const kWaitingForReplies = "a share of samples or logprobs";

std::vector<std::uint8_t> as_bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string as_string(const std::vector<std::uint8_t>& v) { return {v.begin(), v.end()}; }

std::string describe(const GroupOptions& o) { return o.host + ":" + std::to_string(o.port); }

// The address of this host on the route to rank 0: where this rank's Gloo endpoint listens for its peers.
// (Rank 0's own is the rendezvous address.) A connected UDP socket sends nothing; it only picks the route.
std::string local_address_towards(const GroupOptions& o) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(o.host.c_str(), std::to_string(o.port).c_str(), &hints, &found) != 0 || !found)
    throw io_error("data-parallel rendezvous: cannot resolve rank 0's host '" + o.host + "'");
  const int fd = socket(AF_INET, SOCK_DGRAM, 0);
  sockaddr_in local{};
  socklen_t len = sizeof local;
  const bool ok = fd >= 0 && connect(fd, found->ai_addr, found->ai_addrlen) == 0 &&
                  getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0;
  if (fd >= 0) close(fd);
  freeaddrinfo(found);
  if (!ok) throw io_error("data-parallel rendezvous: no route from this host to rank 0 at " + describe(o));
  char text[INET_ADDRSTRLEN] = {};
  inet_ntop(AF_INET, &local.sin_addr, text, sizeof text);
  return text;
}

c10::intrusive_ptr<c10d::TCPStore> open_tcp_store(const GroupOptions& o, bool server) {
  c10d::TCPStoreOptions so;
  so.port = static_cast<std::uint16_t>(o.port);
  so.isServer = server;
  so.waitWorkers = false;
  so.timeout = o.timeout;
  try {
    return c10::make_intrusive<c10d::TCPStore>(o.host, so);
  } catch (const std::exception& e) {
    if (server) throw io_error("data-parallel rendezvous: cannot listen on " + describe(o) + ": " + e.what());
    throw io_error("data-parallel rendezvous: cannot reach " + std::string(o.external_store ? "the store" : "rank 0") +
                   " at " + describe(o) + " within " + std::to_string(o.timeout.count() / 1000) + " s: " + e.what());
  }
}

// The group's view of a connection: its keys under the group's prefix, if it has one.
c10::intrusive_ptr<c10d::Store> group_view(const GroupOptions& o, c10::intrusive_ptr<c10d::TCPStore> tcp) {
  if (o.store_prefix.empty()) return tcp;
  return c10::make_intrusive<c10d::PrefixStore>(o.store_prefix, std::move(tcp));
}

// A client connection to the group's store.
c10::intrusive_ptr<c10d::Store> open_store(const GroupOptions& o) { return group_view(o, open_tcp_store(o, false)); }

// LibTorch 1.13's store daemon serves its clients one message at a time with blocking reads, so a client stopped
// in the middle of a message (a rank stopped between the sends of one request, or any process that connects to
// the rendezvous port and sends half a message) freezes it; a call on a connection without a receive timeout then
// waits forever. TCPStore::wait with a timeout leaves that timeout on its connection's socket for every later call
// (tests/engine/data_parallel_test.cpp, AHalfMessageToTheStoreFailsTheOperationWithinTheTimeout, holds it to
// that), so one wait on a key that exists arms the connection: rank 0 fails the operation instead of hanging.
void arm_receive_timeout(c10d::Store& store, std::chrono::milliseconds timeout) {
  store.wait({kGroupKey}, timeout);
}

// The first line of an exception's text (c10's errors append a backtrace).
std::string first_line(const std::exception& e) {
  const std::string text = e.what();
  return text.substr(0, text.find('\n'));
}

// Rank 0's reading of its own store failed: it did not answer within the timeout, or the connection broke.
std::string store_failure(const GroupOptions& o, const std::exception& e) {
  return "the group's store at " + describe(o) + " did not answer within " +
         std::to_string(o.timeout.count() / 1000) +
         " s (a rank or another client stopped in the middle of a message?): " + first_line(e);
}

// Waits for `key` however long rank 0 takes to post it (a worker between commands). LibTorch 1.13's TCPStore reads
// c10d::Store::kNoTimeout as "no timeout"; 2.x's as "time out at once" (a worker then left at its first idle
// moment). So from 2.0 on the wait is a loop of long finite ones, each cancelled cleanly by the store's protocol;
// after one times out, asking whether the key exists tells a quiet rank 0 (keep waiting) from a lost store
// (check() throws, as the wait would have).
void wait_for_key(c10d::Store& store, const std::string& key) {
#if TORCH_VERSION_MAJOR >= 2
  constexpr auto round = std::chrono::minutes(10);
  for (;;) {
    const auto start = std::chrono::steady_clock::now();
    try {
      store.wait({key}, round);
      return;
    } catch (const std::exception&) {
      // A wait that ended early failed for another reason than its timeout: that error is the one to report.
      if (std::chrono::steady_clock::now() - start < round - std::chrono::seconds(30)) throw;
      if (store.check({key})) return;
    }
  }
#else
  store.wait({key}, c10d::Store::kNoTimeout);
#endif
}

// LibTorch 1.13's wait on a key ends, whatever timeout it is given, when its connection's receive timeout (the
// group's) runs out: a worker idle for longer than that took rank 0 for lost. So there a worker waits for its
// next command on a connection of its own whose timeout is a year; a rank 0 that goes away closes it at once
// all the same. (2.x's waits are the bounded rounds of wait_for_key, on the main connection.)
c10::intrusive_ptr<c10d::Store> idle_connection(const GroupOptions& o) {
#if TORCH_VERSION_MAJOR >= 2
  (void)o;
  return {};
#else
  GroupOptions patient = o;
  patient.timeout = std::chrono::hours(24 * 365);
  return open_store(patient);
#endif
}

}  // namespace

// The collectives' interface: ProcessGroupGloo and ProcessGroupNCCL are ProcessGroups up to LibTorch 1.13 and
// Backends (of a ProcessGroup that dispatches by device) from 2.0 on, with the same collective calls.
#if TORCH_VERSION_MAJOR >= 2
using CollectiveBackend = c10d::Backend;
#else
using CollectiveBackend = c10d::ProcessGroup;
#endif

namespace {
#ifdef USE_C10D_NCCL
// By default a failed or timed-out NCCL collective is handled by ProcessGroupNCCL's watchdog thread, which tears
// down the whole process (TORCH_NCCL_ASYNC_ERROR_HANDLING: 1 in LibTorch 1.x, 3 in 2.x): a dead peer would take rank 0,
// the service and every other tenant's session with it. With blocking waits the collective's wait() throws in the
// thread that waits (Group::collective makes that a group_failure, as a Gloo failure is), and with error handling
// "clean up only" the watchdog aborts the communicator without killing the process. Both spellings, LibTorch 1.x's
// and 2.x's; a value the user set in either spelling is kept. (Set when the group forms, before ProcessGroupNCCL
// starts its threads. setenv beside a concurrent getenv on another thread is not safe in glibc; the engine's
// threads do not read the environment after start-up, but a library's might.)
void set_unless_user_set(const char* name, const char* legacy_name, const char* value) {
  if (std::getenv(name) || std::getenv(legacy_name)) return;
  ::setenv(name, value, /*overwrite=*/0);
  ::setenv(legacy_name, value, /*overwrite=*/0);
}
void fail_nccl_operations_not_the_process() {
  set_unless_user_set("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT", "1");
  set_unless_user_set("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING", "2");
}
#endif

// c10d's flight recorder (a trace of every collective for debugging, on by default in LibTorch 2.x) updates
// process-wide tables from each process group's calls, and several groups in one process calling at once (the
// tests' ranks as threads; rlloop's Gloo and NCCL groups) crashed there now and then (engine_collectives_test
// under load, torch 2.11: a segfault in FlightRecorder::recordWithResetEnabled; none in 500 runs without it).
// rlloop names a failed collective's ranks itself. Off unless the user set its size; set once, by the first group
// the process makes, before any group has threads (LibTorch 1.13 has no recorder and ignores it).
void turn_off_flight_recorder() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (!std::getenv("TORCH_FR_BUFFER_SIZE") && !std::getenv("TORCH_NCCL_TRACE_BUFFER_SIZE"))
      ::setenv("TORCH_FR_BUFFER_SIZE", "0", /*overwrite=*/0);
  });
}
}  // namespace

struct Group::Impl {
  GroupOptions options;
  c10::intrusive_ptr<c10d::Store> store;
  // Workers on LibTorch 1.13: the connection they wait for the next command on (idle_connection).
  c10::intrusive_ptr<c10d::Store> idle;
  c10::intrusive_ptr<CollectiveBackend> gloo;
  c10::intrusive_ptr<CollectiveBackend> tensors;  // gloo, or NCCL for CUDA tensors
  std::uint64_t commands = 0;
  CollectiveStats stats;

  mutable std::mutex failure_mu;
  std::string failure_;  // set once the group failed

  // The replies' connection to the store (opened at first use) and, on rank 0, what it saw of each worker's
  // heartbeat while waiting for its replies.
  std::mutex replies_mu;
  c10::intrusive_ptr<c10d::Store> replies;
  struct Heartbeat {
    std::int64_t count = -1;
    std::chrono::steady_clock::time_point seen, changed;
  };
  std::vector<Heartbeat> heartbeats;

  std::string failure() const {
    std::lock_guard lock(failure_mu);
    return failure_;
  }
  // The first failure stays: later ones follow from it.
  std::string fail(const std::string& message) {
    std::lock_guard lock(failure_mu);
    if (failure_.empty()) failure_ = message;
    return failure_;
  }
  void throw_if_failed() const {
    if (std::string f = failure(); !f.empty()) throw group_failure(f);
  }
  c10d::Store& reply_store() {
    if (!replies) {
      replies = open_store(options);
      arm_receive_timeout(*replies, options.timeout);
    }
    return *replies;
  }

  // Workers: a second connection to the store that counts up while the process lives.
  std::atomic<bool> stop_heartbeat{false};
  std::thread heartbeat;

  ~Impl() {
    stop_heartbeat = true;
    if (heartbeat.joinable()) heartbeat.join();
  }

  void form_process_group() {
    auto opts = c10d::ProcessGroupGloo::Options::create(options.timeout);
    const std::string own = options.rank == 0 ? options.host : local_address_towards(options);
    opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(own));
    opts->threads = 1;
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>("rlloop/gloo", store);
    try {
      gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, options.rank, options.world_size, opts);
    } catch (const std::exception& e) {
      throw group_failure("data-parallel rendezvous: the ranks could not connect to each other within " +
                          std::to_string(options.timeout.count() / 1000) + " s: " + e.what());
    }
    tensors = gloo;
#ifdef USE_C10D_NCCL
    // The tensors through NCCL, one device per rank (resolve_tensor_backend); the byte messages stay on Gloo.
    if (options.nccl) {
      fail_nccl_operations_not_the_process();
      auto nccl_opts = c10d::ProcessGroupNCCL::Options::create();
      nccl_opts->timeout = options.timeout;
      tensors = c10::make_intrusive<c10d::ProcessGroupNCCL>(
          c10::make_intrusive<c10d::PrefixStore>("rlloop/nccl", store), options.rank, options.world_size, nccl_opts);
    }
#else
    if (options.nccl) throw invalid_argument("data-parallel group: NCCL asked for, but this LibTorch has none");
#endif
  }

  void start_heartbeat() {
    GroupOptions o = options;
    heartbeat = std::thread([this, o] {
      try {
        auto own = open_store(o);
        while (!stop_heartbeat) {
          own->add(alive_key(o.rank), 1);
          std::this_thread::sleep_for(kHeartbeat);
        }
      } catch (const std::exception&) {
        // Rank 0 is gone; the command channel notices too.
      }
    });
  }

  // After a failed collective: the ranks whose heartbeat stopped (rank 0 watches for a moment).
  std::string unresponsive_ranks() {
    if (options.rank != 0) return "rank 0 or a peer stopped answering";
    // Read through the replies' connection: the main one is Gloo's too (its PrefixStore), and a failing collective
    // may still be using it.
    auto counts = [this] {
      std::lock_guard lock(replies_mu);
      std::vector<std::int64_t> out;
      for (int r = 1; r < options.world_size; ++r) out.push_back(reply_store().add(alive_key(r), 0));
      return out;
    };
    try {
      const auto before = counts();
      std::this_thread::sleep_for(kHeartbeatWatch);
      const auto after = counts();
      std::string dead;
      for (int r = 1; r < options.world_size; ++r)
        if (before[r - 1] == after[r - 1]) dead += (dead.empty() ? "" : ", ") + std::to_string(r);
      if (dead.empty()) return "every rank's process is alive, so one stopped answering the collective";
      return (dead.find(',') == std::string::npos ? "rank " : "ranks ") + dead + " stopped answering";
    } catch (const std::exception& e) {
      return "the ranks could not be asked: " + store_failure(options, e);
    }
  }

  std::string failure_prefix(const std::string& what) const {
    return "data-parallel group of " + std::to_string(options.world_size) + " ranks failed during " + what + ": ";
  }

  template <class Fn>
  void collective(const char* what, Fn fn) {
    throw_if_failed();
    try {
      // c10d writes the results on threads of its own, outside any InferenceMode: they must be normal tensors, also
      // when the caller decodes in InferenceMode (a fully sharded model's layers are gathered per decoding step).
      c10::InferenceMode normal_tensors(false);
      fn();
    } catch (const std::exception& e) {
      throw group_failure(fail(failure_prefix(what) + unresponsive_ranks() + " (c10d: " + first_line(e) + ")"));
    }
  }

  // Rank 0, waiting for `rank`'s reply (replies_mu held): fails the group once its heartbeat has not moved for
  // longer than the timeout while watched. Watching starts afresh after a pause, so time nobody waited counts
  // for nothing.
  void check_heartbeat(int rank) {
    const auto now = std::chrono::steady_clock::now();
    if (heartbeats.empty()) heartbeats.resize(options.world_size);
    Heartbeat& h = heartbeats[rank];
    if (now - h.seen < kHeartbeat) return;
    const std::int64_t count = reply_store().add(alive_key(rank), 0);
    if (count != h.count || now - h.seen > 2 * kHeartbeatWatch) {
      h.count = count;
      h.changed = now;
    }
    h.seen = now;
    if (now - h.changed > options.timeout)
      throw group_failure(fail(failure_prefix(kWaitingForReplies) + "rank " + std::to_string(rank) +
                               " stopped answering (no heartbeat for " +
                               std::to_string(options.timeout.count() / 1000) + " s)"));
  }

  static void wait(const c10::intrusive_ptr<c10d::Work>& work) { work->wait(); }
};

Group::Group(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Group::~Group() = default;

std::unique_ptr<Group> Group::listen(const GroupOptions& options) {
  if (options.rank != 0) throw invalid_argument("Group::listen is for rank 0");
  turn_off_flight_recorder();
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  auto connection = open_tcp_store(options, !options.external_store);
  impl->options.port = connection->getPort();
  impl->store = group_view(options, std::move(connection));
  // A store that outlives groups (a launcher's) may hold an earlier group's ranks under this prefix: joining them
  // would fail later and less clearly.
  if (options.external_store && impl->store->check({kGroupKey}))
    throw invalid_argument("data-parallel rendezvous at " + describe(options) + ": the store already holds a group" +
                           " under the key prefix '" + options.store_prefix + "' (each group needs a prefix of its own)");
  ByteWriter w;
  w.put(options.world_size);
  w.put(options.fingerprint);
  impl->store->set(kGroupKey, as_bytes(w.take()));
  arm_receive_timeout(*impl->store, options.timeout);
  return std::unique_ptr<Group>(new Group(std::move(impl)));
}

void Group::wait_for_ranks() {
  Impl& g = *impl_;
  const auto deadline = std::chrono::steady_clock::now() + g.options.timeout;
  for (;;) {
    if (g.store->add(kRefusals, 0) > 0)
      throw invalid_argument("data-parallel rendezvous at " + address() + ": " +
                             as_string(g.store->get(refusal_key(1))));
    std::string missing;
    for (int r = 1; r < g.options.world_size; ++r)
      if (!g.store->check({joined_key(r)})) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
    if (missing.empty()) break;
    if (std::chrono::steady_clock::now() > deadline)
      throw group_failure("data-parallel rendezvous at " + address() + ": rank(s) " + missing + " of " +
                          std::to_string(g.options.world_size) + " did not join within " +
                          std::to_string(g.options.timeout.count() / 1000) + " s");
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  g.form_process_group();
}

std::unique_ptr<Group> Group::join(const GroupOptions& options) {
  turn_off_flight_recorder();
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  if (options.rank < 1 || options.rank >= options.world_size)
    throw invalid_argument("data-parallel worker: rank " + std::to_string(options.rank) + " is outside 1.." +
                           std::to_string(options.world_size - 1) + " (world size " +
                           std::to_string(options.world_size) + ")");
  impl->store = open_store(options);
  auto& store = *impl->store;
  std::string raw;
  try {
    raw = as_string(store.get(kGroupKey));
  } catch (const std::exception& e) {
    throw io_error("data-parallel rendezvous at " + describe(options) + ": rank 0 opened no group there within " +
                   std::to_string(options.timeout.count() / 1000) + " s (" + first_line(e) + ")");
  }
  ByteReader r(raw);
  const int world_size = r.get<int>();
  const std::string fingerprint = r.get_string();
  std::string refusal;
  const std::string who = "rank " + std::to_string(options.rank);
  if (world_size != options.world_size)
    refusal = who + " was started with world size " + std::to_string(options.world_size) + ", the group has " +
              std::to_string(world_size);
  else if (fingerprint != options.fingerprint)
    refusal = who + " runs another configuration: '" + options.fingerprint + "', rank 0 runs '" + fingerprint + "'";
  else if (store.add(claim_key(options.rank), 1) > 1)
    refusal = who + " has already joined this group (two workers were given the same rank)";
  if (!refusal.empty()) {
    const std::int64_t n = store.add(kRefusals, 1);
    store.set(refusal_key(n), as_bytes(refusal));
    throw invalid_argument("data-parallel rendezvous at " + describe(options) + ": " + refusal);
  }
  store.set(joined_key(options.rank), std::vector<std::uint8_t>{});
  impl->idle = idle_connection(options);
  impl->start_heartbeat();
  impl->form_process_group();
  return std::unique_ptr<Group>(new Group(std::move(impl)));
}

int Group::rank() const { return impl_->options.rank; }
int Group::size() const { return impl_->options.world_size; }
int Group::port() const { return impl_->options.port; }
std::string Group::address() const { return describe(impl_->options); }
CollectiveStats Group::stats() const { return impl_->stats; }
bool Group::failed() const { return !impl_->failure().empty(); }
void Group::mark_failed(const std::string& message) { impl_->fail(message); }

void Group::post_command(const std::string& bytes, const std::vector<std::string>& shares) {
  Impl& g = *impl_;
  g.throw_if_failed();
  const std::uint64_t n = ++g.commands;
  // The shares first: a worker that sees the command finds its share there.
  for (std::size_t r = 1; r < shares.size(); ++r) g.store->set(share_key(n, static_cast<int>(r)), as_bytes(shares[r]));
  g.store->set(command_key(n), as_bytes(bytes));
}

std::string Group::take_share() {
  Impl& g = *impl_;
  const std::string key = share_key(g.commands, g.options.rank);
  try {
    std::string bytes = as_string(g.store->get(key));
    g.store->deleteKey(key);
    return bytes;
  } catch (const std::exception& e) {
    throw group_failure("data-parallel worker " + std::to_string(g.options.rank) + ": lost rank 0 at " + address() +
                        " (" + first_line(e) + ")");
  }
}

std::uint64_t Group::command_number() const { return impl_->commands; }

void Group::post_reply(std::uint64_t tag, const std::string& bytes) {
  Impl& g = *impl_;
  std::lock_guard lock(g.replies_mu);
  try {
    g.reply_store().set(reply_key(tag, g.options.rank), as_bytes(bytes));
  } catch (const std::exception& e) {
    throw group_failure("data-parallel worker " + std::to_string(g.options.rank) + ": lost rank 0 at " + address() +
                        " (" + first_line(e) + ")");
  }
}

std::optional<std::string> Group::poll_reply(std::uint64_t tag, int rank) {
  Impl& g = *impl_;
  g.throw_if_failed();
  std::lock_guard lock(g.replies_mu);
  const std::string key = reply_key(tag, rank);
  try {
    if (g.reply_store().check({key})) {
      std::string reply = as_string(g.replies->get(key));
      g.replies->deleteKey(key);
      return reply;
    }
    g.check_heartbeat(rank);
  } catch (const group_failure&) {
    throw;
  } catch (const std::exception& e) {
    throw group_failure(
        g.fail(g.failure_prefix(kWaitingForReplies) + store_failure(g.options, e)));
  }
  return std::nullopt;
}

std::string Group::next_command() {
  Impl& g = *impl_;
  const std::uint64_t n = ++g.commands;
  const std::string key = command_key(n);
  try {
    wait_for_key(g.idle ? *g.idle : *g.store, key);
    std::string bytes = as_string(g.store->get(key));
    // The last worker to read a command removes it (an asynchronous one has no collective after which rank 0
    // would know that every worker has read it), so a server that runs for months keeps no old commands.
    if (g.store->add(read_key(n), 1) == g.options.world_size - 1) {
      g.store->deleteKey(key);
      g.store->deleteKey(read_key(n));
    }
    return bytes;
  } catch (const std::exception& e) {
    throw group_failure("data-parallel worker " + std::to_string(g.options.rank) + ": lost rank 0 at " + address() +
                        " (" + first_line(e) + ")");
  }
}

std::vector<std::string> Group::gather(const std::string& mine) {
  Impl& g = *impl_;
  const int W = g.options.world_size;
  std::vector<std::string> out;
  g.collective("gather", [&] {
    // Sizes first (every rank learns the longest), then the payloads padded to it.
    std::vector<torch::Tensor> size{torch::full({1}, static_cast<std::int64_t>(mine.size()), torch::kInt64)};
    std::vector<std::vector<torch::Tensor>> sizes(1);
    for (int r = 0; r < W; ++r) sizes[0].push_back(torch::empty({1}, torch::kInt64));
    Impl::wait(g.gloo->allgather(sizes, size));
    std::int64_t longest = 0;
    for (const auto& s : sizes[0]) longest = std::max(longest, s.item<std::int64_t>());
    auto payload = torch::zeros({std::max<std::int64_t>(longest, 1)}, torch::kUInt8);
    std::memcpy(payload.data_ptr(), mine.data(), mine.size());
    std::vector<torch::Tensor> input{payload};
    std::vector<std::vector<torch::Tensor>> outputs;
    if (g.options.rank == 0) {
      outputs.resize(1);
      for (int r = 0; r < W; ++r) outputs[0].push_back(torch::empty_like(payload));
    }
    Impl::wait(g.gloo->gather(outputs, input, c10d::GatherOptions{}));
    if (g.options.rank == 0)
      for (int r = 0; r < W; ++r)
        out.emplace_back(static_cast<const char*>(outputs[0][r].data_ptr()), sizes[0][r].item<std::int64_t>());
  });
  return out;
}

void Group::broadcast(std::string& bytes) {
  Impl& g = *impl_;
  g.collective("broadcast", [&] {
    std::vector<torch::Tensor> size{torch::full({1}, static_cast<std::int64_t>(bytes.size()), torch::kInt64)};
    Impl::wait(g.gloo->broadcast(size));
    const auto n = size[0].item<std::int64_t>();
    auto payload = torch::empty({std::max<std::int64_t>(n, 1)}, torch::kUInt8);
    if (g.options.rank == 0) std::memcpy(payload.data_ptr(), bytes.data(), bytes.size());
    std::vector<torch::Tensor> t{payload};
    Impl::wait(g.gloo->broadcast(t));
    if (g.options.rank != 0) bytes.assign(static_cast<const char*>(payload.data_ptr()), static_cast<std::size_t>(n));
  });
}

std::string Group::scatter(const std::vector<std::string>& per_rank) {
  Impl& g = *impl_;
  const int W = g.options.world_size;
  const bool root = g.options.rank == 0;
  if (root && static_cast<int>(per_rank.size()) != W)
    throw invalid_argument("Group::scatter: " + std::to_string(per_rank.size()) + " messages for " +
                           std::to_string(W) + " ranks");
  std::string out;
  g.collective("scatter", [&] {
    // Every message's size first (every rank learns the longest), then the payloads padded to it.
    std::vector<torch::Tensor> sizes{torch::zeros({W}, torch::kInt64)};
    if (root)
      for (int r = 0; r < W; ++r) sizes[0][r] = static_cast<std::int64_t>(per_rank[r].size());
    Impl::wait(g.gloo->broadcast(sizes));
    const std::int64_t longest = std::max<std::int64_t>(sizes[0].max().item<std::int64_t>(), 1);
    std::vector<torch::Tensor> mine{torch::empty({longest}, torch::kUInt8)};
    std::vector<std::vector<torch::Tensor>> inputs;
    if (root) {
      inputs.resize(1);
      for (int r = 0; r < W; ++r) {
        inputs[0].push_back(torch::zeros({longest}, torch::kUInt8));
        std::memcpy(inputs[0][r].data_ptr(), per_rank[r].data(), per_rank[r].size());
        if (r > 0) g.stats.scatter_bytes += per_rank[r].size();
      }
    }
    Impl::wait(g.gloo->scatter(mine, inputs, c10d::ScatterOptions{}));
    out.assign(static_cast<const char*>(mine[0].data_ptr()),
               static_cast<std::size_t>(sizes[0][g.options.rank].item<std::int64_t>()));
  });
  return out;
}

void Group::broadcast(const std::vector<torch::Tensor>& tensors) {
  if (tensors.empty()) return;
  Impl& g = *impl_;
  g.collective("broadcast of weights", [&] {
    torch::NoGradGuard no_grad;
    // bf16 and fp16 travel as fp32 (exactly): Gloo in LibTorch 1.13 has no bf16.
    std::vector<torch::Tensor> flat_parts;
    for (const auto& t : tensors) {
      const bool narrow = t.scalar_type() == torch::kBFloat16 || t.scalar_type() == torch::kHalf;
      flat_parts.push_back(narrow ? t.detach().reshape(-1).to(torch::kFloat32) : t.detach().reshape(-1));
    }
    std::vector<torch::Tensor> flat{torch::cat(flat_parts)};
    Impl::wait(g.tensors->broadcast(flat));
    g.stats.broadcast_bytes += static_cast<std::uint64_t>(flat[0].nbytes());
    if (g.options.rank == 0) return;
    std::int64_t at = 0;
    for (const auto& t : tensors) {
      const auto n = t.numel();
      t.detach().copy_(flat[0].narrow(0, at, n).view(t.sizes()));
      at += n;
    }
  });
}

void Group::allreduce_sum(torch::Tensor& flat) {
  Impl& g = *impl_;
  g.collective("all-reduce of gradients", [&] {
    const auto start = std::chrono::steady_clock::now();
    std::vector<torch::Tensor> t{flat};
    Impl::wait(g.tensors->allreduce(t));
    // Without blocking waits, wait() returns once a CUDA collective is queued on the device's stream: the time of
    // the transfer itself needs the device to finish it (one host sync per all-reduce, once per optimizer step).
    if (flat.is_cuda()) torch::cuda::synchronize(flat.device().index());
    g.stats.allreduce_calls += 1;
    g.stats.allreduce_bytes += static_cast<std::uint64_t>(flat.nbytes());
    g.stats.allreduce_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  });
}

torch::Tensor Group::all_to_all(const torch::Tensor& rows, const std::vector<std::int64_t>& send,
                                const std::vector<std::int64_t>& recv) {
  Impl& g = *impl_;
  const auto W = static_cast<std::size_t>(g.options.world_size);
  std::int64_t sent = 0, received = 0;
  for (std::int64_t n : send) sent += n;
  for (std::int64_t n : recv) received += n;
  if (send.size() != W || recv.size() != W || rows.dim() < 1 || rows.size(0) != sent)
    throw std::logic_error("Group::all_to_all: counts do not match the ranks or the rows");
  // bf16 and fp16 travel as fp32 (exactly) through Gloo, which has neither in LibTorch 1.13.
  const bool widen = !rows.is_cuda() && (rows.scalar_type() == torch::kBFloat16 || rows.scalar_type() == torch::kHalf);
  torch::Tensor in = widen ? rows.to(torch::kFloat32).contiguous() : rows.contiguous();
  std::vector<std::int64_t> shape = rows.sizes().vec();
  shape[0] = received;
  torch::Tensor out = torch::empty(shape, in.options());
  g.collective("all-to-all of expert rows", [&] {
    std::vector<std::int64_t> in_counts = send, out_counts = recv;
    Impl::wait(g.tensors->alltoall_base(out, in, out_counts, in_counts));
    g.stats.alltoall_calls += 1;
    g.stats.alltoall_bytes += static_cast<std::uint64_t>(in.nbytes());
  });
  return widen ? out.to(rows.scalar_type()) : out;
}

namespace {
// Gloo in LibTorch 1.13 has neither bf16 nor fp16, and its point-to-point calls take CPU tensors: what travels
// through it is the tensor on the CPU in fp32 (exactly) where it is narrower.
torch::Tensor as_gloo_carries(const torch::Tensor& t) {
  const bool narrow = t.scalar_type() == torch::kBFloat16 || t.scalar_type() == torch::kHalf;
  return t.to(torch::kCPU, narrow ? torch::kFloat32 : t.scalar_type()).contiguous();
}
void expect_flat(const torch::Tensor& t, std::int64_t parts, const char* what) {
  if (t.dim() != 1 || t.numel() % parts != 0)
    throw invalid_argument(std::string("Group::") + what + ": expects a 1-D tensor of a multiple of " +
                           std::to_string(parts) + " elements, got " + std::to_string(t.numel()) + " in " +
                           std::to_string(t.dim()) + " dimensions");
}
}  // namespace

torch::Tensor Group::all_gather(const torch::Tensor& shard) { return start_gather(shard).wait(); }

PendingGather Group::start_all_gather(const torch::Tensor& shard) {
  PendingGather pending = start_gather(shard);
  impl_->stats.allgather_prefetches += 1;
  return pending;
}

PendingGather Group::start_gather(const torch::Tensor& shard) {
  Impl& g = *impl_;
  const int W = g.options.world_size;
  expect_flat(shard, 1, "all_gather");
  static constexpr const char* what = "all-gather of shards";
  PendingGather pending;
  g.collective(what, [&] {
    torch::NoGradGuard no_grad;
    if (g.options.nccl && shard.is_cuda()) {
      torch::Tensor full = torch::empty({shard.numel() * W}, shard.options());
      torch::Tensor in = shard.contiguous();  // held until the transfer is waited for
      auto work = g.tensors->_allgather_base(full, in);
      pending.finish_ = [&g, work, full, in] {
        g.collective(what, [&] { Impl::wait(work); });
        return full;
      };
    } else {
      std::vector<torch::Tensor> in{as_gloo_carries(shard)};
      std::vector<std::vector<torch::Tensor>> parts(1);
      for (int r = 0; r < W; ++r) parts[0].push_back(torch::empty_like(in[0]));
      auto work = g.gloo->allgather(parts, in);
      pending.finish_ = [&g, work, in, parts, device = shard.device(), dtype = shard.scalar_type()] {
        torch::Tensor full;
        g.collective(what, [&] {
          Impl::wait(work);
          torch::NoGradGuard no_grad;
          full = torch::cat(parts[0]).to(device, dtype);
        });
        return full;
      };
    }
    g.stats.allgather_calls += 1;
    g.stats.allgather_bytes += static_cast<std::uint64_t>(shard.nbytes()) * static_cast<std::uint64_t>(W - 1);
  });
  return pending;
}

torch::Tensor Group::reduce_scatter_sum(const torch::Tensor& full) {
  Impl& g = *impl_;
  const int W = g.options.world_size, r = g.options.rank;
  expect_flat(full, W, "reduce_scatter_sum");
  const std::int64_t n = full.numel() / W;
  torch::Tensor mine;
  g.collective("reduce-scatter of gradients", [&] {
    torch::NoGradGuard no_grad;
    std::uint64_t sent = 0;
    if (g.options.nccl && full.is_cuda()) {
      mine = torch::empty({n}, full.options());
      torch::Tensor in = full.contiguous();
      Impl::wait(g.tensors->_reduce_scatter_base(mine, in));
      sent = static_cast<std::uint64_t>(mine.nbytes()) * static_cast<std::uint64_t>(W - 1);
    } else {
      // A ring: at step s rank r sends its running sum of part (r - s - 1) mod W to rank r + 1 and adds its own
      // values to part (r - s - 2) mod W as it arrives from rank r - 1; after W - 1 steps part r has every rank's.
      torch::Tensor acc = as_gloo_carries(full);
      if (acc.data_ptr() == full.data_ptr()) acc = acc.clone();  // the caller's tensor stays as it was
      auto part = [&](int index) { return acc.narrow(0, ((index % W) + W) % W * n, n); };
      torch::Tensor incoming = torch::empty({n}, acc.options());
      for (int s = 0; s + 1 < W; ++s) {
        std::vector<torch::Tensor> out{part(r - s - 1)}, in{incoming};
        auto send = g.gloo->send(out, (r + 1) % W, s);
        auto recv = g.gloo->recv(in, (r + W - 1) % W, s);
        Impl::wait(send);
        Impl::wait(recv);
        part(r - s - 2).add_(incoming);
        sent += static_cast<std::uint64_t>(incoming.nbytes());
      }
      mine = part(r).to(full.device(), full.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
    }
    g.stats.reduce_scatter_calls += 1;
    g.stats.reduce_scatter_bytes +=
        static_cast<std::uint64_t>(full.nbytes()) / static_cast<std::uint64_t>(W) * static_cast<std::uint64_t>(W - 1);
    g.stats.reduce_scatter_sent_bytes += sent;
  });
  return mine;
}

#else  // no c10d Gloo in this LibTorch

struct Group::Impl {};
Group::Group(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Group::~Group() = default;
namespace {
[[noreturn]] void no_c10d() {
  throw unsupported("data parallelism needs LibTorch's c10d with Gloo (USE_C10D_GLOO); this build has none");
}
}  // namespace
std::unique_ptr<Group> Group::listen(const GroupOptions&) { no_c10d(); }
std::unique_ptr<Group> Group::join(const GroupOptions&) { no_c10d(); }
void Group::wait_for_ranks() { no_c10d(); }
int Group::rank() const { return 0; }
int Group::size() const { return 1; }
int Group::port() const { return 0; }
std::string Group::address() const { return {}; }
void Group::post_command(const std::string&, const std::vector<std::string>&) { no_c10d(); }
std::string Group::take_share() { no_c10d(); }
std::string Group::next_command() { no_c10d(); }
std::uint64_t Group::command_number() const { return 0; }
void Group::post_reply(std::uint64_t, const std::string&) { no_c10d(); }
std::optional<std::string> Group::poll_reply(std::uint64_t, int) { no_c10d(); }
std::vector<std::string> Group::gather(const std::string&) { no_c10d(); }
void Group::broadcast(std::string&) { no_c10d(); }
std::string Group::scatter(const std::vector<std::string>&) { no_c10d(); }
void Group::broadcast(const std::vector<torch::Tensor>&) { no_c10d(); }
void Group::allreduce_sum(torch::Tensor&) { no_c10d(); }
torch::Tensor Group::all_to_all(const torch::Tensor&, const std::vector<std::int64_t>&,
                                const std::vector<std::int64_t>&) {
  no_c10d();
}
torch::Tensor Group::all_gather(const torch::Tensor&) { no_c10d(); }
torch::Tensor Group::reduce_scatter_sum(const torch::Tensor&) { no_c10d(); }
PendingGather Group::start_all_gather(const torch::Tensor&) { no_c10d(); }
PendingGather Group::start_gather(const torch::Tensor&) { no_c10d(); }
CollectiveStats Group::stats() const { return {}; }
bool Group::failed() const { return false; }
void Group::mark_failed(const std::string&) {}

#endif

}  // namespace rlloop::engine::dist
