// rlloop-server's connection handling (Server on Asio): threads do not grow with connections, long-polls or
// samples; the connection cap answers a clear 503; idle, header and body timeouts close the connection; streamed
// bodies arrive whole. Loopback only, the fake service, and no timing assertions: every check is an event (a
// response, the peer's EOF), with generous bounds that only turn a hang into a failure.
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>

#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include "fake_service.hpp"
#include "server/server.hpp"
#include "test_client.hpp"
#include "wire/runtime.hpp"

using namespace rlloop;
using test_http::json;
namespace http = boost::beast::http;
using tcp = boost::asio::ip::tcp;

namespace {

// How long any one event may take before the test fails instead of hanging (not a performance bound).
constexpr int kEventBoundMs = 30'000;

std::size_t thread_count() {
  std::size_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/task")) ++n;
  return n;
}

// A server on loopback with one bearer-key tenant; the gate opens before it stops, so no worker stays blocked.
struct Served {
  std::shared_ptr<fake::FakeService> service = std::make_shared<fake::FakeService>();
  std::unique_ptr<server::Server> srv;
  std::mutex log_mu;
  std::vector<std::string> logs;

  explicit Served(server::Options o) {
    o.tenants = {server::Tenant{"t", "111122223333", {}, {"key"}, 8, 1 << 20}};
    o.log = [this](const std::string& line) {
      std::lock_guard lock(log_mu);
      logs.push_back(line);
    };
    srv = std::make_unique<server::Server>(o, server::make_backend(service));
    srv->start();
  }
  ~Served() {
    service->gate->set(true);
    srv->stop();
  }
  std::uint16_t port() const { return srv->port(); }
  bool logged(const std::string& needle) {
    std::lock_guard lock(log_mu);
    for (const auto& l : logs)
      if (l.find(needle) != std::string::npos) return true;
    return false;
  }

  test_http::Client client() {
    test_http::Client c(port());
    c.use_bearer("key");
    return c;
  }
  // Creates a session and waits (by polling, bounded) until it runs.
  void create_running(const std::string& name) {
    auto c = client();
    const json body{{"TrainingSessionName", name},
                    {"RoleArn", "arn:aws:iam::111122223333:role/MyRole"},
                    {"LoraConfig", {{"Rank", 8}, {"Alpha", 16}}},
                    {"ModelConfig", {{"BaseModelArn", "tiny"}}},
                    {"OutputConfig", {{"S3Location", {{"Path", "s3://bucket/prefix/"}}}}}};
    ASSERT_EQ(c.control("CreateTrainingSession", body).status, 200u);
    for (int i = 0; i < kEventBoundMs / 5; ++i) {
      auto d = c.control("DescribeTrainingSession", {{"TrainingSessionName", name}}).json_body();
      if (d["TrainingSessionDetail"]["TrainingSessionStatus"] == "Running") return;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    FAIL() << "session " << name << " never reached Running";
  }
};

json forward_backward_body(std::int64_t seq) {
  Datum d;
  d.model_input = ModelInput::from_tokens({1, 2, 3});
  d.loss_fn_inputs["target_tokens"] = TensorData::from_tokens(std::vector<token_id>{1, 2, 3});
  d.loss_fn_inputs["weights"] = TensorData::from_floats(std::vector<float>{1, 1, 1});
  return {{"sequenceNumber", seq},
          {"operationConfig",
           {{"forwardBackward", {{"datumList", json::array({wire::to_json(d)})}, {"lossFnName", "cross_entropy"}}}}}};
}

enum class Ending { eof, reset, data, silent };

// One raw client connection: requests written whole, responses read with Beast, and what the server does next.
class Conn {
 public:
  Conn(boost::asio::io_context& io, std::uint16_t port) : socket_(io) {
    socket_.connect({boost::asio::ip::make_address("127.0.0.1"), port});
  }

  void send_raw(const std::string& bytes) { boost::asio::write(socket_, boost::asio::buffer(bytes)); }
  void send(const std::string& method, const std::string& target, const std::string& body = "",
            bool keep_alive = true) {
    http::request<http::string_body> req{method == "GET" ? http::verb::get : http::verb::post, target, 11};
    req.set(http::field::host, "127.0.0.1");
    req.set(http::field::authorization, "Bearer key");
    if (!body.empty()) req.set(http::field::content_type, "application/json");
    req.body() = body;
    req.keep_alive(keep_alive);
    req.prepare_payload();
    http::write(socket_, req);
  }
  http::response<http::string_body> read() {
    http::response_parser<http::string_body> parser;
    parser.body_limit(1ull << 30);
    if (buffer_.size() == 0 && !readable()) throw std::runtime_error("no response");
    http::read(socket_, buffer_, parser);
    return parser.release();
  }
  http::response<http::string_body> request(const std::string& method, const std::string& target,
                                            const std::string& body = "", bool keep_alive = true) {
    send(method, target, body, keep_alive);
    return read();
  }
  // What the server does with the connection next: closes it (EOF), resets it, sends bytes, or nothing in the
  // bound.
  Ending ending() {
    if (buffer_.size() > 0) return Ending::data;
    if (!readable()) return Ending::silent;
    char byte;
    const ssize_t n = ::recv(socket_.native_handle(), &byte, 1, 0);
    return n == 0 ? Ending::eof : n < 0 ? Ending::reset : Ending::data;
  }
  void close() {
    boost::system::error_code ec;
    socket_.close(ec);
  }

 private:
  bool readable() {
    pollfd p{socket_.native_handle(), POLLIN, 0};
    return ::poll(&p, 1, kEventBoundMs) == 1;
  }
  tcp::socket socket_;
  boost::beast::flat_buffer buffer_;
};

}  // namespace

TEST(Connections, ThreadsDoNotGrowWithConnectionsLongPollsOrSamples) {
  server::Options o;
  o.io_threads = 2;
  o.stream_threads = 2;
  Served s(o);
  s.create_running("soak");
  boost::asio::io_context io;
  {
    Conn warm(io, s.port());
    ASSERT_EQ(warm.request("GET", "/health").result_int(), 200u);
  }
  const std::size_t idle_threads = thread_count();  // main, 2 io, 2 stream, the session's worker

  // An operation that stays InProgress until the gate opens, for long-polls and samples to wait on.
  s.service->gate->set(false);
  auto c = s.client();
  const auto submitted = c.post("/v1/training-sessions/soak/operations", forward_backward_body(1));
  ASSERT_EQ(submitted.status, 200u) << submitted.body;
  const std::string op = submitted.json_body()["operationId"];

  // 2,000 connections, each for one request (Connection: close): the server answers, then closes.
  for (int i = 0; i < 2000; ++i) {
    Conn k(io, s.port());
    const auto r = k.request("GET", "/health", "", /*keep_alive=*/false);
    ASSERT_EQ(r.result_int(), 200u) << i;
    ASSERT_EQ(k.ending(), Ending::eof) << i;
  }
  // 200 idle keep-alive connections, 100 long-polls on the gated operation, 20 samples behind it.
  std::vector<std::unique_ptr<Conn>> idle, polls, samples;
  for (int i = 0; i < 200; ++i) {
    idle.push_back(std::make_unique<Conn>(io, s.port()));
    ASSERT_EQ(idle.back()->request("GET", "/health").result_int(), 200u);
  }
  for (int i = 0; i < 100; ++i) {
    polls.push_back(std::make_unique<Conn>(io, s.port()));
    polls.back()->send("GET", "/v1/training-sessions/soak/operations/" + op + "?waitSeconds=20");
  }
  const json completion{{"model", "soak"}, {"prompt", {1, 2, 3}}, {"max_tokens", 4}};
  for (int i = 0; i < 20; ++i) {
    samples.push_back(std::make_unique<Conn>(io, s.port()));
    samples.back()->send("POST", "/v1/completions", completion.dump());
  }
  EXPECT_EQ(thread_count(), idle_threads) << "with 320 connections open, 120 of them waiting";

  s.service->gate->set(true);
  for (auto& p : polls) {
    const auto r = p->read();
    ASSERT_EQ(r.result_int(), 200u);
    // Completed, or InProgress for a poll whose 20 s ran out first on a very slow machine.
    const std::string status = json::parse(r.body())["status"];
    EXPECT_TRUE(status == "Completed" || status == "InProgress") << status;
  }
  for (auto& k : samples) {
    const auto r = k->read();
    ASSERT_EQ(r.result_int(), 200u) << r.body();
    EXPECT_EQ(json::parse(r.body())["usage"]["completion_tokens"], 4);
  }
  for (auto& k : idle) EXPECT_EQ(k->request("GET", "/health").result_int(), 200u);  // still served
  for (auto* group : {&idle, &polls, &samples})
    for (auto& k : *group) k->close();
  EXPECT_EQ(thread_count(), idle_threads);
}

TEST(Connections, OverTheCapANewClientGetsA503AndTheIdleOnesStayServed) {
  server::Options o;
  o.max_connections = 8;
  Served s(o);  // idle timeout: the default minute, far longer than this test
  boost::asio::io_context io;
  std::vector<std::unique_ptr<Conn>> idle;
  for (int i = 0; i < 8; ++i) {
    idle.push_back(std::make_unique<Conn>(io, s.port()));
    ASSERT_EQ(idle.back()->request("GET", "/health").result_int(), 200u);
  }
  for (int i = 0; i < 3; ++i) {
    Conn extra(io, s.port());
    const auto r = extra.request("GET", "/health");
    EXPECT_EQ(r.result_int(), 503u);
    EXPECT_EQ(r["X-Amzn-ErrorType"], "ServiceUnavailableException");
    EXPECT_EQ(r["Retry-After"], "1");
    EXPECT_FALSE(r.keep_alive());
    EXPECT_NE(json::parse(r.body())["message"].get<std::string>().find("maximum of 8 connections"), std::string::npos);
    EXPECT_EQ(extra.ending(), Ending::eof);
  }
  EXPECT_TRUE(s.logged("\"event\":\"connection_refused\""));
  // Refusals took no slot: the idle connections are still served.
  for (auto& k : idle) EXPECT_EQ(k->request("GET", "/health").result_int(), 200u);
}

TEST(Connections, IdleConnectionsAreClosedAfterTheIdleTimeoutFreeingTheirSlots) {
  server::Options o;
  o.max_connections = 8;
  o.idle_timeout = std::chrono::milliseconds(200);
  Served s(o);
  boost::asio::io_context io;
  std::vector<std::unique_ptr<Conn>> idle;
  for (int i = 0; i < 7; ++i) {
    idle.push_back(std::make_unique<Conn>(io, s.port()));
    ASSERT_EQ(idle.back()->request("GET", "/health").result_int(), 200u);
  }
  // A connection that never sent a request is idle too; with it the cap is reached.
  idle.push_back(std::make_unique<Conn>(io, s.port()));
  for (std::size_t i = 0; i < idle.size(); ++i) EXPECT_EQ(idle[i]->ending(), Ending::eof) << i;
  // The server frees a slot before its client sees EOF, so the cap is free again now.
  for (int i = 0; i < 8; ++i) {
    Conn fresh(io, s.port());
    EXPECT_EQ(fresh.request("GET", "/health", "", false).result_int(), 200u);
  }
}

TEST(Connections, SlowHeadersAndBodiesAreClosed) {
  server::Options o;
  o.header_timeout = std::chrono::milliseconds(200);
  o.body_timeout = std::chrono::milliseconds(200);
  Served s(o);
  boost::asio::io_context io;
  Conn header(io, s.port());
  header.send_raw("GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n");  // the headers never end
  EXPECT_EQ(header.ending(), Ending::eof);
  Conn body(io, s.port());
  body.send_raw("POST /v1/usage HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789");  // 90 bytes short
  EXPECT_EQ(body.ending(), Ending::eof);
  // The size limits hold too: 64 KiB of headers, and bodies over the largest tenant limit get 413 and a close.
  Conn big(io, s.port());
  big.send_raw("GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + std::string(70 * 1024, 'a') + "\r\n\r\n");
  EXPECT_NE(big.ending(), Ending::silent);
  Conn huge(io, s.port());
  huge.send_raw("POST /v1/usage HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999\r\n\r\n");
  const auto r = huge.read();
  EXPECT_EQ(r.result_int(), 413u);
  EXPECT_EQ(r["X-Amzn-ErrorType"], "RequestEntityTooLarge");
  EXPECT_EQ(huge.ending(), Ending::eof);
}

TEST(Connections, PipelinedRequestsAreAnsweredInOrder) {
  Served s(server::Options{});
  boost::asio::io_context io;
  Conn k(io, s.port());
  const std::string get = "GET /health HTTP/1.1\r\nHost: x\r\n\r\n";
  const std::string usage = "GET /v1/usage HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer key\r\n\r\n";
  k.send_raw(get + usage + get);
  EXPECT_EQ(k.read().body(), R"({"status":"ok"})");
  EXPECT_EQ(json::parse(k.read().body())["tenant"], "t");
  EXPECT_EQ(k.read().body(), R"({"status":"ok"})");
}

TEST(Connections, LargeStreamsArriveWholeAndAClientLeavingMidStreamDoesNotHoldTheServer) {
  Served s(server::Options{});
  s.create_running("sse");
  boost::asio::io_context io;
  // 4 x 20,000 tokens: ~80,000 events, megabytes beyond the producer's 256 KiB high-water mark.
  const json req{{"model", "sse"}, {"prompt", {1, 2, 3}}, {"max_tokens", 20000}, {"n", 4}, {"stream", true}};
  Conn whole(io, s.port());
  const auto r = whole.request("POST", "/v1/completions", req.dump());
  ASSERT_EQ(r.result_int(), 200u) << r.body();
  EXPECT_EQ(r[http::field::content_type], "text/event-stream");
  EXPECT_TRUE(r.chunked());
  EXPECT_GT(r.body().size(), 4u << 20);
  std::size_t events = 0;
  for (std::size_t at = r.body().find("data: "); at != std::string::npos; at = r.body().find("data: ", at + 1))
    ++events;
  EXPECT_EQ(events, 4u * 20000 + 4 + 1);  // a chunk per token, each choice's finish_reason, [DONE]
  EXPECT_TRUE(r.body().ends_with("data: [DONE]\n\n"));
  EXPECT_EQ(whole.request("GET", "/health").result_int(), 200u);  // keep-alive after a stream

  // Two clients that read nothing and go away: the producers blocked on them must end, or stop() would hang.
  for (int i = 0; i < 2; ++i) {
    Conn leaver(io, s.port());
    leaver.send("POST", "/v1/completions", req.dump());
    leaver.close();
  }
  Conn after(io, s.port());
  EXPECT_EQ(after.request("POST", "/v1/completions", req.dump()).result_int(), 200u);
  s.srv->stop();
}

TEST(Connections, OptionsAreCheckedNamingTheField) {
  auto backend = server::make_backend(std::make_shared<fake::FakeService>());
  server::Options o;
  o.io_threads = 0;
  try {
    server::Server srv(o, backend);
    FAIL() << "io_threads = 0 was accepted";
  } catch (const invalid_argument& e) {
    EXPECT_STREQ(e.what(), "server::Options::io_threads: must be at least 1");
  }
  o = {};
  o.idle_timeout = std::chrono::milliseconds(0);
  EXPECT_THROW(server::Server(o, backend), invalid_argument);
}
