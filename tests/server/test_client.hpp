// A minimal keep-alive HTTP client for the server tests, signing with SigV4 or a bearer key.
#pragma once
#include <memory>
#include <string>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <nlohmann/json.hpp>

#include "sigv4/sigv4.hpp"

namespace test_http {

namespace http = boost::beast::http;
using tcp = boost::asio::ip::tcp;
using nlohmann::json;

struct Reply {
  unsigned status = 0;
  std::string error_type;  // X-Amzn-ErrorType
  std::string body;
  json json_body() const { return json::parse(body); }
};

class Client {
 public:
  explicit Client(std::uint16_t port)
      : io_(std::make_unique<boost::asio::io_context>()), socket_(std::make_unique<tcp::socket>(*io_)) {
    socket_->connect({boost::asio::ip::make_address("127.0.0.1"), port});
  }

  void use_sigv4(rlloop::sigv4::Credentials c) { creds_ = std::move(c), bearer_.clear(); }
  void use_bearer(std::string key) { bearer_ = std::move(key), creds_.access_key_id.clear(); }

  using Headers = std::vector<std::pair<std::string, std::string>>;
  Reply send(const std::string& method, const std::string& target, const std::string& body = "",
             const std::string& amz_target = "", const Headers& headers = {}) {
    rlloop::sigv4::HttpRequest r{method, target, {{"Host", "127.0.0.1"}}, body};
    if (!body.empty())
      r.set_header("Content-Type", amz_target.empty() ? "application/json" : "application/x-amz-json-1.1");
    if (!amz_target.empty()) r.set_header("X-Amz-Target", amz_target);
    for (const auto& [k, v] : headers) r.set_header(k, v);
    if (!creds_.access_key_id.empty()) {
      rlloop::sigv4::SigningParams p;
      p.service = "sagemaker";
      rlloop::sigv4::sign(r, creds_, p);
    } else if (!bearer_.empty()) {
      r.set_header("Authorization", "Bearer " + bearer_);
    }
    http::request<http::string_body> req{method == "GET" ? http::verb::get : http::verb::post, target, 11};
    for (const auto& [k, v] : r.headers) req.set(k, v);
    req.body() = body;
    req.keep_alive(true);
    req.prepare_payload();
    http::write(*socket_, req);
    http::response<http::string_body> res;
    http::read(*socket_, buffer_, res);
    return Reply{res.result_int(), std::string(res["X-Amzn-ErrorType"]), res.body()};
  }

  Reply control(const std::string& op, const json& body) { return send("POST", "/", body.dump(), "SageMaker." + op); }
  Reply post(const std::string& target, const json& body, const Headers& headers = {}) {
    return send("POST", target, body.dump(), "", headers);
  }
  Reply get(const std::string& target) { return send("GET", target); }

 private:
  std::unique_ptr<boost::asio::io_context> io_;
  std::unique_ptr<tcp::socket> socket_;
  boost::beast::flat_buffer buffer_;
  rlloop::sigv4::Credentials creds_;
  std::string bearer_;
};

}  // namespace test_http
