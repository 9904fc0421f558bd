// RemoteSession retries through a misbehaving HTTP proxy on loopback: the proxy sits between the client and
// rlloop-server (fake service) and, per request, answers 503 / 429 / 500, drops the connection before or after
// forwarding, or forwards. The client must retry with the very same body (so the same clientToken), and each
// training operation must run exactly once on the server, even when the server ran it and only the answer was lost.
#include <gtest/gtest.h>

#include <atomic>
#include <functional>
#include <list>
#include <map>
#include <mutex>
#include <thread>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <nlohmann/json.hpp>

#include <rlloop/remote.hpp>

#include "fake_service.hpp"
#include "server/server.hpp"

using namespace rlloop;
using nlohmann::json;

namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

enum class Fault { forward, drop_before, drop_after, s500, s503, s429 };

// A loopback HTTP proxy that applies a fault plan to each request. `plan` gets the request (method, target,
// body) and how many times the same request (method + target + body) was seen before, and returns the fault.
class FaultyProxy {
 public:
  using Plan = std::function<Fault(const http::request<http::string_body>&, int seen)>;
  FaultyProxy(std::uint16_t upstream, Plan plan) : upstream_(upstream), plan_(std::move(plan)) {
    acceptor_.open(tcp::v4());
    acceptor_.bind({asio::ip::make_address("127.0.0.1"), 0});
    acceptor_.listen();
    port_ = acceptor_.local_endpoint().port();
    accept_thread_ = std::thread([this] { accept_loop(); });
  }
  ~FaultyProxy() {
    stopped_ = true;
    ::shutdown(acceptor_.native_handle(), SHUT_RDWR);
    accept_thread_.join();
    {
      std::lock_guard lock(mu_);
      for (auto& s : sockets_) {
        beast::error_code ec;
        s->shutdown(tcp::socket::shutdown_both, ec);
      }
    }
    for (auto& t : threads_) t.join();
  }
  std::uint16_t port() const { return port_; }

  struct Seen {
    std::string method, target, body;
    Fault fault;
  };
  std::vector<Seen> log() const {
    std::lock_guard lock(mu_);
    return log_;
  }

 private:
  void accept_loop() {
    while (!stopped_) {
      auto socket = std::make_shared<tcp::socket>(io_);
      beast::error_code ec;
      acceptor_.accept(*socket, ec);
      if (ec || stopped_) return;
      std::lock_guard lock(mu_);
      sockets_.push_back(socket);
      threads_.emplace_back([this, socket] { serve(*socket); });
    }
  }

  void serve(tcp::socket& client) {
    asio::io_context io;
    tcp::socket up(io);
    beast::flat_buffer in_buf, up_buf;
    beast::error_code ec;
    while (!stopped_) {
      http::request<http::string_body> req;
      http::read(client, in_buf, req, ec);
      if (ec) break;
      Fault f;
      {
        std::lock_guard lock(mu_);
        const std::string key = std::string(req.method_string()) + " " + std::string(req.target()) + " " + req.body();
        f = plan_(req, seen_[key]++);
        log_.push_back({std::string(req.method_string()), std::string(req.target()), req.body(), f});
      }
      if (f == Fault::drop_before) break;
      if (f == Fault::s500 || f == Fault::s503 || f == Fault::s429) {
        const unsigned status = f == Fault::s500 ? 500 : f == Fault::s503 ? 503 : 429;
        http::response<http::string_body> res{static_cast<http::status>(status), 11};
        res.set(http::field::content_type, "application/json");
        res.set("X-Amzn-ErrorType", f == Fault::s500   ? "InternalServerException"
                                    : f == Fault::s503 ? "ServiceUnavailableException"
                                                       : "ThrottlingException");
        res.body() = R"({"message":"injected by the proxy"})";
        res.keep_alive(true);
        res.prepare_payload();
        http::write(client, res, ec);
        if (ec) break;
        continue;
      }
      if (!up.is_open()) {
        up.connect({asio::ip::make_address("127.0.0.1"), upstream_}, ec);
        if (ec) break;
      }
      http::write(up, req, ec);
      if (ec) break;
      http::response<http::string_body> res;
      http::read(up, up_buf, res, ec);
      if (ec) break;
      if (f == Fault::drop_after) break;  // the server did the work; the client never hears of it
      http::write(client, res, ec);
      if (ec) break;
    }
    client.shutdown(tcp::socket::shutdown_both, ec);
    client.close(ec);
  }

  std::uint16_t upstream_;
  Plan plan_;
  asio::io_context io_;
  tcp::acceptor acceptor_{io_};
  std::uint16_t port_ = 0;
  std::atomic<bool> stopped_{false};
  std::thread accept_thread_;
  mutable std::mutex mu_;
  std::list<std::shared_ptr<tcp::socket>> sockets_;
  std::list<std::thread> threads_;
  std::map<std::string, int> seen_;
  std::vector<Seen> log_;
};

bool is_training_submit(const http::request<http::string_body>& r) {
  const std::string t(r.target());
  return r.method() == http::verb::post && t.size() > 11 && t.compare(t.size() - 11, 11, "/operations") == 0;
}
bool is_sampling_submit(const http::request<http::string_body>& r) {
  const std::string t(r.target());
  return r.method() == http::verb::post && t.find("/sampling-operations") != std::string::npos &&
         t.compare(t.size() - 20, 20, "/sampling-operations") == 0;
}
bool is_poll(const http::request<http::string_body>& r) {
  return r.method() == http::verb::get && std::string(r.target()).find("operations/") != std::string::npos;
}

struct RetryFixture : ::testing::Test {
  void SetUp() override {
    server::Options opts;
    opts.tenants = {server::Tenant{"a", "111122223333", {{"AKIDRETRY", "retry-secret"}}, {"bearer-a"}, 4, 1 << 20}};
    opts.log = [](const std::string&) {};
    service = std::make_shared<fake::FakeService>();
    srv = std::make_unique<server::Server>(opts, server::make_backend(service));
    srv->start();
  }
  void TearDown() override { srv->stop(); }

  RemoteOptions through(const FaultyProxy& proxy) const {
    RemoteOptions o;
    o.endpoint = "http://127.0.0.1:" + std::to_string(proxy.port());
    o.access_key_id = "AKIDRETRY";  // SigV4: every retry is signed again
    o.secret_access_key = "retry-secret";
    o.max_retries = 6;
    o.backoff_base = std::chrono::milliseconds(1);
    o.poll_initial = std::chrono::milliseconds(1);
    o.poll_max = std::chrono::milliseconds(5);
    return o;
  }

  static Datum datum(std::vector<token_id> tokens) {
    Datum d;
    d.model_input = ModelInput::from_tokens(tokens);
    d.loss_fn_inputs["target_tokens"] = TensorData::from_tokens(tokens);
    d.loss_fn_inputs["weights"] = TensorData::from_floats(std::vector<float>(tokens.size(), 1.0f));
    return d;
  }

  std::shared_ptr<fake::FakeService> service;
  std::unique_ptr<server::Server> srv;
};

}  // namespace

TEST_F(RetryFixture, TrainingOperationsRunOnceThroughEveryKindOfFault) {
  // Every training submission meets, in order: a connection dropped before forwarding, 503, 429, 500, a
  // connection dropped after the server accepted it, and only then an answer. Polls get one 503 each.
  const std::vector<Fault> submit_faults{Fault::drop_before, Fault::s503,       Fault::s429,
                                         Fault::s500,        Fault::drop_after, Fault::forward};
  FaultyProxy proxy(srv->port(), [&](const http::request<http::string_body>& r, int seen) {
    if (is_training_submit(r)) return submit_faults.at(std::min<std::size_t>(seen, submit_faults.size() - 1));
    if (is_poll(r)) return seen == 0 ? Fault::s503 : Fault::forward;
    return Fault::forward;
  });
  RemoteService remote(through(proxy));
  auto s = remote.create_session(SessionOptions{"tiny", LoraOptions{}, 0, "retry"});

  auto fb = s->forward_backward({datum({1, 2, 3})}, LossSpec::cross_entropy());
  auto step = s->optim_step(AdamParams{.learning_rate = 1e-3});
  EXPECT_NEAR(fb.get().metrics.at("loss:sum"), 0.02 + 0.03 + 0.04, 1e-6);  // float logprobs
  EXPECT_EQ(step.get().metrics.at("step"), 1.0);

  // Exactly once on the server, in order, and billed once.
  EXPECT_EQ(service->sessions().back()->log(), (std::vector<std::string>{"forward_backward", "optim_step"}));
  EXPECT_EQ(s->usage().training, 3);

  // Six attempts per submission, each with the same body: the same sequenceNumber and clientToken.
  std::map<std::int64_t, std::vector<json>> attempts;
  for (const auto& seen : proxy.log())
    if (seen.method == "POST" && seen.target == "/v1/training-sessions/retry/operations") {
      const json b = json::parse(seen.body);
      attempts[b["sequenceNumber"].get<std::int64_t>()].push_back(b);
    }
  ASSERT_EQ(attempts.size(), 2u);
  for (const auto& [seq, bodies] : attempts) {
    ASSERT_EQ(bodies.size(), submit_faults.size()) << "sequence " << seq;
    const std::string token = bodies[0].at("clientToken");
    EXPECT_FALSE(token.empty());
    for (const auto& b : bodies) EXPECT_EQ(b, bodies[0]) << "sequence " << seq;
  }
  EXPECT_NE(attempts[1][0]["clientToken"], attempts[2][0]["clientToken"]);

  // The server kept one operation per token: the sequence number it last received is 2.
  auto d =
      srv->api().handle({"POST",
                         "/",
                         {{"Authorization", "Bearer bearer-a"}, {"X-Amz-Target", "SageMaker.DescribeTrainingSession"}},
                         R"({"TrainingSessionName":"retry"})"});
  EXPECT_EQ(json::parse(d.body)["TrainingSessionDetail"]["LastReceivedSequenceNumber"], 2);
}

TEST_F(RetryFixture, SamplingRetriesRunOnceThroughEveryKindOfFault) {
  // Sampling requests carry no clientToken; the client sends an Idempotency-Key header instead, the
  // same on every attempt, so even a sample the server ran whose answer was lost (drop_after) runs and bills once.
  const std::vector<Fault> faults{Fault::drop_before, Fault::s429,       Fault::drop_after,
                                  Fault::s500,        Fault::drop_after, Fault::forward};
  FaultyProxy proxy(srv->port(), [&](const http::request<http::string_body>& r, int seen) {
    if (is_sampling_submit(r)) return faults.at(std::min<std::size_t>(seen, faults.size() - 1));
    return Fault::forward;
  });
  RemoteService remote(through(proxy));
  auto s = remote.create_session(SessionOptions{"tiny", LoraOptions{}, 0, "samp"});
  const SampleResponse r =
      s->sample(SampleRequest{ModelInput::from_tokens({5}), 2, SamplingParams{.max_tokens = 3}}).get();
  ASSERT_EQ(r.sequences.size(), 2u);
  EXPECT_EQ(r.sequences[0].tokens, (std::vector<token_id>{6, 7, 8}));
  EXPECT_EQ(service->sessions().back()->log(), (std::vector<std::string>{"sample"}));
  EXPECT_EQ(s->usage().sample, 6);
  EXPECT_EQ(s->usage().prefill, 1);

  // A second sample is a new operation with a new key: it runs (and bills) again.
  s->sample(SampleRequest{ModelInput::from_tokens({5}), 2, SamplingParams{.max_tokens = 3}}).get();
  EXPECT_EQ(service->sessions().back()->log(), (std::vector<std::string>{"sample", "sample"}));
  EXPECT_EQ(s->usage().sample, 12);
  int submits = 0;
  for (const auto& seen : proxy.log())
    submits += seen.method == "POST" && seen.target == "/v1/training-sessions/samp/sampling-operations";
  EXPECT_EQ(submits, static_cast<int>(faults.size()) + 1);
}

TEST_F(RetryFixture, GivesUpAfterMaxRetriesAndNeverRetriesClientErrors) {
  std::atomic<bool> unavailable{false};
  FaultyProxy proxy(srv->port(), [&](const http::request<http::string_body>& r, int) {
    return unavailable && is_training_submit(r) ? Fault::s503 : Fault::forward;
  });
  RemoteOptions o = through(proxy);
  o.max_retries = 3;
  RemoteService remote(o);
  auto s = remote.create_session(SessionOptions{"tiny", LoraOptions{}, 0, "giveup"});
  unavailable = true;
  try {
    s->optim_step(AdamParams{});
    FAIL() << "a service that always answers 503 must fail the call";
  } catch (const remote_error& e) {
    EXPECT_EQ(e.code(), "ServiceUnavailableException");
    EXPECT_EQ(e.http_status(), 503);
  }
  auto count = [&](const std::string& target) {
    int n = 0;
    for (const auto& seen : proxy.log()) n += seen.method == "POST" && seen.target == target;
    return n;
  };
  EXPECT_EQ(count("/v1/training-sessions/giveup/operations"), 1 + 3);
  EXPECT_TRUE(service->sessions().back()->log().empty());

  // A 400 is the caller's mistake: one attempt, no retry.
  unavailable = false;
  EXPECT_THROW(s->forward_backward({datum({1, 500})}, LossSpec::cross_entropy()), remote_error);
  EXPECT_EQ(count("/v1/training-sessions/giveup/operations"), 1 + 3 + 1);
}
