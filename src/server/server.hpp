// rlloop-server: serves the training-session API (docs/wire.md) for many tenants, hosting the
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

#include <boost/asio/any_io_executor.hpp>

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
// exports: the merged weights, used by saveWeights with mergeWeights, and the PEFT adapter, with rlloop's
// rlloopPeftAdapter, Tinker's save_weights_external). An empty function = not offered.
struct HostedSession {
  std::shared_ptr<AnySession> session;
  std::function<Future<CheckpointRef>(const std::string& dir)> export_merged_model;
  std::function<Future<CheckpointRef>(const std::string& dir)> export_peft_adapter;
  // sample() that reports every decoding step (streamed OpenAI responses); absent where the session cannot.
  using SampleProgress = std::function<void(const SampleResponse& so_far)>;
  std::function<Future<SampleResponse>(const SampleRequest&, SampleProgress)> sample_streaming;
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
    HostedSession h{std::make_shared<AnySession>(s), {}, {}};
    if constexpr (requires(const std::string& d) { s->export_merged_model(d); })
      h.export_merged_model = [s](const std::string& dir) { return s->export_merged_model(dir); };
    if constexpr (requires(const std::string& d) { s->export_peft_adapter(d); })
      h.export_peft_adapter = [s](const std::string& dir) { return s->export_peft_adapter(dir); };
    if constexpr (requires(const SampleRequest& r, HostedSession::SampleProgress p) { s->sample(r, p); })
      h.sample_streaming = [s](const SampleRequest& r, HostedSession::SampleProgress p) {
        return s->sample(r, std::move(p));
      };
    return h;
  };
  return Backend{std::move(create), [svc] { return svc->list_base_models(); }, [svc] { return svc->capabilities(); }};
}

// How long a session keeps what it reported (docs/wire.md, "Retention"): the result of a finished operation, and
// the operation a client token (clientToken, Idempotency-Key) stands for. An entry goes at the first of its count
// and its age limit, from memory and from the journal; an unfinished (queued or running) operation never goes.
struct Retention {
  std::size_t results = 1000;                        // the most recent finished operations of a session
  std::chrono::seconds result_age{24 * 3600};        // since the operation finished
  std::size_t client_tokens = 1000;                  // the most recent tokens of a session: retries come soon after
  std::chrono::seconds client_token_age{24 * 3600};  // since the token's operation was accepted
};

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
  // answers with the current state, and a DescribeTrainingSession of a session still Creating for it to leave
  // Creating. 0 (the default) answers at once, as AWS does; clients that poll on a fixed interval after a first
  // immediate poll (the SageMaker Python SDK: 2 s for operations, 10 s for a session's status) learn of short
  // operations and quick session starts sooner with a few hundred milliseconds here.
  std::chrono::milliseconds default_result_wait{0};
  // Tinker's sessions (/api/v1/): one that sent no heartbeat (the SDK sends one every 10 s) for this long is
  // finished, its models stopped and their memory freed; their checkpoints stay. The SDK itself warns after 120 s
  // without a successful heartbeat that its session will be ended.
  std::chrono::seconds tinker_session_timeout{120};
  // Prefill billing of a sample call with numSamples = n (the API leaves it open): false = the prompt
  // once, as LocalSession bills it (one prefill, shared KV cache) and as OpenAI's usage.prompt_tokens counts it for n >
  // 1; true = n times (each sequence's tokenUsage.prefill, summed).
  bool bill_prompt_per_sample = false;
  Retention retention;
  // The journal is compacted (rewritten as a snapshot of the live state, its log restarted) once the log since the
  // last snapshot holds this many records, or this many bytes and at least the snapshot's size; 0 turns a bound
  // off. Restart time follows the live state and these bounds, not the server's history.
  std::size_t compact_after_records = 10'000;
  std::size_t compact_after_bytes = 1u << 20;
  // A session's state (trainable weights, optimizer moments, and the gradients accumulated since its last
  // optimizerStep) is autosaved after every optimizerStep and once this many forwardBackward / loadState
  // operations completed since its last autosave, so that a restart runs at most this many minus one of them
  // again (docs/server.md, "Crash recovery"); 0 autosaves at optimizerSteps only. Each autosave writes the
  // trainable state once: a LoRA session's adapters and moments are small, a full fine-tuning session's are 3x its
  // weights, and may want a larger interval.
  std::size_t autosave_after_operations = 16;
  // One JSON object per line; defaults to stderr.
  std::function<void(const std::string&)> log;

  // The HTTP layer (Server). Sockets are served asynchronously by a fixed pool of threads, so an idle or slow
  // client costs a socket and a few KiB, never a thread. Checked by Server's constructor.
  std::size_t io_threads = 2;  // run every connection's reads and writes
  // Run the producers of streamed (server-sent events) bodies, which block while a slow reader's buffer is full.
  std::size_t stream_threads = 2;
  // Concurrent connections. One more is accepted, answered 503 with X-Amzn-ErrorType ServiceUnavailableException,
  // Retry-After: 1 and {"message"}, and closed: the server as a whole is full, which a client retries as it does any
  // 503; a 429 ThrottlingException would blame the caller's request rate instead.
  std::size_t max_connections = 1024;
  std::chrono::milliseconds idle_timeout{60'000};    // a connection waiting for its first or next request
  std::chrono::milliseconds header_timeout{10'000};  // from a request's first byte to the end of its headers
  std::chrono::milliseconds body_timeout{60'000};    // to receive a request's body, once its headers are in
  std::chrono::milliseconds write_timeout{60'000};   // for the client to take each write of a response
};

// Where an asynchronous request continues and answers: the connection's strand (Server), or a private
// io_context (Api::handle).
using Executor = boost::asio::any_io_executor;

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

  // Answers `request` by calling `done` exactly once, on `executor` or before this returns, and never blocks on
  // a session: most requests answer at once; a long-poll (?waitSeconds=) answers when its operation is terminal
  // or at its deadline (a timer on `executor`), an OpenAI / pass-through sample when its operation is done. A
  // streamed Response's producer may block on its writer: run it where blocking is fine (Server: stream_threads).
  void handle_async(const sigv4::HttpRequest& request, Executor executor, std::function<void(Response)> done);
  // The same, waiting for the answer on the calling thread.
  Response handle(const sigv4::HttpRequest& request);
  // Largest body any tenant may send (the HTTP layer's parser limit).
  std::size_t max_body_bytes() const;
  // Stops every session worker (pending operations become Skipped).
  void shutdown();
  // Long-polls (Get*OperationResult?waitSeconds=N) answer at once, now and from now on: Server::stop calls it
  // before it closes its connections.
  void interrupt_waits();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// HTTP/1.1 with keep-alive on top of Api, on Asio's asynchronous I/O: Options::io_threads threads serve every
// connection, with a connection cap and idle / header / body / write timeouts.
class Server {
 public:
  Server(Options options, Backend backend);  // throws invalid_argument naming a bad Options field
  ~Server();
  void start();  // binds and starts accepting; returns at once
  void stop();   // closes the listener and every connection, stops the sessions, joins the server's threads
  std::uint16_t port() const;
  Api& api();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace rlloop::server
