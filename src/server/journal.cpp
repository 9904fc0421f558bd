#include "server/journal.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <rlloop/error.hpp>

namespace rlloop::server {

Journal::Journal(const std::string& dir) : dir_(dir), path_((std::filesystem::path(dir) / "journal.jsonl").string()) {
  std::filesystem::create_directories(dir);
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
  if (fd_ < 0) throw io_error("cannot open journal '" + path_ + "': " + std::strerror(errno));
  // A crash can leave a partial last line; end it so the next record starts on a line of its own.
  const auto size = std::filesystem::file_size(path_);
  if (size > 0) {
    std::ifstream in(path_, std::ios::binary);
    in.seekg(static_cast<std::streamoff>(size) - 1);
    if (in.get() != '\n' && ::write(fd_, "\n", 1) != 1) throw io_error("cannot write journal '" + path_ + "'");
  }
}

Journal::~Journal() {
  if (fd_ >= 0) ::close(fd_);
}

void Journal::append(const nlohmann::json& record) {
  const std::string line = record.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  std::lock_guard lock(mu_);
  std::size_t done = 0;
  while (done < line.size()) {
    const ssize_t n = ::write(fd_, line.data() + done, line.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw io_error("cannot write journal '" + path_ + "': " + std::strerror(errno));
    done += static_cast<std::size_t>(n);
  }
  if (::fdatasync(fd_) != 0) throw io_error("cannot fsync journal '" + path_ + "': " + std::strerror(errno));
}

std::vector<nlohmann::json> Journal::read_all() const {
  std::vector<nlohmann::json> out;
  std::ifstream in(path_, std::ios::binary);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_discarded() && j.is_object()) out.push_back(std::move(j));  // a torn last line is skipped
  }
  return out;
}

}  // namespace rlloop::server
