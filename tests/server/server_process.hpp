// Runs `rlloop serve` as a child process for tests that need a real server process (kill -9, restarts).
#pragma once
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <boost/asio.hpp>

namespace test_server {

// A loopback port nobody listens on now (the kernel's pick for an ephemeral bind).
inline std::uint16_t free_port() {
  boost::asio::io_context io;
  boost::asio::ip::tcp::acceptor a(io, {boost::asio::ip::make_address("127.0.0.1"), 0});
  return a.local_endpoint().port();
}

inline bool accepts(std::uint16_t port) {
  boost::asio::io_context io;
  boost::asio::ip::tcp::socket s(io);
  boost::system::error_code ec;
  s.connect({boost::asio::ip::make_address("127.0.0.1"), port}, ec);
  return !ec;
}

class ServeProcess {
 public:
  ServeProcess(std::string binary, std::vector<std::string> args, std::string log_path)
      : binary_(std::move(binary)), args_(std::move(args)), log_(std::move(log_path)) {}
  ~ServeProcess() { kill(SIGKILL); }

  void start() {
    starts_seen_ = listening_ports().size();
    pid_ = ::fork();
    if (pid_ < 0) throw std::runtime_error("fork failed");
    if (pid_ == 0) {
      const int fd = ::open(log_.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      if (fd >= 0) {
        ::dup2(fd, 1);
        ::dup2(fd, 2);
      }
      std::vector<char*> argv{const_cast<char*>(binary_.c_str()), const_cast<char*>("serve")};
      for (auto& a : args_) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv(binary_.c_str(), argv.data());
      ::_exit(127);
    }
  }
  // Waits until this start of the server says in its log that it listens on `port` (the server recovered and
  // listens) and the port accepts connections; false on timeout or exit. Accepting alone is not enough: a test
  // running beside this one may bind the port free_port() just released, and then this server exits on the
  // bind while a client would talk to the stranger ("the bearer key is not valid").
  bool wait_listening(std::uint16_t port, std::chrono::seconds timeout = std::chrono::seconds(60)) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      const std::vector<std::uint16_t> ports = listening_ports();
      if (ports.size() > starts_seen_ && ports.back() == port && accepts(port)) return true;
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return false;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
  }
  pid_t pid() const { return pid_; }  // -1 when not running
  void kill(int sig) {
    if (pid_ <= 0) return;
    ::kill(pid_, sig);
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
  }

 private:
  // The ports of the log's {"event":"listening",...,"port":N,...} lines (rlloop serve prints one per start).
  std::vector<std::uint16_t> listening_ports() const {
    std::vector<std::uint16_t> ports;
    std::ifstream in(log_);
    const std::string key = "\"port\":";
    for (std::string line; std::getline(in, line);) {
      const auto at = line.find(key);
      if (line.find("\"event\":\"listening\"") != std::string::npos && at != std::string::npos)
        ports.push_back(static_cast<std::uint16_t>(std::stoul(line.substr(at + key.size()))));
    }
    return ports;
  }

  std::string binary_;
  std::vector<std::string> args_;
  std::string log_;
  pid_t pid_ = -1;
  std::size_t starts_seen_ = 0;  // listening lines in the log before the latest start()
};

}  // namespace test_server
