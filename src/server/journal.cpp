#include "server/journal.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <rlloop/error.hpp>

#include "sigv4/sigv4.hpp"
#include "wire/runtime.hpp"

namespace rlloop::server {

namespace fs = std::filesystem;

namespace {

constexpr const char* kSnapshot = "snapshot.jsonl";
constexpr const char* kSnapshotTemp = "snapshot.jsonl.tmp";
// The one log of the servers that wrote no snapshots: it is generation 0's.
constexpr const char* kUnversionedLog = "journal.jsonl";

double wall_clock() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

double seconds(std::chrono::seconds s) { return static_cast<double>(s.count()); }

std::string log_name(std::uint64_t generation) { return "journal-" + std::to_string(generation) + ".jsonl"; }

// The generation of a log's file name; nullopt for any other file.
std::optional<std::uint64_t> log_generation(const std::string& name) {
  constexpr std::string_view prefix = "journal-", suffix = ".jsonl";
  if (name.size() <= prefix.size() + suffix.size() || !name.starts_with(prefix) || !name.ends_with(suffix))
    return std::nullopt;
  const char* first = name.data() + prefix.size();
  const char* last = name.data() + name.size() - suffix.size();
  std::uint64_t g = 0;
  const auto [end, ec] = std::from_chars(first, last, g);
  if (ec != std::errc() || end != last) return std::nullopt;
  return g;
}

// The logs in `dir`, by generation.
std::map<std::uint64_t, std::string> logs_in(const std::string& dir) {
  std::map<std::uint64_t, std::string> out;
  for (const auto& entry : fs::directory_iterator(dir))
    if (auto g = log_generation(entry.path().filename().string())) out[*g] = entry.path().string();
  return out;
}

[[noreturn]] void fail_io(const std::string& what, const std::string& path) {
  throw io_error(what + " '" + path + "': " + std::strerror(errno));
}

void write_all(int fd, std::string_view data, const std::string& path) {
  while (!data.empty()) {
    const ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail_io("cannot write", path);
    data.remove_prefix(static_cast<std::size_t>(n));
  }
}

FileDescriptor open_file(const std::string& path, int flags) {
  FileDescriptor fd(::open(path.c_str(), flags | O_CLOEXEC, 0600));
  if (fd.get() < 0) fail_io("cannot open", path);
  return fd;
}

// Makes the directory's entries (a file created, renamed or removed) durable.
void fsync_dir(const std::string& dir) {
  const FileDescriptor fd = open_file(dir, O_RDONLY | O_DIRECTORY);
  if (::fsync(fd.get()) != 0) fail_io("cannot fsync directory", dir);
}

// A session status as the journal keeps it: its wire string ("Stopped"), so data directories of every version load.
wire::SessionStatus session_status_of(const json& j) {
  const std::string s = j.get<std::string>();
  if (auto status = wire::session_status_from_string(s)) return *status;
  throw invalid_argument("unknown session status '" + s + "'");
}

std::string dump_line(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace) + "\n"; }

// f(record, line bytes) for each line of `path` that is a JSON object; a line cut short by a crash mid-append is
// not one, and is skipped.
template <class F>
void for_each_record(const std::string& path, F&& f) {
  std::ifstream in(path, std::ios::binary);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    json record = json::parse(line, nullptr, false);
    if (!record.is_discarded() && record.is_object()) f(record, line.size() + 1);
  }
}

// Records written before retention existed carry no time: they count from when they are loaded.
double time_of(const json& record) { return record.contains("time") ? record["time"].get<double>() : wall_clock(); }

// The union member an accepted operation's request names ("forwardBackward", "sample", ...).
std::string operation_member(const json& accept) {
  const json& config = accept.at("body").at("operationConfig");
  if (!config.is_object() || config.empty()) throw invalid_argument("an accept record without an operationConfig");
  return config.begin().key();
}

// The digest an accept record's token stands for; records from before digests carry the canonical request.
std::string digest_of(const json& accept) {
  if (accept.contains("digest")) return accept["digest"].get<std::string>();
  return request_digest(accept.value("fingerprint", ""));
}

// Folds a record into the state; one that cannot be applied is reported and skipped, as a server that refused to
// start over one bad line would help nobody.
void apply_logged(DurableState& state, const json& rec, const std::function<void(const std::string&)>& log) {
  try {
    state.apply(rec);
  } catch (const std::exception& e) {
    if (log) log(json{{"ts", wall_clock()}, {"level", "error"}, {"event", "journal"}, {"message", e.what()}}.dump());
  }
}

}  // namespace

std::string request_digest(std::string_view canonical) { return sigv4::hex(sigv4::sha256(canonical)); }

std::string operation_tag(double creation_time) {
  return std::to_string(std::llround(creation_time * 1000) % 100'000'000);
}

std::optional<std::int64_t> operation_ordinal(const std::string& id, double creation_time) {
  const std::string prefix = "op-" + operation_tag(creation_time) + "-";
  if (id.size() <= prefix.size() || id.size() > prefix.size() + 18 || !id.starts_with(prefix)) return std::nullopt;
  std::int64_t n = 0;
  const auto [end, ec] = std::from_chars(id.data() + prefix.size(), id.data() + id.size(), n);
  if (ec != std::errc() || end != id.data() + id.size() || n < 1) return std::nullopt;
  return n;
}

// A record's usage has the shape of the /v1/usage extension: one writer and one reader (wire/runtime.hpp).
json usage_json(const TokenUsage& u) { return wire::to_json(u); }
TokenUsage usage_from_json(const json& j) { return wire::token_usage_from_json(j, "usage"); }

// ---- ModelPackage ----

json checkpoint_record(const std::string& arn, const ModelPackage& p) {
  return {{"t", "checkpoint"},         {"arn", arn},         {"path", p.path},   {"session", p.session},
          {"baseModel", p.base_model}, {"isCheckpoint", p.is_checkpoint},       {"time", p.creation_time},
          {"n", p.version},            {"group", p.group}};
}

ModelPackage model_package_from_record(const json& rec) {
  ModelPackage p;
  p.path = rec.at("path").get<std::string>();
  p.session = rec.value("session", "");
  p.base_model = rec.value("baseModel", "");
  p.is_checkpoint = rec.value("isCheckpoint", false);
  p.creation_time = rec.value("time", 0.0);
  p.version = rec.value("n", std::int64_t{0});
  p.group = rec.value("group", "");
  return p;
}

// ---- DurableState ----

DurableState::Session::Session(const Retention& r)
    : results(r.results, seconds(r.result_age)), tokens(r.client_tokens, seconds(r.client_token_age)) {}

void DurableState::apply(const json& rec) {
  const std::string type = rec.at("t").get<std::string>();
  const std::string tenant_id = rec.at("tenant").get<std::string>();
  if (type == "checkpoint") {
    Tenant& t = tenants[tenant_id];
    t.checkpoints[rec.at("arn").get<std::string>()] = model_package_from_record(rec);
    t.next_checkpoint = std::max(t.next_checkpoint, rec.value("n", std::int64_t{0}) + 1);
    return;
  }
  if (type == "checkpoint_deleted") {  // a Tinker checkpoint deleted or expired: its model package and its record
    tenants[tenant_id].checkpoints.erase(rec.at("arn").get<std::string>());
    tinker.erase({"checkpoint", rec.at("tinkerPath").get<std::string>()});
    return;
  }
  if (type == "tenant") {
    Tenant& t = tenants[tenant_id];
    t.usage = usage_from_json(rec.at("usage"));
    t.next_checkpoint = rec.at("nextCheckpoint").get<std::int64_t>();
    return;
  }
  if (type == "tinker") {
    tinker.insert_or_assign({rec.at("kind").get<std::string>(), rec.at("id").get<std::string>()}, rec);
    return;
  }
  const auto key = std::make_pair(tenant_id, rec.at("session").get<std::string>());
  if (type == "session") {
    Session s(retention_);
    s.created = rec;
    if (auto st = s.created.find("state"); st != s.created.end()) {
      // A snapshot's line: the session as it was when the snapshot was cut.
      s.status = session_status_of(st->at("status"));
      s.error = st->value("error", "");
      s.end_time = st->value("endTime", 0.0);
      s.last_sequence = st->at("lastSequence").get<std::int64_t>();
      s.next_operation = st->at("nextOperation").get<std::int64_t>();
      s.usage = usage_from_json(st->at("usage"));
      s.autosave = st->value("autosave", "");
      if (st->contains("samplerArn")) s.sampler_arn = st->at("samplerArn").get<std::string>();
      s.created.erase(st);
    }
    sessions.insert_or_assign(key, std::move(s));
    return;
  }
  auto it = sessions.find(key);
  if (it == sessions.end()) return;  // a record of a session deleted since
  Session& s = it->second;
  if (type == "status") {
    s.status = session_status_of(rec.at("status"));
    s.error = rec.value("error", "");
    s.end_time = rec.value("time", 0.0);
  } else if (type == "delete") {
    sessions.erase(it);
  } else if (type == "accept") {
    const std::string id = rec.at("id").get<std::string>();
    if (rec.contains("token")) s.tokens.put(rec["token"].get<std::string>(), {id, digest_of(rec)}, time_of(rec));
    if (rec.contains("seq")) s.last_sequence = std::max(s.last_sequence, rec["seq"].get<std::int64_t>());
    if (auto n = operation_ordinal(id, s.created.at("creationTime").get<double>()))
      s.next_operation = std::max(s.next_operation, *n + 1);
    s.pending.push_back(rec);
  } else if (type == "done" || type == "billed") {
    const TokenUsage u = usage_from_json(rec.at("usage"));
    s.usage += u;
    tenants[tenant_id].usage += u;
    if (type == "done") finish(s, rec);
  } else if (type == "pending") {
    s.pending.push_back(rec);
  } else if (type == "replay") {
    s.replay.push_back(rec);
  } else if (type == "result") {
    s.results.put(rec.at("id").get<std::string>(), {rec.at("sampling").get<bool>(), rec.at("state")}, time_of(rec));
  } else if (type == "token") {
    s.tokens.put(rec.at("token").get<std::string>(),
                 {rec.at("id").get<std::string>(), rec.at("digest").get<std::string>()}, time_of(rec));
  } else {
    throw invalid_argument("unknown journal record type '" + type + "'");
  }
}

// An operation's end: its result is retained, and what a restart must redo or resume is noted.
void DurableState::finish(Session& s, const json& rec) {
  const std::string id = rec.at("id").get<std::string>();
  // Operations end in about the order they were accepted, so the search stops near the front.
  auto p = std::find_if(s.pending.begin(), s.pending.end(), [&](const json& a) { return a.at("id") == id; });
  if (p == s.pending.end()) return;  // an OpenAI sample of a server from before "billed" records: never listed
  json accept = std::move(*p);
  s.pending.erase(p);
  const json& state = rec.at("state");
  const bool sampling = accept.at("sampling").get<bool>();
  if (status_of(state) == wire::OperationStatus::completed) {
    const std::string member = operation_member(accept);
    if (rec.contains("autosave")) {
      s.autosave = rec["autosave"].get<std::string>();
      s.replay.clear();
    } else if (!sampling && wire::effect<wire::Call::training>(member).replayed) {
      s.replay.push_back(std::move(accept));
    } else if (sampling && member == wire::Binding<op::LoadWeightsForSampling>::name) {
      s.sampler_arn = accept["body"]["operationConfig"][member].at("modelPackageArn").get<std::string>();
    }
  }
  s.results.put(id, {sampling, state}, time_of(rec));
}

void DurableState::expire(double now) {
  for (auto& [key, s] : sessions) {
    s.results.expire(now);
    s.tokens.expire(now);
  }
}

std::string DurableState::snapshot(std::uint64_t generation) const {
  std::string out = dump_line({{"t", "snapshot"}, {"generation", generation}, {"format", 1}});
  std::size_t lines = 0;
  auto line = [&](const json& j) {
    out += dump_line(j);
    ++lines;
  };
  for (const auto& [id, t] : tenants) {
    for (const auto& [arn, package] : t.checkpoints) {
      json rec = checkpoint_record(arn, package);
      rec["tenant"] = id;
      line(rec);
    }
    line({{"t", "tenant"}, {"tenant", id}, {"usage", usage_json(t.usage)}, {"nextCheckpoint", t.next_checkpoint}});
  }
  for (const auto& [key, rec] : tinker) line(rec);
  for (const auto& [key, s] : sessions) {
    json head = s.created;
    head["state"] = {{"status", to_string(s.status)},
                     {"error", s.error},
                     {"endTime", s.end_time},
                     {"lastSequence", s.last_sequence},
                     {"nextOperation", s.next_operation},
                     {"usage", usage_json(s.usage)},
                     {"autosave", s.autosave}};
    if (s.sampler_arn) head["state"]["samplerArn"] = *s.sampler_arn;
    line(head);
    auto accepted = [&](json rec, const char* type) {
      rec["t"] = type;
      line(rec);
    };
    for (const json& rec : s.pending) accepted(rec, "pending");
    for (const json& rec : s.replay) accepted(rec, "replay");
    const json where{{"tenant", key.first}, {"session", key.second}};
    s.results.for_each([&](const std::string& id, const Result& r, double time) {
      json j{{"t", "result"}, {"id", id}, {"sampling", r.sampling}, {"state", r.state}, {"time", time}};
      j.update(where);
      line(j);
    });
    s.tokens.for_each([&](const std::string& token, const ClientTokenRecord& r, double time) {
      json j{{"t", "token"}, {"token", token}, {"id", r.operation_id}, {"digest", r.digest}, {"time", time}};
      j.update(where);
      line(j);
    });
  }
  out += dump_line({{"t", "end"}, {"generation", generation}, {"lines", lines}});
  return out;
}

// ---- Journal ----

FileDescriptor& FileDescriptor::operator=(FileDescriptor&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

FileDescriptor::~FileDescriptor() {
  if (fd_ >= 0) ::close(fd_);
}

Journal::Journal(const std::string& dir, JournalOptions options)
    : dir_(dir), options_(std::move(options)), state_(options_.retention) {
  fs::create_directories(dir_);
  std::error_code ignored;
  fs::remove(fs::path(dir_) / kSnapshotTemp, ignored);  // a compaction that stopped before its rename
  const fs::path unversioned = fs::path(dir_) / kUnversionedLog;
  if (fs::exists(unversioned) && !fs::exists(fs::path(dir_) / log_name(0))) {
    fs::rename(unversioned, fs::path(dir_) / log_name(0));
    fsync_dir(dir_);
  }
  const std::uint64_t snapshot_generation = load_snapshot();
  generation_ = snapshot_generation;
  for (const auto& [g, path] : logs_in(dir_)) {
    if (g < snapshot_generation) {
      fs::remove(path, ignored);  // stale: the snapshot holds it (a compaction stopped before removing it)
      continue;
    }
    load_log(path);
    generation_ = g;
  }
  open_log(generation_);
  compactor_ = std::thread([this] { compactor(); });
}

Journal::~Journal() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  wake_.notify_all();
  compactor_.join();
}

std::uint64_t Journal::generation() const {
  std::lock_guard lock(mu_);
  return generation_;
}

void Journal::step(CompactionStep s) const {
  if (options_.on_compaction_step) options_.on_compaction_step(s);
}

std::uint64_t Journal::load_snapshot() {
  const std::string path = (fs::path(dir_) / kSnapshot).string();
  if (!fs::exists(path)) return 0;
  // The file is only ever renamed into place complete: a snapshot without its header and end line was damaged
  // after it was written, and starting from part of it would lose state silently.
  std::optional<std::uint64_t> generation;
  bool ended = false;
  std::ifstream in(path, std::ios::binary);
  std::string line;
  while (!ended && std::getline(in, line)) {
    if (line.empty()) continue;
    const json rec = json::parse(line, nullptr, false);
    if (rec.is_discarded() || !rec.is_object()) throw io_error("snapshot '" + path + "' has a malformed line");
    const std::string type = rec.value("t", "");
    if (!generation) {
      if (type != "snapshot") throw io_error("snapshot '" + path + "' does not start with its header");
      generation = rec.at("generation").get<std::uint64_t>();
    } else if (type == "end") {
      ended = true;
    } else {
      apply_logged(state_, rec, options_.log);
    }
  }
  if (!ended) throw io_error("snapshot '" + path + "' is incomplete");
  snapshot_bytes_ = fs::file_size(path);
  return *generation;
}

void Journal::load_log(const std::string& path) {
  for_each_record(path, [&](const json& rec, std::size_t bytes) {
    apply_logged(state_, rec, options_.log);
    ++log_records_;
    log_bytes_ += bytes;
  });
}

void Journal::open_log(std::uint64_t generation) {
  const std::string path = (fs::path(dir_) / log_name(generation)).string();
  FileDescriptor fd = open_file(path, O_RDWR | O_CREAT | O_APPEND);
  // A crash can leave a partial last line; end it so the next record starts on a line of its own.
  const off_t size = ::lseek(fd.get(), 0, SEEK_END);
  char last = '\n';
  if (size > 0 && (::pread(fd.get(), &last, 1, size - 1) != 1 || (last != '\n' && ::write(fd.get(), "\n", 1) != 1)))
    fail_io("cannot repair journal", path);
  fsync_dir(dir_);
  log_ = std::move(fd);
}

void Journal::append(const json& record) {
  const std::string line = dump_line(record);
  std::lock_guard lock(mu_);
  const std::string path = (fs::path(dir_) / log_name(generation_)).string();
  write_all(log_.get(), line, path);
  if (::fdatasync(log_.get()) != 0) fail_io("cannot fsync journal", path);
  ++log_records_;
  log_bytes_ += line.size();
  apply_logged(state_, record, options_.log);
  if (!compaction_wanted_ && compaction_due_locked()) {
    compaction_wanted_ = true;
    wake_.notify_all();
  }
}

bool Journal::compaction_due_locked() const {
  return (options_.compact_records > 0 && log_records_ >= options_.compact_records) ||
         (options_.compact_bytes > 0 && log_bytes_ >= std::max(options_.compact_bytes, snapshot_bytes_));
}

void Journal::compactor() {
  std::unique_lock lock(mu_);
  while (true) {
    wake_.wait(lock, [&] { return stopping_ || compaction_wanted_; });
    if (stopping_) return;
    compaction_wanted_ = false;
    lock.unlock();
    try {
      compact();
    } catch (const std::exception& e) {
      // The logs still hold everything; the next trigger tries again.
      if (options_.log)
        options_.log(
            json{{"ts", wall_clock()}, {"level", "error"}, {"event", "compaction"}, {"message", e.what()}}.dump());
    }
    lock.lock();
  }
}

void Journal::compact() {
  std::lock_guard one_at_a_time(compact_mu_);
  std::string snapshot;
  std::uint64_t generation = 0;
  std::size_t records = 0;
  {
    std::lock_guard lock(mu_);
    generation = generation_ + 1;
    state_.expire(wall_clock());
    snapshot = state_.snapshot(generation);
    open_log(generation);
    generation_ = generation;
    records = std::exchange(log_records_, 0);
    log_bytes_ = 0;
  }
  step(CompactionStep::log_switched);
  write_snapshot(snapshot);
  remove_logs_before(generation);
  step(CompactionStep::old_logs_removed);
  {
    std::lock_guard lock(mu_);
    snapshot_bytes_ = snapshot.size();
  }
  if (options_.log)
    options_.log(json{{"ts", wall_clock()},
                      {"level", "info"},
                      {"event", "compacted"},
                      {"generation", generation},
                      {"records", records},
                      {"snapshotBytes", snapshot.size()}}
                     .dump());
}

void Journal::write_snapshot(const std::string& text) {
  const std::string temp = (fs::path(dir_) / kSnapshotTemp).string();
  const std::string path = (fs::path(dir_) / kSnapshot).string();
  {
    const FileDescriptor fd = open_file(temp, O_WRONLY | O_CREAT | O_TRUNC);
    const std::string_view all(text);
    write_all(fd.get(), all.substr(0, all.size() / 2), temp);
    step(CompactionStep::snapshot_half_written);
    write_all(fd.get(), all.substr(all.size() / 2), temp);
    if (::fsync(fd.get()) != 0) fail_io("cannot fsync snapshot", temp);
  }
  step(CompactionStep::snapshot_written);
  if (::rename(temp.c_str(), path.c_str()) != 0) fail_io("cannot rename snapshot", temp);
  fsync_dir(dir_);
  step(CompactionStep::snapshot_renamed);
}

void Journal::remove_logs_before(std::uint64_t generation) {
  for (const auto& [g, path] : logs_in(dir_))
    if (g < generation) fs::remove(path);
  fsync_dir(dir_);
}

}  // namespace rlloop::server
