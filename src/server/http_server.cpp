// HTTP/1.1 keep-alive transport for Api on Asio's asynchronous I/O. Options::io_threads threads run every
// connection's reads, writes and timers, so threads do not grow with clients: a request that waits (a long-poll, a
// sample) holds its connection, not a thread, and Api::handle_async answers it on the connection's strand. A
// streamed body's producer runs on one of Options::stream_threads and hands its chunks to the connection, waiting
// while kStreamHighWater bytes are unsent.
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <utility>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <nlohmann/json.hpp>

#include <rlloop/error.hpp>

#include "server/server.hpp"

namespace rlloop::server {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

namespace {

constexpr std::size_t kHeaderLimit = 64 * 1024;
constexpr std::size_t kReadChunk = 4096;  // the first read of a request, while the connection is idle
// Unsent bytes of a streamed body beyond which its producer waits for the client to read.
constexpr std::size_t kStreamHighWater = 256 * 1024;
// How long a connection over the cap may take to receive its 503 and close.
constexpr std::chrono::seconds kRefusalLinger{2};
// Pause before accepting again after accept failed (e.g. out of file descriptors), instead of spinning on it.
constexpr std::chrono::milliseconds kAcceptRetry{50};

double unix_seconds() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

Options validated(Options o) {
  auto need = [](bool ok, const char* field, const char* rule) {
    if (!ok) throw invalid_argument(std::string("server::Options::") + field + ": " + rule);
  };
  need(o.io_threads >= 1, "io_threads", "must be at least 1");
  need(o.stream_threads >= 1, "stream_threads", "must be at least 1");
  need(o.max_connections >= 1, "max_connections", "must be at least 1");
  need(o.idle_timeout.count() > 0, "idle_timeout", "must be positive");
  need(o.header_timeout.count() > 0, "header_timeout", "must be positive");
  need(o.body_timeout.count() > 0, "body_timeout", "must be positive");
  need(o.write_timeout.count() > 0, "write_timeout", "must be positive");
  if (!o.log) o.log = [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); };
  return o;
}

// One HTTP chunk (RFC 9112 §7.1), as Beast's make_chunk frames it.
void append_chunk(std::string& out, std::string_view piece) {
  char size[24];
  const int n = std::snprintf(size, sizeof size, "%zx\r\n", piece.size());
  out.append(size, static_cast<std::size_t>(n)).append(piece).append("\r\n");
}

// The chunks of a streamed body on their way from its producer (a stream thread) to its connection (the io
// threads); the producer waits while the connection has kStreamHighWater bytes unsent.
struct Outbox {
  std::mutex mu;
  std::condition_variable room;
  std::string pending;     // framed chunks no write has taken yet
  std::size_t unsent = 0;  // bytes pending or being written
  bool writing = false;    // a write, or a post to start one, is under way: the producer must not start another
  bool finished = false;   // the producer returned
  bool failed = false;     // ... by throwing: the body ends without its last chunk
  bool abandoned = false;  // the connection closed: the producer's writes fail from now on
};

class Connection;

// What connections share: the Api, the settings, the stream threads and the registry of open connections.
struct Core {
  Core(Options o, Backend b)
      : options(validated(std::move(o))),
        api(options, std::move(b)),
        body_limit(api.max_body_bytes()),
        streams(options.stream_threads) {}

  // First, so that it is destroyed last: the Api's operations and the stream threads' work may hold its executors.
  asio::io_context io;
  Options options;
  Api api;
  const std::size_t body_limit;
  asio::thread_pool streams;  // streamed bodies' producers

  std::mutex mu;                                                           // guards everything below
  std::unordered_map<Connection*, std::weak_ptr<Connection>> connections;  // served and refused, for stop()
  std::size_t served = 0;                                                  // those counting against the cap
  bool stopped = false;

  void forget(Connection* c, bool counted) {
    std::lock_guard lock(mu);
    connections.erase(c);
    if (counted) --served;
  }
  void log(const nlohmann::json& line) {
    options.log(line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
  }
};

// One client connection. Everything but the producer of a streamed body runs on the connection's strand.
class Connection : public std::enable_shared_from_this<Connection> {
 public:
  // counted: against max_connections (a connection that is refused is not).
  Connection(Core& server, tcp::socket socket, bool counted)
      : server_(server), stream_(std::move(socket)), idle_timer_(stream_.get_executor()), counted_(counted) {}
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  Executor executor() { return stream_.get_executor(); }
  // Reads and answers requests until the client closes, a timeout expires or the server stops.
  void serve() { read_request(); }
  // Over the cap: one 503, then close.
  void refuse(std::size_t cap);
  // Idempotent; the peer sees EOF.
  void close();

 private:
  void read_request();
  void read_header();
  void read_body();
  void read_failed(const beast::error_code& ec);
  void dispatch();
  void respond(Response res);
  template <class Message>
  void write(std::shared_ptr<Message> msg);
  void drain();
  // Streamed bodies (Response::stream).
  void start_stream(Response res);
  static void produce(std::shared_ptr<Connection> self, std::shared_ptr<Outbox> box,
                      std::function<void(const StreamWriter&)> producer);
  static bool offer(const std::shared_ptr<Connection>& self, Outbox& box, std::string_view piece);
  void pump();

  Core& server_;
  beast::tcp_stream stream_;
  // The idle timeout is this timer rather than the stream's own expiry, so that close() frees the connection's slot
  // before the client sees EOF: a client that saw its idle connection closed finds room for a new one.
  asio::steady_timer idle_timer_;
  std::uint64_t idle_waits_ = 0;  // tells a stale idle timer's completion from the current wait's
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  bool keep_alive_ = false;
  unsigned version_ = 11;
  std::shared_ptr<Outbox> outbox_;  // while a streamed body is written
  const bool counted_;
  bool closed_ = false;
};

void Connection::read_request() {
  if (closed_) return;
  parser_.emplace();
  parser_->body_limit(server_.body_limit);
  parser_->header_limit(kHeaderLimit);
  if (buffer_.size() > 0) return read_header();  // the next request is already here
  // Idle until the next request's first byte.
  const std::uint64_t wait = ++idle_waits_;
  stream_.expires_never();
  idle_timer_.expires_after(server_.options.idle_timeout);
  idle_timer_.async_wait([self = shared_from_this(), wait](const beast::error_code& ec) {
    if (!ec && wait == self->idle_waits_) self->close();
  });
  stream_.async_read_some(buffer_.prepare(kReadChunk),
                          [self = shared_from_this()](const beast::error_code& ec, std::size_t n) {
                            ++self->idle_waits_;  // this wait is over, even if its timer already fired
                            self->idle_timer_.cancel();
                            if (ec || self->closed_) return self->close();  // closed by the peer, or idle too long
                            self->buffer_.commit(n);
                            self->read_header();
                          });
}

void Connection::read_header() {
  stream_.expires_after(server_.options.header_timeout);
  http::async_read_header(stream_, buffer_, *parser_,
                          [self = shared_from_this()](const beast::error_code& ec, std::size_t) {
                            if (ec) return self->read_failed(ec);
                            self->read_body();
                          });
}

void Connection::read_body() {
  if (parser_->is_done()) return dispatch();
  stream_.expires_after(server_.options.body_timeout);
  http::async_read(stream_, buffer_, *parser_, [self = shared_from_this()](const beast::error_code& ec, std::size_t) {
    if (ec) return self->read_failed(ec);
    self->dispatch();
  });
}

void Connection::read_failed(const beast::error_code& ec) {
  if (ec != http::error::body_limit) return close();  // a malformed request, a timeout, or the peer went away
  // The body was not read, so the connection cannot be reused: answer and close.
  auto res = std::make_shared<http::response<http::string_body>>(http::status::payload_too_large, 11);
  res->set(http::field::content_type, "application/json");
  res->set("X-Amzn-ErrorType", "RequestEntityTooLarge");
  res->body() = R"({"message":"request body exceeds )" + std::to_string(server_.body_limit) + R"( bytes"})";
  res->keep_alive(false);
  res->prepare_payload();
  write(std::move(res));
}

void Connection::dispatch() {
  stream_.expires_never();  // the Api may take as long as a long-poll or a sample takes
  auto& req = parser_->get();
  keep_alive_ = req.keep_alive();
  version_ = req.version();
  sigv4::HttpRequest r;
  r.method = std::string(req.method_string());
  r.target = std::string(req.target());
  for (const auto& f : req) r.headers.emplace_back(std::string(f.name_string()), std::string(f.value()));
  r.body = std::move(req.body());
  parser_.reset();
  server_.api.handle_async(r, executor(), [self = shared_from_this()](Response res) { self->respond(std::move(res)); });
}

void Connection::respond(Response out) {
  if (closed_) return;
  if (out.stream) return start_stream(std::move(out));
  auto res = std::make_shared<http::response<http::string_body>>(static_cast<http::status>(out.status), version_);
  res->set(http::field::server, "rlloop-server");
  res->set(http::field::content_type, out.content_type);
  for (const auto& [k, v] : out.headers) res->set(k, v);
  res->body() = std::move(out.body);
  res->keep_alive(keep_alive_);
  res->prepare_payload();
  write(std::move(res));
}

// Writes a whole message, then reads the next request or closes, as the message says.
template <class Message>
void Connection::write(std::shared_ptr<Message> msg) {
  stream_.expires_after(server_.options.write_timeout);
  http::async_write(stream_, *msg, [self = shared_from_this(), msg](const beast::error_code& ec, std::size_t) {
    if (ec || !msg->keep_alive()) return self->close();
    self->read_request();
  });
}

void Connection::refuse(std::size_t cap) {
  auto res = std::make_shared<http::response<http::string_body>>(http::status::service_unavailable, 11);
  res->set(http::field::server, "rlloop-server");
  res->set(http::field::content_type, "application/json");
  res->set("X-Amzn-ErrorType", "ServiceUnavailableException");
  res->set(http::field::retry_after, "1");
  res->body() = nlohmann::json{{"message", "the server is serving its maximum of " + std::to_string(cap) +
                                               " connections; retry later"}}
                    .dump();
  res->keep_alive(false);
  res->prepare_payload();
  stream_.expires_after(kRefusalLinger);  // for the write and the drain together
  http::async_write(stream_, *res, [self = shared_from_this(), res](beast::error_code ec, std::size_t) {
    if (ec) return self->close();
    // Half-close, then read until the client closes: closing with its request unread would reset the connection,
    // which can discard the 503 before the client reads it.
    self->stream_.socket().shutdown(tcp::socket::shutdown_send, ec);
    self->drain();
  });
}

void Connection::drain() {
  buffer_.clear();
  stream_.async_read_some(buffer_.prepare(kReadChunk),
                          [self = shared_from_this()](const beast::error_code& ec, std::size_t) {
                            if (ec) return self->close();
                            self->drain();
                          });
}

void Connection::close() {
  if (closed_) return;
  closed_ = true;
  if (outbox_) {
    std::lock_guard lock(outbox_->mu);
    outbox_->abandoned = true;
    outbox_->room.notify_all();
  }
  server_.forget(this, counted_);  // before the client can see EOF
  idle_timer_.cancel();
  beast::error_code ec;
  stream_.socket().shutdown(tcp::socket::shutdown_both, ec);
  stream_.close();
}

// Headers with chunked transfer encoding now; then one chunk per piece the producer writes, as it writes them.
void Connection::start_stream(Response out) {
  auto head = std::make_shared<http::response<http::empty_body>>(static_cast<http::status>(out.status), version_);
  head->set(http::field::server, "rlloop-server");
  head->set(http::field::content_type, out.content_type);
  head->set(http::field::cache_control, "no-cache");
  for (const auto& [k, v] : out.headers) head->set(k, v);
  head->chunked(true);
  auto serializer = std::make_shared<http::response_serializer<http::empty_body>>(*head);
  outbox_ = std::make_shared<Outbox>();
  stream_.expires_after(server_.options.write_timeout);
  http::async_write_header(stream_, *serializer,
                           [self = shared_from_this(), head, serializer, producer = std::move(out.stream)](
                               const beast::error_code& ec, std::size_t) {
                             if (ec) return self->close();
                             asio::post(self->server_.streams,
                                        [self, box = self->outbox_, producer] { produce(self, box, producer); });
                           });
}

// On a stream thread: runs the producer, then lets the connection end the body.
void Connection::produce(std::shared_ptr<Connection> self, std::shared_ptr<Outbox> box,
                         std::function<void(const StreamWriter&)> producer) {
  bool failed = false;
  try {
    producer([&](std::string_view piece) { return offer(self, *box, piece); });
  } catch (const std::exception& e) {
    failed = true;
    self->server_.log({{"ts", unix_seconds()}, {"level", "error"}, {"event", "stream_failed"}, {"error", e.what()}});
  }
  std::unique_lock lock(box->mu);
  box->finished = true;
  box->failed = failed;
  if (std::exchange(box->writing, true)) return;  // the write under way ends the body
  lock.unlock();
  asio::post(self->executor(), [self] { self->pump(); });
}

// On a stream thread: queues one piece as a chunk, first waiting while the client is kStreamHighWater behind.
bool Connection::offer(const std::shared_ptr<Connection>& self, Outbox& box, std::string_view piece) {
  std::unique_lock lock(box.mu);
  if (box.abandoned || piece.empty()) return !box.abandoned;  // an empty chunk would end the body
  box.room.wait(lock, [&] { return box.abandoned || box.unsent < kStreamHighWater; });
  if (box.abandoned) return false;
  const std::size_t before = box.pending.size();
  append_chunk(box.pending, piece);
  box.unsent += box.pending.size() - before;
  if (std::exchange(box.writing, true)) return true;  // the write under way takes it next
  lock.unlock();
  asio::post(self->executor(), [self] { self->pump(); });
  return true;
}

// On the strand: writes what the producer queued; once it finished and all is written, the last chunk.
void Connection::pump() {
  if (closed_) return;
  std::string bytes;
  bool last = false, failed = false;
  {
    std::lock_guard lock(outbox_->mu);
    if (outbox_->pending.empty() && !outbox_->finished) {
      outbox_->writing = false;
      return;
    }
    bytes = std::exchange(outbox_->pending, {});
    last = outbox_->finished;
    failed = outbox_->failed;
  }
  if (last && failed) return close();
  const std::size_t queued = bytes.size();
  if (last) bytes += "0\r\n\r\n";
  auto buf = std::make_shared<std::string>(std::move(bytes));
  stream_.expires_after(server_.options.write_timeout);
  asio::async_write(stream_, asio::buffer(*buf),
                    [self = shared_from_this(), buf, queued, last](const beast::error_code& ec, std::size_t) {
                      if (ec) return self->close();
                      {
                        std::lock_guard lock(self->outbox_->mu);
                        self->outbox_->unsent -= queued;
                        self->outbox_->room.notify_all();
                      }
                      if (!last) return self->pump();
                      self->outbox_.reset();
                      if (!self->keep_alive_) return self->close();
                      self->read_request();
                    });
}

}  // namespace

struct Server::Impl : Core {
  using Core::Core;
  tcp::acceptor acceptor{asio::make_strand(io)};
  asio::steady_timer accept_retry{acceptor.get_executor()};
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work;
  std::vector<std::thread> io_threads;
  std::uint16_t port = 0;

  void accept();
  void on_accept(const beast::error_code& ec, tcp::socket socket);
};

void Server::Impl::accept() {
  acceptor.async_accept(asio::make_strand(io),
                        [this](const beast::error_code& ec, tcp::socket socket) { on_accept(ec, std::move(socket)); });
}

void Server::Impl::on_accept(const beast::error_code& ec, tcp::socket socket) {
  {
    std::lock_guard lock(mu);
    if (stopped) return;  // the socket closes here; stop() closes the listener
  }
  if (ec) {
    log({{"ts", unix_seconds()}, {"level", "error"}, {"event", "accept_failed"}, {"error", ec.message()}});
    accept_retry.expires_after(kAcceptRetry);
    accept_retry.async_wait([this](const beast::error_code& e) {
      if (!e) accept();
    });
    return;
  }
  beast::error_code ignored;
  socket.set_option(tcp::no_delay(true), ignored);
  std::shared_ptr<Connection> c;
  bool serve = false;
  {
    std::lock_guard lock(mu);
    if (stopped) return;
    serve = served < options.max_connections;
    if (serve) ++served;
    c = std::make_shared<Connection>(*this, std::move(socket), serve);
    connections.emplace(c.get(), c);
  }
  accept();
  if (!serve)
    log({{"ts", unix_seconds()},
         {"level", "warn"},
         {"event", "connection_refused"},
         {"maxConnections", options.max_connections}});
  asio::post(c->executor(), [c, serve, cap = options.max_connections] { serve ? c->serve() : c->refuse(cap); });
}

Server::Server(Options options, Backend backend)
    : impl_(std::make_unique<Impl>(std::move(options), std::move(backend))) {}

Server::~Server() { stop(); }

void Server::start() {
  Impl& im = *impl_;
  const tcp::endpoint endpoint(asio::ip::make_address(im.options.host), im.options.port);
  im.acceptor.open(endpoint.protocol());
  im.acceptor.set_option(asio::socket_base::reuse_address(true));
  beast::error_code ec;
  im.acceptor.bind(endpoint, ec);
  if (ec)
    throw io_error("cannot listen on " + im.options.host + ":" + std::to_string(im.options.port) + ": " + ec.message());
  im.acceptor.listen(asio::socket_base::max_listen_connections);
  im.port = im.acceptor.local_endpoint().port();
  im.work.emplace(im.io.get_executor());
  asio::post(im.acceptor.get_executor(), [&im] { im.accept(); });
  for (std::size_t i = 0; i < im.options.io_threads; ++i)
    im.io_threads.emplace_back([&im] {
      // A handler that throws must not take the server down with it.
      while (true) {
        try {
          im.io.run();
          return;
        } catch (const std::exception& e) {
          im.log({{"ts", unix_seconds()}, {"level", "error"}, {"event", "io_handler_failed"}, {"error", e.what()}});
        }
      }
    });
}

void Server::stop() {
  if (!impl_) return;
  Impl& im = *impl_;
  std::vector<std::shared_ptr<Connection>> open;
  {
    std::lock_guard lock(im.mu);
    if (im.stopped) return;
    im.stopped = true;
    for (auto& [raw, weak] : im.connections)
      if (auto c = weak.lock()) open.push_back(std::move(c));
  }
  asio::post(im.acceptor.get_executor(), [&im] {
    beast::error_code ec;
    im.acceptor.close(ec);
    im.accept_retry.cancel();
  });
  im.api.interrupt_waits();  // a long-poll would otherwise hold its connection until its deadline
  for (auto& c : open) asio::post(c->executor(), [c] { c->close(); });
  open.clear();
  // With the listener and every connection closed, the io threads run out of work and return.
  im.work.reset();
  for (auto& t : im.io_threads) t.join();
  im.io_threads.clear();
  im.streams.join();
  im.api.shutdown();
}

std::uint16_t Server::port() const { return impl_->port; }
Api& Server::api() { return impl_->api; }

}  // namespace rlloop::server
