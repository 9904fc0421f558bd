// Request entry point: request ids, routing (X-Amz-Target -> control plane, else runtime REST), authentication,
// per-tenant body limits, error mapping (spec §4) and one JSON log line per request.
#include <chrono>
#include <cstdio>

#include "server/api_impl.hpp"
#include "server/journal.hpp"

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
}  // namespace

Api::Api(Options options, Backend backend) : impl_(std::make_unique<Impl>()) {
  impl_->options = std::move(options);
  impl_->backend = std::move(backend);
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
    impl_->journal = std::make_unique<Journal>(impl_->options.data_dir);
    impl_->recover();
  }
}

HostConfig Api::Impl::host_config() {
  const std::string exports = options.data_dir.empty() ? "rlloop-exports" : options.data_dir + "/exports";
  return HostConfig{options.region, exports, journal.get(), options.bill_prompt_per_sample};
}

Api::~Api() { shutdown(); }

void Api::shutdown() {
  std::map<std::pair<std::string, std::string>, std::shared_ptr<SessionHost>> all;
  {
    std::lock_guard lock(impl_->mu);
    all = impl_->sessions;
  }
  for (auto& [k, s] : all) s->stop(/*durable=*/false);
  for (auto& [k, s] : all) s->join();
}

void Api::interrupt_waits() { impl_->closing = true; }

std::size_t Api::max_body_bytes() const {
  std::size_t m = 1024 * 1024;
  for (const auto& [id, t] : impl_->tenants) m = std::max(m, t->config.max_body_bytes);
  return m;
}

std::shared_ptr<TenantState> Api::Impl::authenticate(const sigv4::HttpRequest& req) {
  const auto auth = req.header("Authorization");
  if (auth) {
    const std::string key = bearer_of(*auth);
    if (!key.empty()) {
      auto it = bearer_keys.find(key);
      // Same answer for every bad key, so keys cannot be probed.
      if (it == bearer_keys.end()) throw api_error("UnrecognizedClientException", 403, "The bearer key is not valid");
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

Response Api::handle(const sigv4::HttpRequest& req) {
  Impl& im = *impl_;
  const auto started = std::chrono::steady_clock::now();
  const std::string request_id = "req-" + std::to_string(im.next_request++);
  const auto amz_target = req.header("X-Amz-Target");
  const std::string path = req.target.substr(0, req.target.find('?'));
  std::string tenant_id;
  Response res;
  std::string error_type;
  try {
    if (req.method == "GET" && path == "/health") {
      res.body = json{{"status", "ok"}}.dump();
    } else {
      auto tenant = im.authenticate(req);
      tenant_id = tenant->config.id;
      if (req.body.size() > tenant->config.max_body_bytes)
        throw api_error("RequestEntityTooLarge", 413,
                        "request body of " + std::to_string(req.body.size()) +
                            " bytes exceeds this tenant's limit of " + std::to_string(tenant->config.max_body_bytes));
      if (amz_target) {
        res.content_type = "application/x-amz-json-1.1";
        if (req.method != "POST" || path != "/")
          throw api_error("UnknownOperationException", 400, "control-plane calls are POST /");
        json body;
        try {
          body = req.body.empty() ? json::object() : json::parse(req.body);
        } catch (const json::exception& e) {  // parse_error, or out_of_range for a number like 1e999
          throw api_error("SerializationException", 400, std::string("request body is not valid JSON: ") + e.what());
        }
        res.body = im.control_plane(*amz_target, body, tenant).dump();
      } else {
        res = im.runtime(req, path, tenant);
      }
    }
  } catch (const api_error& e) {
    error_type = e.code();
    res.status = e.status();
    // Control plane (JSON 1.1): {"__type", "Message"}; runtime (REST-JSON): X-Amzn-ErrorType + {"message"}.
    if (amz_target) {
      res.content_type = "application/x-amz-json-1.1";
      res.body = json{{"__type", e.code()}, {"Message", e.what()}}.dump(-1, ' ', false, json::error_handler_t::replace);
    } else if (is_openai_path(path) && path.rfind("/training-sessions/", 0) != 0) {
      // OpenAI clients read {"error": {...}}; "message" stays for AWS-style clients.
      res.content_type = "application/json";
      res.body = json{
          {"error", {{"message", e.what()}, {"type", e.code()}, {"param", nullptr}, {"code", e.code()}}},
          {"message",
           e.what()}}.dump(-1, ' ', false, json::error_handler_t::replace);
    } else {
      // The runtime model's exceptions: SampleTrainingSession shares the OpenAI request parser, whose codes
      // botocore would not map to the modelled exception classes.
      error_type = runtime_error_code(e.code());
      res.content_type = "application/json";
      res.body = json{{"message", e.what()}}.dump(-1, ' ', false, json::error_handler_t::replace);
    }
    res.headers.emplace_back("X-Amzn-ErrorType", error_type);
  } catch (const std::exception& e) {
    error_type = "InternalServerException";
    res.status = 500;
    const std::string message = std::string("internal error: ") + e.what();
    // The same shapes as above: a control-plane client reads __type / Message.
    if (amz_target) {
      res.content_type = "application/x-amz-json-1.1";
      res.body =
          json{{"__type", error_type}, {"Message", message}}.dump(-1, ' ', false, json::error_handler_t::replace);
    } else {
      res.content_type = "application/json";
      res.body = json{{"message", message}}.dump(-1, ' ', false, json::error_handler_t::replace);
    }
    res.headers.emplace_back("X-Amzn-ErrorType", error_type);
  }
  res.headers.emplace_back("x-amzn-RequestId", request_id);

  json line{
      {"ts", now_seconds()},
      {"level", res.status >= 500   ? "error"
                : res.status >= 400 ? "warn"
                                    : "info"},
      {"requestId", request_id},
      {"method", req.method},
      {"path", path},
      {"status", res.status},
      {"durationMs", std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - started).count()}};
  if (amz_target) line["target"] = *amz_target;
  if (!tenant_id.empty()) line["tenant"] = tenant_id;
  if (!error_type.empty()) line["errorType"] = error_type;
  im.options.log(line.dump(-1, ' ', false, json::error_handler_t::replace));
  return res;
}

}  // namespace rlloop::server
