// The server's durable record under --data-dir: a snapshot of the live state plus a log of the records appended
// since, each fsync'd before append() returns, so whatever the server reported (an accepted operation id, a
// Completed result, a checkpoint ARN) is still known after a crash.
//
// The state is the fold of the records (DurableState::apply) and a snapshot is that fold written out, so loading
// snapshot + log gives the state the whole history would, while its size and the time to load it follow the live
// state (sessions, billing, checkpoints, unfinished operations, retained results and client tokens), not the
// history. Files:
//   snapshot.jsonl     generation S: a header line, the state's lines, an end line
//   journal-<G>.jsonl  the records appended after the snapshot of generation G was cut
// Compaction to generation G+1, one step at a time (CompactionStep):
//   1. under the append lock, write the state out in memory and switch appends to a new, empty journal-<G+1>.jsonl;
//   2. write snapshot.jsonl.tmp and fsync it;
//   3. rename it over snapshot.jsonl and fsync the directory;
//   4. remove the logs of generations before G+1.
// Loading applies the snapshot, then every log of a generation >= S in order, and removes older ones. A crash
// before 3 leaves the old snapshot with both logs (the old one ends where the new one starts), a crash after it the
// new snapshot, whose generation makes the old log stale; a torn snapshot.jsonl.tmp is ignored. Nothing appended is
// ever in neither the snapshot nor a log that loading applies, and nothing is applied twice.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include <rlloop/types.hpp>

#include "server/server.hpp"
#include "wire/control_plane.hpp"
#include "wire/runtime.hpp"

namespace rlloop::server {

// A checkpoint a tenant owns: where it is, and what DescribeModelPackage / ListModelPackages say of it.
struct ModelPackage {
  std::string path;
  std::string session;         // the training session that saved it
  std::string base_model;      // that session's base model (catalogue name)
  bool is_checkpoint = false;  // saveState (weights and optimizer) rather than saveWeights
  double creation_time = 0;
  std::int64_t version = 0;    // n in its ARN .../model-package/{session}/{n}
  std::string group;           // the session's ModelPackageGroupArn, empty if it named none
};
// The journal's "checkpoint" record of `arn` (with "t" and "arn"; records of older servers hold only the path).
nlohmann::json checkpoint_record(const std::string& arn, const ModelPackage& p);
ModelPackage model_package_from_record(const nlohmann::json& record);


using nlohmann::json;

// Entries in the order they were put, at most `max_count` of them and none `max_age` seconds old or older: how
// long results of finished operations and client tokens are kept. Times are seconds since the epoch.
template <class Value>
class RetainedMap {
 public:
  RetainedMap(std::size_t max_count, double max_age) : max_count_(max_count), max_age_(max_age) {}

  // Puts `key` at `time` (replacing an entry of that key), then drops what the limits no longer keep.
  void put(const std::string& key, Value value, double time) {
    entries_.insert_or_assign(key, Entry{std::move(value), time, next_order_});
    order_.push_back({key, next_order_++});
    expire(time);
  }
  // The value of `key` while it is kept at `now`; null otherwise.
  const Value* find(const std::string& key, double now) const {
    auto it = entries_.find(key);
    return it == entries_.end() || expired(it->second, now) ? nullptr : &it->second.value;
  }
  // Drops the oldest entries beyond max_count and those max_age old at `now`.
  void expire(double now) {
    while (!order_.empty()) {
      auto it = entries_.find(order_.front().first);
      const bool current = it != entries_.end() && it->second.order == order_.front().second;
      if (current && entries_.size() <= max_count_ && !expired(it->second, now)) break;
      if (current) entries_.erase(it);
      order_.pop_front();  // an entry, or the place of one that was replaced since
    }
  }
  // f(key, value, time) for each entry, oldest first.
  template <class F>
  void for_each(F&& f) const {
    for (const auto& [key, order] : order_) {
      auto it = entries_.find(key);
      if (it != entries_.end() && it->second.order == order) f(key, it->second.value, it->second.time);
    }
  }
  std::size_t size() const { return entries_.size(); }

 private:
  struct Entry {
    Value value;
    double time;
    std::uint64_t order;
  };
  bool expired(const Entry& e, double now) const { return now - e.time >= max_age_; }

  std::size_t max_count_;
  double max_age_;
  std::map<std::string, Entry> entries_;
  std::deque<std::pair<std::string, std::uint64_t>> order_;  // (key, order) in put order
  std::uint64_t next_order_ = 0;
};

// What a client token (clientToken, Idempotency-Key) stands for: an operation, and the request it was used with.
struct ClientTokenRecord {
  std::string operation_id;
  std::string digest;  // request_digest of what a retry must repeat
};

// SHA-256 (hex) of a request's canonical form: a token record keeps this, not the request.
std::string request_digest(std::string_view canonical);

// Operation ids of a session are "op-<tag>-<n>": the tag comes from the session's creation time (so a session
// recreated under the same name issues other ids) and n counts the session's operations from 1. An id of the
// session's with n below its next number was issued by it, which tells an expired result from a made-up id.
std::string operation_tag(double creation_time);
// n of an id of this form and tag; nullopt for any other id.
std::optional<std::int64_t> operation_ordinal(const std::string& id, double creation_time);

json usage_json(const TokenUsage& u);
TokenUsage usage_from_json(const json& j);

// An operation's state is kept, journaled and answered as its Get*OperationResult body. Its status: only the
// server writes these bodies, so one without a status it knows is taken for finished (Failed).
inline wire::OperationStatus status_of(const json& state) {
  const auto it = state.find("status");
  const auto status = it != state.end() && it->is_string()
                          ? wire::operation_status_from_string(it->get_ref<const std::string&>())
                          : std::nullopt;
  return status.value_or(wire::OperationStatus::failed);
}
// The body of a state without a result: its status, and the errorDetails of a failure.
inline json state_body(wire::OperationStatus status, std::optional<std::string> error_details = std::nullopt) {
  json j{{"status", to_string(status)}};
  if (error_details) j["errorDetails"] = std::move(*error_details);
  return j;
}

// The fold of the journal's records: what a restart needs to know.
class DurableState {
 public:
  struct Result {
    bool sampling = false;
    json state;  // the Get*OperationResult body
  };
  struct Session {
    explicit Session(const Retention& r);
    json created;  // its "session" record: arn, baseModel, rank, alpha, echo, creationTime
    wire::SessionStatus status = wire::SessionStatus::running;  // kept as its wire string
    std::string error;
    double end_time = 0;
    std::int64_t last_sequence = -1;
    std::int64_t next_operation = 1;
    TokenUsage usage;
    std::string autosave;                    // latest state saved after a completed optimizerStep
    std::optional<std::string> sampler_arn;  // from the last completed loadWeightsForSampling
    std::vector<json> pending;               // "accept" records of operations not finished, in acceptance order
    std::vector<json> replay;                // those of completed state-changing operations since the autosave
    RetainedMap<Result> results;
    RetainedMap<ClientTokenRecord> tokens;
  };
  struct Tenant {
    TokenUsage usage;
    std::int64_t next_checkpoint = 1;
    std::map<std::string, ModelPackage> checkpoints;  // by model-package ARN
  };

  explicit DurableState(Retention retention) : retention_(retention) {}
  // Folds one record (appended, or a line of a snapshot) into the state; throws on a malformed one.
  void apply(const json& record);
  // Drops results and client tokens the retention no longer keeps at `now`.
  void expire(double now);
  // The state as the lines of a snapshot of `generation` (header and end line included).
  std::string snapshot(std::uint64_t generation) const;

  // By tenant id; records of tenants that left the tenants file are kept, for when they come back.
  std::map<std::string, Tenant> tenants;
  std::map<std::pair<std::string, std::string>, Session> sessions;  // (tenant, name)
  // Tinker's records ({"t": "tinker"}: tinker.hpp), the latest of each (kind, id).
  std::map<std::pair<std::string, std::string>, json> tinker;

 private:
  Session* session_of(const json& record);
  void finish(Session& s, const json& record);
  Retention retention_;
};

// An open file descriptor, closed when it goes.
class FileDescriptor {
 public:
  FileDescriptor() = default;
  explicit FileDescriptor(int fd) : fd_(fd) {}
  FileDescriptor(FileDescriptor&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  FileDescriptor& operator=(FileDescriptor&& other) noexcept;
  ~FileDescriptor();
  int get() const { return fd_; }

 private:
  int fd_ = -1;
};

// The steps of a compaction, each reported once it is done (JournalOptions::on_compaction_step).
enum class CompactionStep { log_switched, snapshot_half_written, snapshot_written, snapshot_renamed, old_logs_removed };

struct JournalOptions {
  Retention retention;
  // A compaction starts (on the journal's own thread) once the logs since the snapshot hold this many records, or
  // this many bytes and at least the snapshot's size (so rewriting the snapshot costs at most as much again as the
  // appends did). 0 turns a bound off.
  std::size_t compact_records = 10'000;
  std::size_t compact_bytes = 1u << 20;
  std::function<void(const std::string&)> log;
  // Called after each step of a compaction, on the compacting thread: tests kill the process there.
  std::function<void(CompactionStep)> on_compaction_step;
};

class Journal {
 public:
  // Loads <dir>'s snapshot and logs (creating the directory); throws io_error.
  Journal(const std::string& dir, JournalOptions options);
  ~Journal();
  Journal(const Journal&) = delete;
  Journal& operator=(const Journal&) = delete;

  // Writes one record, fsyncs it, then folds it into state(). Thread-safe.
  void append(const json& record);
  // Writes the state as the new snapshot and drops the logs it covers; appends continue meanwhile. Thread-safe;
  // one compaction at a time.
  void compact();
  // The state folded so far: read it only while nothing appends (at start-up).
  const DurableState& state() const { return state_; }
  std::uint64_t generation() const;

 private:
  std::uint64_t load_snapshot();
  void load_log(const std::string& path);
  void open_log(std::uint64_t generation);
  bool compaction_due_locked() const;
  void write_snapshot(const std::string& text);
  void remove_logs_before(std::uint64_t generation);
  void step(CompactionStep s) const;
  void compactor();

  std::string dir_;
  JournalOptions options_;
  mutable std::mutex mu_;  // guards the state, the log and the counters below
  DurableState state_;
  std::uint64_t generation_ = 0;  // of the log appends go to
  FileDescriptor log_;
  std::size_t log_records_ = 0;  // appended since the last compaction's cut (or, after loading, since the snapshot)
  std::size_t log_bytes_ = 0;
  std::size_t snapshot_bytes_ = 0;
  bool compaction_wanted_ = false;
  bool stopping_ = false;
  std::condition_variable wake_;
  std::mutex compact_mu_;  // one compaction at a time
  std::thread compactor_;
};

}  // namespace rlloop::server
