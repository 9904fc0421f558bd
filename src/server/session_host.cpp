// A hosted session's worker: creates the session, then runs its operations in arrival (= sequence number) order
// (session_operations.cpp), recording each result: one at a time (execute), except that consecutive sample
// operations run side by side (start_sample, sample_state: the session decodes them together). When the server
// is durable, each result is journaled before it is visible, and a LoRA state is saved after every optimizer step.
#include <chrono>
#include <filesystem>
#include <utility>

#include "server/api_impl.hpp"
#include "server/journal.hpp"

namespace rlloop::server {

using wire::OperationStatus;
using wire::SessionStatus;

double now_seconds() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

std::optional<std::string> query_value(const std::string& target, std::string_view key) {
  const auto q = target.find('?');
  if (q == std::string::npos) return std::nullopt;
  for (std::size_t start = q + 1; start <= target.size();) {
    std::size_t end = target.find('&', start);
    if (end == std::string::npos) end = target.size();
    const std::string_view part(target.data() + start, end - start);
    if (part.size() > key.size() && part.substr(0, key.size()) == key && part[key.size()] == '=')
      return std::string(part.substr(key.size() + 1));
    start = end + 1;
  }
  return std::nullopt;
}

namespace {
double seconds(std::chrono::seconds s) { return static_cast<double>(s.count()); }

// A finished operation's request is no longer needed: memory then holds only its result.
void release_request(OperationRecord& op) {
  op.body = nullptr;
  op.op = {};
}

// The state a queued operation ends in when its session stops before running it.
json stopped_state(const OperationRecord& op) {
  return op.sampling ? state_body(OperationStatus::failed, "session stopped") : state_body(OperationStatus::skipped);
}
}  // namespace

SessionHost::SessionHost(std::shared_ptr<TenantState> t, std::string n, std::string a, SessionOptions o, json e,
                         const Backend& backend, HostConfig config, double created, std::optional<Recovery> recovery,
                         wire::SessionStatus initial_status)
    : tenant(std::move(t)),
      name(std::move(n)),
      arn(std::move(a)),
      options(std::move(o)),
      echo(std::move(e)),
      creation_time(created > 0 ? created : now_seconds()),
      status(initial_status),
      last_modified(creation_time),
      config_(std::move(config)),
      finished_(config_.retention.results, seconds(config_.retention.result_age)),
      client_tokens_(config_.retention.client_tokens, seconds(config_.retention.client_token_age)) {
  if (recovery) restore(*recovery);
  if (status == SessionStatus::created)
    worker_ = std::thread(
        [this, backend, recovery = std::move(recovery)]() mutable { run(std::move(backend), std::move(recovery)); });
}

// What the session reported before the restart, set before its worker starts. A session that is not live keeps
// its unfinished operations as its stop left them.
void SessionHost::restore(Recovery& r) {
  last_sequence_number = r.last_sequence_number;
  next_operation_ = r.next_operation;
  usage = r.usage;
  error_details = r.error_details;
  if (status != SessionStatus::created) end_time = r.end_time;
  for (auto& [op, time] : r.finished) {
    const std::string id = op->id;  // before op is moved into the map
    finished_.put(id, std::move(op), time);
  }
  for (auto& [token, record, time] : r.client_tokens) client_tokens_.put(token, std::move(record), time);
  r.finished.clear();  // owned by the retention from here on
  r.client_tokens.clear();
  for (auto& op : r.pending) {
    unfinished_[op->id] = op;
    if (status != SessionStatus::created) settle_locked(op, stopped_state(*op), now_seconds());
  }
}

json SessionHost::guarded(const std::function<json()>& work) {
  try {
    return work();
  } catch (const group_failure& e) {
    // The other ranks that train this session are gone: it is Blocked until the server has formed its
    // data-parallel group again (rlloop serve restarts for that, and the session comes back Running). Journaled
    // once, though every sample started beside the failed one fails the same way.
    const std::string why = std::string(e.what()).substr(0, 1024);
    std::lock_guard lock(mu);
    if (status != SessionStatus::blocked) {
      status = SessionStatus::blocked;
      error_details = why;
      last_modified = now_seconds();
      journal({{"t", "status"}, {"status", to_string(status)}, {"error", error_details}, {"time", last_modified}});
    }
    return state_body(OperationStatus::failed, why);
  } catch (const std::exception& e) {
    return state_body(OperationStatus::failed, std::string(e.what()).substr(0, 1024));
  }
}

void SessionHost::start_beside(std::vector<StartedSample>& started, const std::shared_ptr<OperationRecord>& op) {
  Future<SampleResponse> response;
  const json failed = guarded([&] {
    response = start_sample(*op);
    return json();
  });
  if (response.valid())
    started.push_back({op, std::move(response)});
  else
    finish(op, failed, "");
}

void SessionHost::finish_samples(std::vector<StartedSample>& started, bool wait) {
  std::erase_if(started, [&](StartedSample& s) {
    if (!wait && !s.response.is_ready()) return false;
    finish(s.op, guarded([&] { return sample_state(*s.op, s.response.get()); }), "");
    return true;
  });
}

SessionHost::~SessionHost() {
  stop(false);
  join();
}

void SessionHost::journal(json record) {
  if (!config_.journal) return;
  record["tenant"] = tenant->config.id;
  record["session"] = name;
  config_.journal->append(record);
}

void SessionHost::enqueue_locked(std::shared_ptr<OperationRecord> op) {
  queue_.push_back(std::move(op));
  cv_.notify_all();
}

void SessionHost::stop(bool durable) {
  {
    std::lock_guard lock(mu);
    const bool live = takes_operations_locked() || status == SessionStatus::created;
    if (live) status = SessionStatus::stopping;
    if (live && durable)
      journal({{"t", "status"}, {"status", to_string(SessionStatus::stopped)}, {"time", now_seconds()}});
    stopping_ = true;
    last_modified = now_seconds();
  }
  cv_.notify_all();
}

void SessionHost::join() {
  if (worker_.joinable()) worker_.join();
}

void SessionHost::wait_started() {
  std::unique_lock lock(mu);
  done_cv_.wait(lock, [&] { return status != SessionStatus::created; });
}

bool SessionHost::takes_operations_locked() const {
  return status == SessionStatus::running || status == SessionStatus::blocked;
}

void SessionHost::require_takes_operations_locked() const {
  if (!takes_operations_locked())
    throw api_error(
        "ConflictException", 409,
        "Training session " + name + " is " + std::string(to_string(status)) + "; must be Running or Blocked");
}

void SessionHost::on_done_locked(OperationRecord& op, std::function<void()> f) { op.on_done.push_back(std::move(f)); }

void SessionHost::on_started_locked(std::function<void()> f) { on_started_.push_back(std::move(f)); }

void SessionHost::accept_locked(const std::shared_ptr<OperationRecord>& op, const std::optional<std::string>& token,
                                std::int64_t seq, double now) {
  json rec{{"t", "accept"}, {"id", op->id}, {"sampling", op->sampling}, {"digest", op->digest}, {"body", op->body}};
  rec["time"] = now;
  if (token) rec["token"] = *token;
  if (!op->sampling) rec["seq"] = seq;
  // Durable before the id is returned: a client retrying after a crash gets this same operation back.
  journal(std::move(rec));
  if (token) client_tokens_.put(*token, {op->id, op->digest}, now);
  unfinished_[op->id] = op;
  last_modified = now;
  enqueue_locked(op);
}

std::string SessionHost::new_operation_id_locked() {
  return "op-" + operation_tag(creation_time) + "-" + std::to_string(next_operation_++);
}

std::shared_ptr<OperationRecord> SessionHost::find_operation_locked(const std::string& id, double now) const {
  if (auto it = unfinished_.find(id); it != unfinished_.end()) return it->second;
  const auto* op = finished_.find(id, now);
  return op ? *op : nullptr;
}

bool SessionHost::issued_locked(const std::string& id) const {
  const auto n = operation_ordinal(id, creation_time);
  return n && *n < next_operation_;
}

const ClientTokenRecord* SessionHost::find_client_token_locked(const std::string& token, double now) const {
  return client_tokens_.find(token, now);
}

std::vector<std::function<void()>> SessionHost::settle_locked(const std::shared_ptr<OperationRecord>& op, json state,
                                                              double now) {
  op->state = std::move(state);
  release_request(*op);
  if (op->retrievable) {
    unfinished_.erase(op->id);
    finished_.put(op->id, op, now);
  }
  return std::exchange(op->on_done, {});
}

namespace {
void run_all(const std::vector<std::function<void()>>& callbacks) {
  for (const auto& f : callbacks) f();
}
}  // namespace

// Journals an operation's end, then makes it visible: a client never sees a result a restart would forget. An
// OpenAI sample is never listed, so only its billing is journaled.
void SessionHost::finish(const std::shared_ptr<OperationRecord>& op, json state, const std::string& autosave) {
  const double now = now_seconds();
  if (op->retrievable) {
    json rec{{"t", "done"}, {"id", op->id}, {"state", state}, {"usage", usage_json(op->billed)}, {"time", now}};
    if (!autosave.empty()) rec["autosave"] = autosave;
    journal(std::move(rec));
  } else if (op->billed != TokenUsage{}) {
    journal({{"t", "billed"}, {"usage", usage_json(op->billed)}});
  }
  std::vector<std::function<void()>> waiting;
  {
    std::lock_guard lock(mu);
    waiting = settle_locked(op, std::move(state), now);
    last_modified = now_seconds();
    done_cv_.notify_all();
  }
  run_all(waiting);
}

// Rebuilds the state the session had when the server stopped: the last autosave (weights, optimizer moments, step,
// RNG, pending gradients), then the state-changing operations that completed after it (forwardBackward, loadState:
// fewer than HostConfig::autosave_after_operations). Their results were already reported and billed; they are only
// run again.
void SessionHost::recover(const Recovery& r) {
  if (!r.autosave.empty()) {
    session->load_state(r.autosave, true).get();
    autosave_ = r.autosave;
  }
  replayable_since_autosave_ = r.replay.size();
  for (const auto& op : r.replay) replay(std::get<wire::TrainingOperation>(op->op));
  sampler_path_ = r.sampler_path;
}

// After `op` completed (counting it toward the next autosave): whether the session's state is saved before the op
// is reported. A completed step must
// survive a crash before it is reported: the trainable state (LoRA adapter or weights, optimizer, pending
// gradients) is saved under a fresh name; the journal record names it, and only then is the older one removed.
// The other operations that change the state (forwardBackward accumulates gradients, loadState replaces it) are run
// again by a restart instead, up to autosave_after_operations - 1 of them: the next one saves.
// Which operations are which is their descriptors' (rlloop/operations.hpp: autosaved, replayed).
bool SessionHost::needs_autosave(const OperationRecord& op) {
  const wire::Effect effect = std::visit([](const auto& o) { return effect_of(o); }, op.op);
  if (effect.autosaved) return true;
  if (!effect.replayed) return false;
  ++replayable_since_autosave_;
  return config_.autosave_after_operations > 0 && replayable_since_autosave_ >= config_.autosave_after_operations;
}

std::string SessionHost::start(Backend& backend, const std::optional<Recovery>& recovery) {
  HostedSession created;
  std::string failure;
  SessionInfo session_info;
  std::vector<std::function<void()>> waiting_for_start;
  try {
    created = backend.create_session(options);
    session_info = created.session->info();
    {
      std::lock_guard lock(mu);
      session = created.session;
    }
    export_merged_ = created.export_merged_model;
    export_peft_ = created.export_peft_adapter;
    sample_streaming_ = created.sample_streaming;
    if (recovery) recover(*recovery);
  } catch (const std::exception& e) {
    failure = e.what();
  }
  {
    std::lock_guard lock(mu);
    last_modified = now_seconds();
    if (!failure.empty()) {
      session.reset();
      status = SessionStatus::failed;
      error_details = failure.substr(0, 1024);
      end_time = last_modified;
      journal({{"t", "status"}, {"status", to_string(status)}, {"error", error_details}, {"time", end_time}});
    } else if (!stopping_) {
      vocab_size = session_info.vocab_size;
      info = session_info;
      status = SessionStatus::running;
      error_details.clear();  // what blocked it before a restart no longer holds
      if (recovery)
        for (auto& op : recovery->pending) queue_.push_back(op);
    }
    done_cv_.notify_all();
    waiting_for_start.swap(on_started_);
  }
  for (auto& f : waiting_for_start) f();
  return failure;
}

void SessionHost::run(Backend backend, std::optional<Recovery> recovery) {
  const std::string failure = start(backend, recovery);
  recovery.reset();  // the replayed requests are no longer needed; the pending ones are queued
  // Sample operations started on the session and not yet finished. Consecutive ones run side by side, each started
  // as it reaches the queue's front (the session decodes them together: one batch instead of one request after
  // another); any other operation waits until they are all done, as its place in the order says.
  std::vector<StartedSample> started;
  while (failure.empty()) {
    std::shared_ptr<OperationRecord> op;
    {
      std::unique_lock lock(mu);
      auto next_may_start = [&] { return !queue_.empty() && (started.empty() || is_sample(*queue_.front())); };
      if (started.empty())
        cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      else  // and looks at the started samples every kSamplePoll
        cv_.wait_for(lock, kSamplePoll, [&] { return stopping_ || next_may_start(); });
      if (stopping_) break;
      if (next_may_start()) {
        op = queue_.front();
        queue_.pop_front();
        op->state = state_body(OperationStatus::in_progress);
      }
    }
    if (op && is_sample(*op)) {
      start_beside(started, op);
      op.reset();
    }
    finish_samples(started, /*wait=*/false);
    if (!op) continue;
    std::string autosave;
    json state = guarded([&] {
      json done = execute(*op);
      if (config_.journal && needs_autosave(*op))
        autosave = session->save_state("autosave-" + tenant->config.id + "-" + name + "-" + op->id).get().path;
      return done;
    });
    const bool failed = status_of(state) == OperationStatus::failed;
    finish(op, std::move(state), autosave);
    if (!autosave.empty()) {
      std::error_code ec;
      if (!autosave_.empty()) std::filesystem::remove_all(autosave_, ec);
      autosave_ = autosave;
      replayable_since_autosave_ = 0;
    }
    // Later training operations were planned on this one's effect (an optimizer step on its gradients, ...): skip
    // the ones already queued rather than run them on a state the caller did not expect.
    if (failed && !op->sampling) skip_queued_training();
  }
  finish_samples(started, /*wait=*/true);  // a stopping session's samples already decoding are answered
  close_queue();
}

void SessionHost::skip_queued_training() {
  std::vector<std::shared_ptr<OperationRecord>> skipped;
  {
    std::lock_guard lock(mu);
    for (auto& queued : queue_)
      if (!queued->sampling) skipped.push_back(queued);
    std::erase_if(queue_, [](const auto& q) { return !q->sampling; });
  }
  for (auto& q : skipped) finish(q, state_body(OperationStatus::skipped), "");
}

void SessionHost::close_queue() {
  std::vector<std::function<void()>> waiting;
  {
    std::lock_guard lock(mu);
    const double now = now_seconds();
    for (auto& queued : queue_) {
      auto w = settle_locked(queued, stopped_state(*queued), now);
      waiting.insert(waiting.end(), std::make_move_iterator(w.begin()), std::make_move_iterator(w.end()));
    }
    queue_.clear();
    done_cv_.notify_all();
    session.reset();  // frees the model while the record stays describable
    if (status == SessionStatus::stopping || status == SessionStatus::created) {
      status = SessionStatus::stopped;
      end_time = last_modified = now_seconds();
    }
    done_cv_.notify_all();
  }
  run_all(waiting);
}

}  // namespace rlloop::server
