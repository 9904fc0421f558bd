// Request entry point: request ids, routing (X-Amz-Target -> control plane, else runtime REST), authentication,
// per-tenant body limits, error mapping (docs/wire.md) and one JSON log line per request, written when it is answered.
#include <chrono>
#include <cstdio>
#include <utility>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>

#include "server/api_impl.hpp"
#include "server/journal.hpp"
#include "server/tinker.hpp"

namespace rlloop::server {

namespace {
std::string bearer_of(const std::string& auth) {
  constexpr std::string_view prefix = "Bearer ";
  return auth.rfind(prefix, 0) == 0 ? auth.substr(prefix.size()) : "";
}

// The runtime model's exception for an OpenAI error code (the others pass through unchanged).
std::string runtime_error_code(const std::string& code) {
  if (code == "invalid_request_error") return "ValidationException";
  if (code == "model_not_found") return "ResourceNotFoundException";
  return code;
}

// What the log line and the error shapes need of a request, kept until it is answered.
struct RequestContext {
  std::string id;
  std::chrono::steady_clock::time_point started;
  std::string method;
  std::string path;
  std::optional<std::string> amz_target;
  std::string tenant_id;  // once authenticated
};

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

// The error response for `failure` in the request's shapes (docs/wire.md); sets error_type.
Response error_response(const std::exception_ptr& failure, const RequestContext& c, std::string& error_type) {
  Response res;
  try {
    std::rethrow_exception(failure);
  } catch (const api_error& e) {
    error_type = e.code();
    res.status = e.status();
    // Control plane (JSON 1.1): {"__type", "Message"}; runtime (REST-JSON): X-Amzn-ErrorType + {"message"}.
    if (c.amz_target) {
      res.content_type = "application/x-amz-json-1.1";
      res.body = dump({{"__type", e.code()}, {"Message", e.what()}});
    } else if (is_tinker_path(c.path)) {
      // The tinker SDK puts the body in its exception's message; never empty (an empty 400 reads as a proxy's).
      res.content_type = "application/json";
      res.body = dump({{"error", e.what()}, {"category", e.status() < 500 ? "user" : "server"}});
    } else if (is_openai_client_path(c.path)) {
      // OpenAI clients read {"error": {...}}; "message" stays for AWS-style clients.
      res.content_type = "application/json";
      res.body = dump({{"error", openai_error_body(e)}, {"message", e.what()}});
    } else {
      // The runtime model's exceptions: SampleTrainingSession shares the OpenAI request parser, whose codes
      // botocore would not map to the modelled exception classes.
      error_type = runtime_error_code(e.code());
      res.content_type = "application/json";
      res.body = dump({{"message", e.what()}});
    }
  } catch (const std::exception& e) {
    error_type = "InternalServerException";
    res.status = 500;
    const std::string message = std::string("internal error: ") + e.what();
    // The same shapes as above: a control-plane client reads __type / Message.
    if (c.amz_target) {
      res.content_type = "application/x-amz-json-1.1";
      res.body = dump({{"__type", error_type}, {"Message", message}});
    } else {
      res.content_type = "application/json";
      res.body = dump({{"message", message}});
    }
  }
  res.headers.emplace_back("X-Amzn-ErrorType", error_type);
  return res;
}

// The request's response, or nullopt when a handler kept `reply` to answer later. Throws for an error answer.
Handled route(Api::Impl& im, const sigv4::HttpRequest& req, RequestContext& c, const Reply& reply) {
  if (req.method == "GET" && c.path == "/health")
    return Response{200, "application/json", {}, json{{"status", "ok"}}.dump()};
  // A signed URL of Tinker's external weights: its token is the credential (tinker_downloads.hpp).
  if (req.method == "GET" && ExternalDownloads::is_download(c.path))
    return im.tinker->downloads.serve(c.path, now_seconds());
  auto tenant = im.authenticate(req, c.path);
  c.tenant_id = tenant->config.id;
  if (req.body.size() > tenant->config.max_body_bytes)
    throw api_error("RequestEntityTooLarge", 413,
                    "request body of " + std::to_string(req.body.size()) + " bytes exceeds this tenant's limit of " +
                        std::to_string(tenant->config.max_body_bytes));
  if (is_tinker_path(c.path)) return im.tinker_api(req, c.path, tenant, reply);
  if (!c.amz_target) return im.runtime(req, c.path, tenant, reply);
  if (req.method != "POST" || c.path != "/")
    throw api_error("UnknownOperationException", 400, "control-plane calls are POST /");
  json body;
  try {
    body = req.body.empty() ? json::object() : json::parse(req.body);
  } catch (const json::exception& e) {  // parse_error, or out_of_range for a number like 1e999
    throw api_error("SerializationException", 400, std::string("request body is not valid JSON: ") + e.what());
  }
  return im.control_plane_call(*c.amz_target, body, tenant, reply);
}

void check_retention(const Retention& r) {
  if (r.result_age.count() < 0) throw invalid_argument("Options::retention.result_age must not be negative");
  if (r.client_token_age.count() < 0)
    throw invalid_argument("Options::retention.client_token_age must not be negative");
}
}  // namespace

Reply::Reply(Executor executor, Answer answer) : state_(std::make_shared<State>()) {
  state_->executor = std::move(executor);
  state_->answer = std::move(answer);
}

Reply::Answer Reply::claim() const {
  std::lock_guard lock(state_->mu);
  return std::exchange(state_->answer, {});
}

bool Reply::post(std::function<Response()> make) const {
  // Only the thread that claimed the answer posts to the executor; the others never touch it. So the executor's
  // io_context need only outlive the answer it runs, not the Reply (a stale wake-up on a running operation keeps one).
  Answer answer = claim();
  if (!answer) return false;
  boost::asio::post(state_->executor, [answer = std::move(answer), make = std::move(make)] { answer(make); });
  return true;
}

bool Reply::now(const std::function<Response()>& make) const {
  Answer answer = claim();
  if (!answer) return false;
  answer(make);
  return true;
}

Api::Api(Options options, Backend backend) : impl_(std::make_unique<Impl>()) {
  check_retention(options.retention);
  impl_->options = std::move(options);
  impl_->backend = std::move(backend);
  impl_->tinker = std::make_shared<TinkerRoutes>();
  if (!impl_->options.log)
    impl_->options.log = [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); };
  for (const Tenant& t : impl_->options.tenants) {
    auto state = std::make_shared<TenantState>();
    state->config = t;
    impl_->tenants[t.id] = state;
    for (const auto& [akid, secret] : t.access_keys) impl_->sigv4_keys[akid] = {state, secret};
    for (const auto& key : t.bearer_keys) impl_->bearer_keys[key] = state;
  }
  if (!impl_->options.data_dir.empty()) {
    JournalOptions journal;
    journal.retention = impl_->options.retention;
    journal.compact_records = impl_->options.compact_after_records;
    journal.compact_bytes = impl_->options.compact_after_bytes;
    journal.log = impl_->options.log;
    impl_->journal = std::make_unique<Journal>(impl_->options.data_dir, std::move(journal));
    impl_->tinker->journal = impl_->journal.get();
    impl_->tinker->report = [log = impl_->options.log](const std::string& message) {
      log(json{{"ts", now_seconds()}, {"level", "error"}, {"event", "journal"}, {"message", message}}.dump());
    };
    impl_->recover();
  }
  impl_->start_tinker_reaper();  // last: a constructor that threw above leaves no thread behind
}

HostConfig Api::Impl::host_config() {
  const std::string exports = options.data_dir.empty() ? "rlloop-exports" : options.data_dir + "/exports";
  return HostConfig{.region = options.region,
                    .export_dir = exports,
                    .journal = journal.get(),
                    .bill_prompt_per_sample = options.bill_prompt_per_sample,
                    .retention = options.retention,
                    .autosave_after_operations = options.autosave_after_operations};
}

Api::~Api() { shutdown(); }

void Api::shutdown() {
  impl_->stop_tinker_reaper();
  std::map<std::pair<std::string, std::string>, std::shared_ptr<SessionHost>> all;
  {
    std::lock_guard lock(impl_->mu);
    all = impl_->sessions;
  }
  for (auto& [k, s] : all) s->stop(/*durable=*/false);
  for (auto& [k, s] : all) s->join();
}

void Api::interrupt_waits() {
  std::vector<std::function<void()>> wake;
  {
    std::lock_guard lock(impl_->polls_mu);
    impl_->closing = true;
    for (auto& [token, f] : impl_->polls)
      if (!token.expired()) wake.push_back(std::move(f));
    impl_->polls.clear();
  }
  for (auto& f : wake) f();
}

bool Api::Impl::add_poll(std::weak_ptr<void> token, std::function<void()> wake) {
  std::lock_guard lock(polls_mu);
  if (closing) return false;
  // Polls that answered leave an expired token; dropping them as the list doubles keeps it as short as the live
  // ones at amortised O(1) per poll.
  if (polls.size() >= 64 && polls.size() == polls.capacity())
    std::erase_if(polls, [](const auto& p) { return p.first.expired(); });
  polls.emplace_back(std::move(token), std::move(wake));
  return true;
}

std::size_t Api::max_body_bytes() const {
  std::size_t m = 1024 * 1024;
  for (const auto& [id, t] : impl_->tenants) m = std::max(m, t->config.max_body_bytes);
  return m;
}

std::shared_ptr<TenantState> Api::Impl::authenticate(const sigv4::HttpRequest& req, const std::string& path) {
  if (is_tinker_path(path)) {  // Tinker's X-API-Key: one of the tenant's bearer keys
    const auto key = req.header("X-API-Key");
    const auto it = key ? bearer_keys.find(*key) : bearer_keys.end();
    if (it == bearer_keys.end()) throw api_error("Unauthorized", 401, "X-API-Key is missing or not valid");
    return it->second;
  }
  const auto auth = req.header("Authorization");
  if (auth) {
    const std::string key = bearer_of(*auth);
    if (!key.empty()) {
      auto it = bearer_keys.find(key);
      // Same answer for every bad key, so keys cannot be probed. OpenAI answers an unknown key with 401
      // invalid_api_key (its clients raise AuthenticationError); AWS's runtime with 403.
      if (it == bearer_keys.end()) {
        if (is_openai_client_path(path))
          throw api_error("invalid_api_key", 401, "Incorrect API key provided");
        throw api_error("UnrecognizedClientException", 403, "The bearer key is not valid");
      }
      return it->second;
    }
  }
  std::shared_ptr<TenantState> tenant;
  sigv4::VerifyOptions opts;
  opts.max_skew = options.max_clock_skew;
  try {
    const auto id = sigv4::verify(
        req,
        [&](const std::string& akid) -> std::optional<std::string> {
          auto it = sigv4_keys.find(akid);
          if (it == sigv4_keys.end()) return std::nullopt;
          tenant = it->second.first;
          return it->second.second;
        },
        sigv4::clock::now(), opts);
    (void)id;
  } catch (const sigv4::auth_error& e) {
    throw api_error(e.code(), static_cast<unsigned>(e.http_status()),
                    std::string(e.what()).substr(e.code().size() + 2));
  }
  return tenant;
}

void Api::handle_async(const sigv4::HttpRequest& req, Executor executor, std::function<void(Response)> done) {
  Impl& im = *impl_;
  auto c = std::make_shared<RequestContext>();
  c->id = "req-" + std::to_string(im.next_request++);
  c->started = std::chrono::steady_clock::now();
  c->method = req.method;
  c->path = req.target.substr(0, req.target.find('?'));
  c->amz_target = req.header("X-Amz-Target");
  Reply reply(std::move(executor), [&im, c, done = std::move(done)](const std::function<Response()>& make) {
    Response res;
    std::string error_type;
    try {
      res = make();
    } catch (...) {
      res = error_response(std::current_exception(), *c, error_type);
    }
    res.headers.emplace_back("x-amzn-RequestId", c->id);
    json line{{"ts", now_seconds()},
              {"level", res.status >= 500   ? "error"
                        : res.status >= 400 ? "warn"
                                            : "info"},
              {"requestId", c->id},
              {"method", c->method},
              {"path", c->path},
              {"status", res.status},
              {"durationMs",
               std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - c->started).count()}};
    if (c->amz_target) line["target"] = *c->amz_target;
    if (!c->tenant_id.empty()) line["tenant"] = c->tenant_id;
    if (!error_type.empty()) line["errorType"] = error_type;
    im.options.log(dump(line));
    done(std::move(res));
  });
  Handled handled;
  std::exception_ptr failure;
  try {
    handled = route(im, req, *c, reply);
  } catch (...) {
    failure = std::current_exception();
  }
  if (failure)
    reply.now([&]() -> Response { std::rethrow_exception(failure); });
  else if (handled)
    reply.now([&] { return std::move(*handled); });
}

Response Api::handle(const sigv4::HttpRequest& req) {
  boost::asio::io_context io;
  auto work = boost::asio::make_work_guard(io);  // a long-poll or a sample answers from a worker's post
  std::optional<Response> out;
  handle_async(req, io.get_executor(), [&](Response r) {
    out = std::move(r);
    work.reset();
  });
  io.run();
  return std::move(*out);
}

}  // namespace rlloop::server
