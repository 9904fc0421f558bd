// Internal state of the Api: tenants, hosted sessions and their operations. Not installed.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string_view>
#include <string>
#include <thread>
#include <tuple>
#include <variant>

#include <nlohmann/json.hpp>

#include <rlloop/limits.hpp>

#include "server/journal.hpp"
#include "server/server.hpp"
#include "wire/control_plane.hpp"
#include "wire/runtime.hpp"

namespace rlloop::server {

using nlohmann::json;

// An error answered to the client: AWS error name + HTTP status.
class api_error : public error {
 public:
  api_error(std::string code, unsigned status, const std::string& message)
      : error(message), code_(std::move(code)), status_(status) {}
  const std::string& code() const noexcept { return code_; }
  unsigned status() const noexcept { return status_; }

 private:
  std::string code_;
  unsigned status_;
};

double now_seconds();

// The value of query parameter `key` in a request target ("/path?a=1&b=2"), nullopt when it has none.
std::optional<std::string> query_value(const std::string& target, std::string_view key);

// Per tenant: its configuration, its billing total and the checkpoints it owns, by model-package ARN.
struct TenantState {
  Tenant config;
  std::mutex mu;
  TokenUsage usage;
  std::map<std::string, ModelPackage> checkpoints;
  std::int64_t next_checkpoint = 1;
};

// What a streamed sample has decoded so far: written by the engine after each step, read by the response's
// producer, which waits on `changed`.
struct SampleStream {
  std::mutex mu;
  std::condition_variable changed;
  SampleResponse so_far;
  std::uint64_t version = 0;  // bumped by every update
  bool done = false;          // the operation is terminal (its state and result are final)
  void update(const SampleResponse& now) {
    {
      std::lock_guard lock(mu);
      so_far = now;
      ++version;
    }
    changed.notify_all();
  }
  void finish() {
    {
      std::lock_guard lock(mu);
      done = true;
    }
    changed.notify_all();
  }
};

// What an operation does to its session's state: its descriptor's flags (rlloop/operations.hpp).
inline wire::Effect effect_of(const wire::TrainingOperation& op) { return wire::effect<wire::Call::training>(op); }
inline wire::Effect effect_of(const wire::SamplingOperation& op) { return wire::effect<wire::Call::sampling>(op); }

struct OperationRecord {
  std::string id;
  bool sampling = false;
  // Listed in its session's operations (Get*OperationResult, retention, the journal's results); the OpenAI
  // endpoints' samples are not.
  bool retrievable = false;
  std::string digest;  // request_digest of seq + canonical operationConfig: what an idempotent retry must repeat
  // The request as received and parsed, while the operation is queued or running; released when it finishes (the
  // journal keeps what a restart has to run again).
  json body;
  std::variant<wire::TrainingOperation, wire::SamplingOperation> op;
  json state = state_body(wire::OperationStatus::pending);  // the Get*OperationResult body
  // Set when the operation ran: what it billed, and a sample's raw result (for the OpenAI endpoints).
  TokenUsage billed;
  std::shared_ptr<SampleResponse> sample_result;
  // Set for a streamed OpenAI sample: progress while it decodes.
  std::shared_ptr<SampleStream> stream;
  // Guarded by the session's mu: run once, without mu, by the thread that makes `state` terminal.
  std::vector<std::function<void()>> on_done;
};

// The answer to one request, given exactly once whichever thread decides it (the io thread that read the
// request, a session worker finishing an operation, a timer, Server::stop): the first answer wins, later ones do
// nothing. Copies share the answer.
class Reply {
 public:
  // Makes the response (an exception thrown by `make` becomes the error response), logs it and sends it.
  using Answer = std::function<void(const std::function<Response()>& make)>;
  Reply(Executor executor, Answer answer);
  // Answers with make()'s response, made on the executor (from any thread); false when already answered.
  bool post(std::function<Response()> make) const;
  // The same, made on the calling thread: for a handler answering before it returns.
  bool now(const std::function<Response()>& make) const;
  const Executor& executor() const { return state_->executor; }

 private:
  struct State {
    Executor executor;
    std::mutex mu;
    Answer answer;  // empty once answered, so a settled Reply holds nothing of its connection
  };
  Answer claim() const;
  std::shared_ptr<State> state_;
};

// A handler's result: the response, or nullopt when it kept its Reply to answer later.
using Handled = std::optional<Response>;

// What a session host needs from the server around it.
struct HostConfig {
  std::string region;
  std::string export_dir;               // where saveWeights with mergeWeights or rlloopPeftAdapter writes
  Journal* journal = nullptr;           // null = not durable
  bool bill_prompt_per_sample = false;  // Options::bill_prompt_per_sample
  Retention retention;                  // Options::retention
  std::size_t autosave_after_operations = 0;  // Options::autosave_after_operations
};

// What a restarted server knows of a session: what it reported, and for a live one how to rebuild its state before
// taking new work.
struct Recovery {
  std::string autosave;  // latest state saved after a completed optimizerStep ("" = none yet)
  std::vector<std::shared_ptr<OperationRecord>> replay;  // completed since then and changing state: run again, silently
  std::vector<std::shared_ptr<OperationRecord>> pending;  // accepted but not finished: run as new
  std::optional<std::string> sampler_path;                // from the last loadWeightsForSampling
  // Finished operations with their results, and client tokens, still retained: oldest first, with their times.
  std::vector<std::pair<std::shared_ptr<OperationRecord>, double>> finished;
  std::vector<std::tuple<std::string, ClientTokenRecord, double>> client_tokens;
  std::int64_t last_sequence_number = -1;
  std::int64_t next_operation = 1;
  TokenUsage usage;
  std::string error_details;
  double end_time = 0;
};

// One hosted session: its control-plane record, its operations, and a worker that runs them in order (consecutive
// samples side by side).
class SessionHost {
 public:
  // Starts a worker that creates the session (and, given a Recovery, rebuilds its state first). With any
  // initial_status but created (a restarted server's Stopped or Failed session) there is no worker: the record is
  // only describable and deletable.
  SessionHost(std::shared_ptr<TenantState> tenant, std::string name, std::string arn, SessionOptions options, json echo,
              const Backend& backend, HostConfig config, double creation_time = 0,
              std::optional<Recovery> recovery = {}, wire::SessionStatus initial_status = wire::SessionStatus::created);
  ~SessionHost();

  // Queues an accepted operation; the caller validated it and holds `mu`.
  void enqueue_locked(std::shared_ptr<OperationRecord> op);
  // Accepts a validated, retrievable operation: journals it (durable before its id is returned), lists it and its
  // client token, and queues it. The caller holds `mu`.
  void accept_locked(const std::shared_ptr<OperationRecord>& op, const std::optional<std::string>& token,
                     std::int64_t seq, double now);
  // A new operation id ("op-<tag>-<n>", operation_tag). The caller holds `mu`.
  std::string new_operation_id_locked();
  // The operation `id`: unfinished, or finished and its result retained at `now`; null otherwise. Holding `mu`.
  std::shared_ptr<OperationRecord> find_operation_locked(const std::string& id, double now) const;
  // Whether this session issued `id` (so when it is not found, its result expired). Holding `mu`.
  bool issued_locked(const std::string& id) const;
  // The operation `token` stands for, while retained at `now`. Holding `mu`.
  const ClientTokenRecord* find_client_token_locked(const std::string& token, double now) const;
  const Retention& retention() const { return config_.retention; }
  // Stopping -> Stopped; queued operations are Skipped. durable = a client asked (journaled); a server shutting
  // down is not durable, so its sessions come back on restart with their queued operations.
  void stop(bool durable = true);
  void join();
  // Blocks until the session left Created (it is Running, or creation failed).
  void wait_started();
  // Runs `f` once op is terminal, on the thread that makes it so and without mu held; f hands the answer on and
  // must not block. The caller holds mu and saw op not terminal.
  void on_done_locked(OperationRecord& op, std::function<void()> f);
  // Runs `f` once the session leaves Created (Running, Failed, or stopped while creating), as on_done_locked runs
  // its callbacks. The caller holds mu and saw the status Created.
  void on_started_locked(std::function<void()> f);
  // Writes a record about this session to the journal (when durable).
  void journal(json record);
  // Whether the session takes new operations (it is Running or Blocked). Holding `mu`.
  bool takes_operations_locked() const;
  // Throws the ConflictException (409) of a session that does not take new operations. Holding `mu`.
  void require_takes_operations_locked() const;

  const std::shared_ptr<TenantState> tenant;
  const std::string name;
  const std::string arn;
  const SessionOptions options;
  const json echo;  // create inputs echoed by Describe
  const double creation_time;

  std::mutex mu;  // guards everything below
  wire::SessionStatus status = wire::SessionStatus::created;
  double last_modified;
  double end_time = 0;
  std::string error_details;
  std::int64_t last_sequence_number = -1;
  TokenUsage usage;
  std::int64_t vocab_size = 0;
  SessionInfo info;  // of the live session, once Running
  std::shared_ptr<AnySession> session;

 private:
  // A sample operation started on the session, its response still to come.
  struct StartedSample {
    std::shared_ptr<OperationRecord> op;
    Future<SampleResponse> response;
  };
  // How often the worker looks at its started samples while they decode.
  static constexpr std::chrono::milliseconds kSamplePoll{2};

  // The worker: starts the session, runs its queue in order until it stops, then answers what is left.
  void run(Backend backend, std::optional<Recovery> recovery);
  // Creates the session (and recovers it); Running, or Failed with the returned error. Runs the callbacks waiting
  // for the start either way.
  std::string start(Backend& backend, const std::optional<Recovery>& recovery);
  // After a failed training operation: the training operations queued behind it, finished as skipped.
  void skip_queued_training();
  // Once the worker stops: every queued operation answered as stopped, the model freed, the session Stopped.
  void close_queue();
  void recover(const Recovery& r);
  // Runs a completed operation again, silently (recover): those whose descriptor says `replayed`.
  void replay(const wire::TrainingOperation& op);
  void rerun(const wire::ForwardBackwardOp& op);
  void rerun(const wire::LoadStateOp& op);
  json execute(OperationRecord& op);
  // Runs an operation's work and returns its state: `work`'s, or a failed one with the error's message. A
  // group_failure (the session's other ranks are gone) also makes the session Blocked.
  json guarded(const std::function<json()>& work);
  // Sample operations (SampleRequest; execute runs every other kind): started (the session call), then, once the
  // response is in, billed and recorded (op.sample_result) and made the operation's state.
  static bool is_sample(const OperationRecord& op);
  Future<SampleResponse> start_sample(OperationRecord& op);
  json sample_state(OperationRecord& op, SampleResponse r);
  // Starts `op` beside the samples already started (or finishes it failed, when it cannot start).
  void start_beside(std::vector<StartedSample>& started, const std::shared_ptr<OperationRecord>& op);
  // Finishes the started samples whose responses are in (all of them, waiting, with `wait`).
  void finish_samples(std::vector<StartedSample>& started, bool wait);
  void finish(const std::shared_ptr<OperationRecord>& op, json state, const std::string& autosave);
  bool needs_autosave(const OperationRecord& op);
  // Sets a terminal state at `now` with mu held (a retrievable op moves to finished_); returns op's on_done
  // callbacks, for the caller to run once mu is released.
  std::vector<std::function<void()>> settle_locked(const std::shared_ptr<OperationRecord>& op, json state, double now);
  void restore(Recovery& r);
  std::string resolve_checkpoint(const std::string& arn);
  std::string add_checkpoint(const std::string& path, bool is_checkpoint);
  void bill(OperationRecord& op, const TokenUsage& u);

  HostConfig config_;
  // Guarded by mu: the retrievable operations, queued or running by id, and finished while retained; client tokens.
  std::map<std::string, std::shared_ptr<OperationRecord>> unfinished_;
  RetainedMap<std::shared_ptr<OperationRecord>> finished_;
  RetainedMap<ClientTokenRecord> client_tokens_;
  std::int64_t next_operation_ = 1;  // n of the next id
  std::condition_variable cv_;
  std::condition_variable done_cv_;
  std::deque<std::shared_ptr<OperationRecord>> queue_;
  std::vector<std::function<void()>> on_started_;  // on_started_locked's, run once the session leaves Created
  bool stopping_ = false;
  std::optional<std::string> sampler_path_;  // set by loadWeightsForSampling
  std::function<Future<CheckpointRef>(const std::string&)> export_merged_;
  std::function<Future<CheckpointRef>(const std::string&)> export_peft_;
  std::function<Future<SampleResponse>(const SampleRequest&, HostedSession::SampleProgress)> sample_streaming_;
  std::string autosave_;  // the latest autosave (removed when the next one is journaled)
  // Completed forwardBackward / loadState operations since it: what a restart would run again.
  std::size_t replayable_since_autosave_ = 0;
  std::thread worker_;
};

struct TinkerRoutes;

struct Api::Impl {
  Options options;
  Backend backend;
  std::map<std::string, std::shared_ptr<TenantState>> tenants;                             // by id
  std::map<std::string, std::pair<std::shared_ptr<TenantState>, std::string>> sigv4_keys;  // akid -> tenant, secret
  std::map<std::string, std::shared_ptr<TenantState>> bearer_keys;
  std::mutex mu;                                                                         // guards sessions
  std::map<std::pair<std::string, std::string>, std::shared_ptr<SessionHost>> sessions;  // (tenant, name)
  std::atomic<std::uint64_t> next_request{1};
  std::atomic<std::uint64_t> next_operation{1};
  std::unique_ptr<Journal> journal;  // when options.data_dir is set

  // Long-polls waiting now, for interrupt_waits: each one's wake-up, kept while its token (its timer) lives.
  std::mutex polls_mu;
  bool closing = false;  // set by Api::interrupt_waits: long-polls answer at once (guarded by polls_mu)
  std::vector<std::pair<std::weak_ptr<void>, std::function<void()>>> polls;
  // Registers a long-poll's wake-up; false when the server is closing (the poll answers at once instead).
  bool add_poll(std::weak_ptr<void> token, std::function<void()> wake);

  HostConfig host_config();
  // Rebuilds tenants' checkpoints and billing and every session from the journal; waits until the live ones run.
  void recover();

  std::shared_ptr<TenantState> authenticate(const sigv4::HttpRequest& req, const std::string& path);
  std::shared_ptr<SessionHost> find_session(const TenantState& t, const std::string& name);
  json control_plane(const std::string& target, const json& body, const std::shared_ptr<TenantState>& t);
  // control_plane's CreateTrainingSession and ListTrainingSessions.
  json create_training_session(const json& body, const std::shared_ptr<TenantState>& t);
  // Hosts a new session `name` of tenant t (its session limit, the journal's record) and starts creating it; the
  // Tinker routes' create_model too. Throws api_error.
  std::shared_ptr<SessionHost> host_session(const std::shared_ptr<TenantState>& t, const std::string& name,
                                            const std::string& arn, const SessionOptions& options, const json& echo);
  json list_training_sessions(const json& body, const TenantState& t);
  // A control-plane call's response. DescribeTrainingSession of a session still Creating waits, as a
  // Get*OperationResult without ?waitSeconds= does, up to Options::default_result_wait for it to leave Creating,
  // answering through `reply` (nullopt): clients that poll on a fixed interval after a first immediate call (the
  // SageMaker Python SDK: 10 s) learn at once of a session that takes a second to load its model.
  Handled control_plane_call(const std::string& target, const json& body, const std::shared_ptr<TenantState>& t,
                             const Reply& reply);
  json model_registry(const std::string& op, const json& body, TenantState& t);
  Handled runtime(const sigv4::HttpRequest& req, const std::string& path, const std::shared_ptr<TenantState>& t,
                  const Reply& reply);
  // runtime's routes on one session: its info and usage, an operation's state (a long poll with ?waitSeconds=),
  // a new training or sampling operation.
  Handled session_info(SessionHost& s);
  Handled get_operation(const sigv4::HttpRequest& req, const std::shared_ptr<SessionHost>& s, const std::string& id,
                        bool sampling, const Reply& reply);
  Handled submit_operation(const sigv4::HttpRequest& req, const std::shared_ptr<TenantState>& t, SessionHost& s,
                           bool training);
  // Accepts a parsed operation into session s: the tenant owns the model package it names, it is valid for the
  // session, a training one's sequence number exceeds the last; journaled and queued; returns its id (an
  // idempotent retry of `token`'s, the id it got then). Throws api_error (`token_field` names the token in errors).
  std::string accept_operation(const std::shared_ptr<TenantState>& t, SessionHost& s,
                               const std::shared_ptr<OperationRecord>& op, const std::optional<std::string>& token,
                               const std::string& token_field, std::int64_t seq);
  json usage_report(const std::shared_ptr<TenantState>& t);
  // Tinker's protocol under /api/v1/ (tinker.cpp): its sessions, models, samplers and futures over the sessions
  // above. Created with the Api; shared_ptr so that this header need not define it.
  std::shared_ptr<TinkerRoutes> tinker;
  Handled tinker_api(const sigv4::HttpRequest& req, const std::string& path, const std::shared_ptr<TenantState>& t,
                     const Reply& reply);
  // The thread that finishes Tinker sessions whose heartbeats stopped: started with the Api, stopped (joined) by
  // Api::shutdown, which may call it twice.
  void start_tinker_reaper();
  void stop_tinker_reaper();
  // Ids of the OpenAI endpoints' samples (never listed; a session's listed operations use its own ids).
  std::string new_operation_id();
  // OpenAI-compatible sampling (openai.cpp): /v1/models, /v1/chat/completions, /v1/completions and the
  // SageMaker pass-through /training-sessions/{name}/sample[-with-response-stream].
  Handled openai(const sigv4::HttpRequest& req, const std::string& path, const std::shared_ptr<TenantState>& t,
                 const Reply& reply);
  // Queues a sampling operation outside the operation API (the OpenAI endpoints); once it completed, `reply`
  // answers with then(op), made on the reply's executor.
  void sample_now(const std::shared_ptr<SessionHost>& s, SampleRequest request, const Reply& reply,
                  std::function<Response(const OperationRecord&)> then);
  // The same for a streamed response: `reply` answers at once with a stream whose producer, stream(op), follows
  // the operation's progress (op->stream) until it is terminal.
  void stream_now(const std::shared_ptr<SessionHost>& s, SampleRequest request, const Reply& reply,
                  std::function<Response(const std::shared_ptr<OperationRecord>&)> stream);
};

// Whether an operation state is final (not Pending or InProgress).
inline bool terminal_state(const json& state) { return wire::is_terminal(status_of(state)); }

// Whether a path is served by openai(); and whether it is one of OpenAI's own (/v1/...), whose clients read
// OpenAI's error shape and status codes rather than AWS's.
bool is_openai_path(const std::string& path);
bool is_openai_client_path(const std::string& path);
// Whether a path is one of Tinker's (/api/v1/...): authenticated by X-API-Key, errors as {"error", "category"}.
bool is_tinker_path(const std::string& path);

// The `error` object of OpenAI's error responses ({message, type, param, code}) for `e`.
json openai_error_body(const api_error& e);

}  // namespace rlloop::server
