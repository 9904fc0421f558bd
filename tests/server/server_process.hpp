// Runs `rlloop serve` as a child process for tests that need a real server process (kill -9, restarts).
#pragma once
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <boost/asio.hpp>

namespace test_server {

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
  // Waits until this start of the server logs the port it listens on (pass --port 0: the kernel picks a free
  // one, so no test beside this one can take it first) and that port accepts connections; nullopt on timeout or
  // exit. Only this start's line counts: an earlier start's port may be dead or reused by now.
  std::optional<std::uint16_t> wait_listening(std::chrono::seconds timeout = std::chrono::seconds(60)) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      const std::vector<std::uint16_t> ports = listening_ports();
      if (ports.size() > starts_seen_ && accepts(ports.back())) return ports.back();
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return std::nullopt;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return std::nullopt;
  }
  // Later starts bind `port` (one an earlier start got from --port 0), so clients keep their endpoint.
  void reuse_port(std::uint16_t port) {
    for (std::size_t i = 0; i + 1 < args_.size(); ++i)
      if (args_[i] == "--port") {
        args_[i + 1] = std::to_string(port);
        return;
      }
    throw std::logic_error("reuse_port: the server's arguments have no --port");
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
      if (in.eof()) break;  // no newline yet: the line may still be half written
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
