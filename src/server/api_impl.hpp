// Internal state of the Api: tenants, hosted sessions and their operations. Not installed.
#pragma once
#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <variant>

#include <nlohmann/json.hpp>

#include <rlloop/json.hpp>

#include "server/server.hpp"

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

// Per tenant: its configuration, its billing total and the checkpoints it owns (model-package ARN -> path).
struct TenantState {
  Tenant config;
  std::mutex mu;
  TokenUsage usage;
  std::map<std::string, std::string> checkpoints;
  std::int64_t next_checkpoint = 1;
};

struct OperationRecord {
  std::string id;
  bool sampling = false;
  std::string fingerprint;  // seq + canonical operationConfig: what an idempotent retry must repeat
  std::variant<wire::TrainingOperation, wire::SamplingOperation> op;
  json state = {{"status", "Pending"}};  // the Get*OperationResult body
};

// One hosted session: its control-plane record, its operations, and a worker that runs them in order.
class SessionHost {
 public:
  SessionHost(std::shared_ptr<TenantState> tenant, std::string name, std::string arn, SessionOptions options, json echo,
              const Backend& backend, std::string region);
  ~SessionHost();

  // Queues an accepted operation; the caller validated it and holds `mu`.
  void enqueue_locked(std::shared_ptr<OperationRecord> op);
  void stop();  // Stopping -> Stopped; queued operations are Skipped
  void join();

  const std::shared_ptr<TenantState> tenant;
  const std::string name;
  const std::string arn;
  const SessionOptions options;
  const json echo;  // create inputs echoed by Describe
  const double creation_time;

  std::mutex mu;  // guards everything below
  std::string status = "Created";
  double last_modified;
  double end_time = 0;
  std::string error_details;
  std::int64_t last_sequence_number = -1;
  std::map<std::string, std::shared_ptr<OperationRecord>> ops;
  std::map<std::string, std::string> client_tokens;  // token -> operation id
  TokenUsage usage;
  std::int64_t vocab_size = 0;
  std::shared_ptr<AnySession> session;

 private:
  void run(Backend backend);
  json execute(OperationRecord& op);
  std::string resolve_checkpoint(const std::string& arn);
  std::string add_checkpoint(const std::string& path);
  void bill(const TokenUsage& u);

  std::string region_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<OperationRecord>> queue_;
  bool stopping_ = false;
  std::optional<std::string> sampler_path_;  // set by loadWeightsForSampling
  std::thread worker_;
};

struct Api::Impl {
  Options options;
  Backend backend;
  std::map<std::string, std::shared_ptr<TenantState>> tenants;                       // by id
  std::map<std::string, std::pair<std::shared_ptr<TenantState>, std::string>> sigv4_keys;  // akid -> tenant, secret
  std::map<std::string, std::shared_ptr<TenantState>> bearer_keys;
  std::mutex mu;  // guards sessions
  std::map<std::pair<std::string, std::string>, std::shared_ptr<SessionHost>> sessions;  // (tenant, name)
  std::atomic<std::uint64_t> next_request{1};
  std::atomic<std::uint64_t> next_operation{1};

  std::shared_ptr<TenantState> authenticate(const sigv4::HttpRequest& req);
  std::shared_ptr<SessionHost> find_session(const TenantState& t, const std::string& name);
  json control_plane(const std::string& target, const json& body, const std::shared_ptr<TenantState>& t);
  Response runtime(const sigv4::HttpRequest& req, const std::string& path, const std::shared_ptr<TenantState>& t);
  json usage_report(const std::shared_ptr<TenantState>& t);
  std::string new_operation_id();
};

}  // namespace rlloop::server
