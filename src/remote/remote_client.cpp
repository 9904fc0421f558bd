#include "remote_client.hpp"

#include <cstdlib>
#include <fstream>
#include <random>
#include <thread>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

namespace rlloop::detail {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

struct RemoteClient::Connection {
  asio::io_context io;
  tcp::socket socket{io};
  beast::flat_buffer buffer;
};

namespace {

// ~/.aws/credentials, profile AWS_PROFILE or "default".
sigv4::Credentials credentials_file() {
  const char* home = std::getenv("HOME");
  const char* profile_env = std::getenv("AWS_PROFILE");
  const std::string profile = profile_env ? profile_env : "default";
  sigv4::Credentials c;
  if (!home) return c;
  std::ifstream in(std::string(home) + "/.aws/credentials");
  std::string line, section;
  auto trim = [](std::string s) {
    s.erase(0, s.find_first_not_of(" \t\r"));
    s.erase(s.find_last_not_of(" \t\r") + 1);
    return s;
  };
  while (std::getline(in, line)) {
    line = trim(line);
    if (line.empty() || line[0] == '#' || line[0] == ';') continue;
    if (line.front() == '[') {
      section = trim(line.substr(1, line.find(']') - 1));
      continue;
    }
    if (section != profile) continue;
    const auto eq = line.find('=');
    if (eq == std::string::npos) continue;
    const std::string key = trim(line.substr(0, eq)), value = trim(line.substr(eq + 1));
    if (key == "aws_access_key_id")
      c.access_key_id = value;
    else if (key == "aws_secret_access_key")
      c.secret_access_key = value;
    else if (key == "aws_session_token")
      c.session_token = value;
  }
  return c;
}

bool retryable(unsigned status) { return status == 429 || status >= 500; }

}  // namespace

RemoteClient::RemoteClient(RemoteOptions options) : options_(std::move(options)) {
  const std::string prefix = "http://";
  if (options_.endpoint.rfind(prefix, 0) != 0)
    throw invalid_argument("RemoteOptions::endpoint must be http://host:port (got '" + options_.endpoint + "')");
  std::string rest = options_.endpoint.substr(prefix.size());
  rest = rest.substr(0, rest.find('/'));
  const auto colon = rest.rfind(':');
  host_ = colon == std::string::npos ? rest : rest.substr(0, colon);
  port_ = colon == std::string::npos ? "80" : rest.substr(colon + 1);
  if (host_.empty()) throw invalid_argument("RemoteOptions::endpoint has no host: '" + options_.endpoint + "'");
  if (!options_.bearer_key) {
    if (!options_.access_key_id.empty()) {
      creds_ = {options_.access_key_id, options_.secret_access_key, options_.session_token};
    } else if (const char* akid = std::getenv("AWS_ACCESS_KEY_ID"); akid && *akid) {
      const char* secret = std::getenv("AWS_SECRET_ACCESS_KEY");
      const char* token = std::getenv("AWS_SESSION_TOKEN");
      creds_ = {akid, secret ? secret : "", token ? token : ""};
    } else {
      creds_ = credentials_file();
    }
    if (creds_.access_key_id.empty() || creds_.secret_access_key.empty())
      throw invalid_argument(
          "remote session: no credentials (set RemoteOptions::bearer_key or access keys, AWS_ACCESS_KEY_ID / "
          "AWS_SECRET_ACCESS_KEY, or ~/.aws/credentials)");
  }
}

RemoteClient::~RemoteClient() = default;

std::unique_ptr<RemoteClient::Connection> RemoteClient::take() {
  {
    std::lock_guard lock(mu_);
    if (!idle_.empty()) {
      auto c = std::move(idle_.back());
      idle_.pop_back();
      return c;
    }
  }
  auto c = std::make_unique<Connection>();
  tcp::resolver resolver(c->io);
  asio::connect(c->socket, resolver.resolve(host_, port_));
  c->socket.set_option(tcp::no_delay(true));
  return c;
}

void RemoteClient::give_back(std::unique_ptr<Connection> c) {
  std::lock_guard lock(mu_);
  idle_.push_back(std::move(c));
}

nlohmann::json RemoteClient::request(const std::string& method, const std::string& target, const std::string& body,
                                     const std::string& amz_target, const Headers& headers) {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  for (int attempt = 0;; ++attempt) {
    // Same body and headers (and so the same clientToken / Idempotency-Key) on every attempt: the service runs
    // the operation once.
    sigv4::HttpRequest r{method, target, {{"Host", host_ + ":" + port_}}, body};
    if (!body.empty())
      r.set_header("Content-Type", amz_target.empty() ? "application/json" : "application/x-amz-json-1.1");
    if (!amz_target.empty()) r.set_header("X-Amz-Target", amz_target);
    for (const auto& [k, v] : headers) r.set_header(k, v);
    if (options_.bearer_key) {
      r.set_header("Authorization", "Bearer " + *options_.bearer_key);
    } else {
      sigv4::SigningParams p;
      p.region = options_.region;
      p.service = options_.signing_service;
      sigv4::sign(r, creds_, p);
    }
    unsigned status = 0;
    std::string reply, error_type;
    bool transport_failed = false;
    try {
      auto conn = take();
      http::request<http::string_body> req{method == "GET" ? http::verb::get : http::verb::post, target, 11};
      for (const auto& [k, v] : r.headers) req.set(k, v);
      req.body() = body;
      req.keep_alive(true);
      req.prepare_payload();
      http::write(conn->socket, req);
      http::response_parser<http::string_body> parser;
      parser.body_limit(1ull << 32);
      http::read(conn->socket, conn->buffer, parser);
      auto res = parser.release();
      status = res.result_int();
      reply = std::move(res.body());
      error_type = std::string(res["X-Amzn-ErrorType"]);
      if (res.keep_alive()) give_back(std::move(conn));
    } catch (const std::exception&) {
      transport_failed = true;  // refused, reset or closed keep-alive connection
    }
    if ((transport_failed || retryable(status)) && attempt < options_.max_retries) {
      const auto cap = options_.backoff_base * (1 << std::min(attempt, 10));
      std::uniform_int_distribution<long long> jitter(0, cap.count());
      std::this_thread::sleep_for(std::chrono::milliseconds(jitter(rng)));  // "full jitter" backoff
      continue;
    }
    if (transport_failed) throw io_error("cannot reach " + options_.endpoint + " (" + method + " " + target + ")");
    nlohmann::json j = reply.empty() ? nlohmann::json::object() : nlohmann::json::parse(reply, nullptr, false);
    if (status == 200) {
      if (j.is_discarded()) throw io_error("service answered " + target + " with a body that is not JSON");
      return j;
    }
    // Error name: X-Amzn-ErrorType (minus any ":..."), else __type / code (minus any "#" namespace).
    std::string code = error_type.substr(0, error_type.find(':'));
    std::string message = reply;
    if (j.is_object()) {
      if (code.empty()) code = j.value("__type", j.value("code", ""));
      if (auto hash = code.find('#'); hash != std::string::npos) code = code.substr(hash + 1);
      message = j.value("message", j.value("Message", reply));
    }
    throw remote_error(code.empty() ? "HTTP" + std::to_string(status) : code, static_cast<int>(status), message);
  }
}

nlohmann::json RemoteClient::control(const std::string& op, const nlohmann::json& body) {
  return request("POST", "/", body.dump(), "SageMaker." + op);
}

nlohmann::json RemoteClient::rest(const std::string& method, const std::string& target, const std::string& body,
                                  const Headers& headers) {
  return request(method, target, body, "", headers);
}

}  // namespace rlloop::detail
