// rlloop-server: serves the training-session API (spec/training-session-api.md) for many tenants, hosting the
// sessions of any Service through a type-erased Backend. Api is the protocol (request in, response out, no
// sockets); Server puts it on an HTTP/1.1 keep-alive listener.
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <rlloop/session.hpp>

#include "sigv4/sigv4.hpp"

namespace rlloop::server {

// One customer: SigV4 access keys and/or bearer keys, and its limits.
struct Tenant {
  std::string id;
  std::string account_id = "000000000000";                       // 12 digits, used in the ARNs the tenant sees
  std::vector<std::pair<std::string, std::string>> access_keys;  // access key id -> secret
  std::vector<std::string> bearer_keys;
  std::size_t max_sessions = 8;                   // sessions not yet deleted
  std::size_t max_body_bytes = 64 * 1024 * 1024;  // larger requests get 413
};

// Reads a tenants file: {"tenants": [{"id", "accountId", "accessKeys": [{"accessKeyId", "secretAccessKey"}],
// "bearerKeys": [...], "maxSessions", "maxBodyBytes"}]}. Throws io_error / invalid_argument naming the field.
std::vector<Tenant> load_tenants(const std::string& path);
std::vector<Tenant> parse_tenants(const std::string& json_text, const std::string& source = "tenants");

// A session as the server holds it: the type-erased Session plus what only some Services offer (LocalSession's
// merged-weights export, used by saveWeights with mergeWeights). An empty function = not offered.
struct HostedSession {
  std::shared_ptr<AnySession> session;
  std::function<Future<CheckpointRef>(const std::string& dir)> export_merged_model;
};

// The sessions a server hosts, whatever Service makes them.
struct Backend {
  std::function<HostedSession(const SessionOptions&)> create_session;
  std::function<std::vector<std::string>()> list_base_models;
  std::function<ServerCapabilities()> capabilities;
};

template <Service Svc>
Backend make_backend(std::shared_ptr<Svc> svc) {
  auto create = [svc](const SessionOptions& o) {
    auto s = svc->create_session(o);
    HostedSession h{std::make_shared<AnySession>(s), {}};
    if constexpr (requires(const std::string& d) { s->export_merged_model(d); })
      h.export_merged_model = [s](const std::string& dir) { return s->export_merged_model(dir); };
    return h;
  };
  return Backend{std::move(create), [svc] { return svc->list_base_models(); }, [svc] { return svc->capabilities(); }};
}

struct Options {
  std::string host = "127.0.0.1";
  std::uint16_t port = 0;  // 0 = any free port (see Server::port())
  // Durable records (sessions, operations and their results, client tokens, billing, checkpoint ARNs) and the
  // per-session autosaves live here; a server restarted on the same directory brings its sessions back.
  // Empty = nothing is persisted.
  std::string data_dir;
  std::vector<Tenant> tenants;
  std::string region = "us-east-1";
  std::chrono::seconds max_clock_skew{15 * 60};
  // How long a Get*OperationResult without rlloop's ?waitSeconds= waits for the operation to finish before it
  // answers with the current state. 0 (the default) answers at once, as AWS does; clients that poll on a fixed
  // interval after a first immediate poll (the SageMaker Python SDK: 2 s) learn of short operations sooner with
  // a few hundred milliseconds here.
  std::chrono::milliseconds default_result_wait{0};
  // Prefill billing of a sample call with numSamples = n (the spec leaves it open: §6, item 4): false = the prompt
  // once, as LocalSession bills it (one prefill, shared KV cache) and as OpenAI's usage.prompt_tokens counts it for n >
  // 1; true = n times (each sequence's tokenUsage.prefill, summed).
  bool bill_prompt_per_sample = false;
  // One JSON object per line; defaults to stderr.
  std::function<void(const std::string&)> log;
};

// Sends one piece of a streamed body; false once the client has gone away.
using StreamWriter = std::function<bool(std::string_view)>;

struct Response {
  unsigned status = 200;
  std::string content_type = "application/json";
  std::vector<std::pair<std::string, std::string>> headers;
  std::string body;
  // When set, the body is produced piece by piece (chunked transfer; server-sent events) instead of `body`.
  std::function<void(const StreamWriter&)> stream;
};

// The protocol: routes, authenticates, validates, runs. Thread-safe.
class Api {
 public:
  Api(Options options, Backend backend);
  ~Api();
  Api(const Api&) = delete;
  Api& operator=(const Api&) = delete;

  Response handle(const sigv4::HttpRequest& request);
  // Largest body any tenant may send (the HTTP layer's parser limit).
  std::size_t max_body_bytes() const;
  // Stops every session worker (pending operations become Skipped).
  void shutdown();
  // Long-polls (Get*OperationResult?waitSeconds=N) answer at once, now and from now on: Server::stop calls it
  // before it waits for its connection threads.
  void interrupt_waits();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// HTTP/1.1 with keep-alive on top of Api; one thread per connection.
class Server {
 public:
  Server(Options options, Backend backend);
  ~Server();
  void start();  // binds and starts accepting; returns at once
  void stop();   // closes the listener and every connection, waits for their threads
  std::uint16_t port() const;
  Api& api();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace rlloop::server
