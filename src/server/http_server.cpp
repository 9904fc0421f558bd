// HTTP/1.1 keep-alive transport for Api: an accept thread and one thread per connection (sessions are few and
// long-lived; the work happens in the session workers, not here).
#include <list>
#include <mutex>
#include <thread>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include "server/server.hpp"

namespace rlloop::server {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

struct Server::Impl {
  Impl(Options o, Backend b) : options(o), api(std::move(o), std::move(b)) {}
  Options options;
  Api api;
  asio::io_context io;
  tcp::acceptor acceptor{io};
  std::thread accept_thread;
  std::mutex mu;
  std::list<std::shared_ptr<tcp::socket>> sockets;
  std::list<std::thread> threads;
  bool stopped = false;
  std::uint16_t port = 0;

  void accept_loop();
  void serve(std::shared_ptr<tcp::socket> socket);
};

namespace {
// A streamed response: headers with chunked transfer encoding, then one chunk per piece the producer writes.
// Returns false when the connection broke (it is then closed).
bool write_streamed(tcp::socket& socket, const Response& out, unsigned version) {
  http::response<http::empty_body> res{static_cast<http::status>(out.status), version};
  res.set(http::field::server, "rlloop-server");
  res.set(http::field::content_type, out.content_type);
  res.set(http::field::cache_control, "no-cache");
  for (const auto& [k, v] : out.headers) res.set(k, v);
  res.chunked(true);
  beast::error_code ec;
  http::response_serializer<http::empty_body> sr{res};
  http::write_header(socket, sr, ec);
  if (ec) return false;
  bool alive = true;
  out.stream([&](std::string_view piece) {
    if (!alive || piece.empty()) return alive;
    asio::write(socket, http::make_chunk(asio::const_buffer(piece.data(), piece.size())), ec);
    alive = !ec;
    return alive;
  });
  if (alive) asio::write(socket, http::make_chunk_last(), ec);
  return alive && !ec;
}
}  // namespace

void Server::Impl::serve(std::shared_ptr<tcp::socket> socket) {
  beast::flat_buffer buffer;
  const std::size_t limit = api.max_body_bytes();
  while (true) {
    http::request_parser<http::string_body> parser;
    parser.body_limit(limit);
    parser.header_limit(64 * 1024);
    beast::error_code ec;
    http::read(*socket, buffer, parser, ec);
    if (ec == http::error::body_limit) {
      // The body was not read, so the connection cannot be reused: answer and close.
      http::response<http::string_body> res{http::status::payload_too_large, 11};
      res.set(http::field::content_type, "application/json");
      res.set("X-Amzn-ErrorType", "RequestEntityTooLarge");
      res.body() = R"({"message":"request body exceeds )" + std::to_string(limit) + R"( bytes"})";
      res.keep_alive(false);
      res.prepare_payload();
      http::write(*socket, res, ec);
      break;
    }
    if (ec) break;  // closed by the peer, or a malformed request
    const auto& req = parser.get();
    sigv4::HttpRequest r;
    r.method = std::string(req.method_string());
    r.target = std::string(req.target());
    for (const auto& f : req) r.headers.emplace_back(std::string(f.name_string()), std::string(f.value()));
    r.body = req.body();
    const Response out = api.handle(r);

    if (out.stream) {
      if (!write_streamed(*socket, out, req.version())) break;
      if (!req.keep_alive()) break;
      continue;
    }
    http::response<http::string_body> res{static_cast<http::status>(out.status), req.version()};
    res.set(http::field::server, "rlloop-server");
    res.set(http::field::content_type, out.content_type);
    for (const auto& [k, v] : out.headers) res.set(k, v);
    res.body() = out.body;
    res.keep_alive(req.keep_alive());
    res.prepare_payload();
    http::write(*socket, res, ec);
    if (ec || !req.keep_alive()) break;
  }
  beast::error_code ignored;
  socket->shutdown(tcp::socket::shutdown_both, ignored);
  socket->close(ignored);
}

void Server::Impl::accept_loop() {
  while (true) {
    auto socket = std::make_shared<tcp::socket>(io);
    beast::error_code ec;
    acceptor.accept(*socket, ec);
    std::lock_guard lock(mu);
    if (stopped) return;
    if (ec) continue;
    socket->set_option(tcp::no_delay(true), ec);
    sockets.push_back(socket);
    threads.emplace_back([this, socket] {
      serve(socket);
      std::lock_guard l(mu);
      sockets.remove(socket);
    });
  }
}

Server::Server(Options options, Backend backend)
    : impl_(std::make_unique<Impl>(std::move(options), std::move(backend))) {}

Server::~Server() { stop(); }

void Server::start() {
  const tcp::endpoint endpoint(asio::ip::make_address(impl_->options.host), impl_->options.port);
  impl_->acceptor.open(endpoint.protocol());
  impl_->acceptor.set_option(asio::socket_base::reuse_address(true));
  beast::error_code ec;
  impl_->acceptor.bind(endpoint, ec);
  if (ec)
    throw io_error("cannot listen on " + impl_->options.host + ":" + std::to_string(impl_->options.port) + ": " +
                   ec.message());
  impl_->acceptor.listen(asio::socket_base::max_listen_connections);
  impl_->port = impl_->acceptor.local_endpoint().port();
  impl_->accept_thread = std::thread([this] { impl_->accept_loop(); });
}

void Server::stop() {
  if (!impl_) return;
  std::list<std::thread> threads;
  {
    std::lock_guard lock(impl_->mu);
    if (impl_->stopped) return;
    impl_->stopped = true;
    beast::error_code ec;
    // shutdown() wakes a thread blocked in accept() on Linux; close() alone does not.
    ::shutdown(impl_->acceptor.native_handle(), SHUT_RDWR);
    for (auto& s : impl_->sockets) s->shutdown(tcp::socket::shutdown_both, ec);
  }
  impl_->api.interrupt_waits();  // a long-poll would otherwise hold its connection thread until its deadline
  if (impl_->accept_thread.joinable()) impl_->accept_thread.join();
  {
    std::lock_guard lock(impl_->mu);
    threads.swap(impl_->threads);
  }
  for (auto& t : threads) t.join();
  beast::error_code ec;
  impl_->acceptor.close(ec);
  impl_->api.shutdown();
}

std::uint16_t Server::port() const { return impl_->port; }
Api& Server::api() { return impl_->api; }

}  // namespace rlloop::server
