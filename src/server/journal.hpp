// The server's durable record: an append-only file of JSON lines under --data-dir, each fsync'd before append()
// returns, so whatever the server reported (an accepted operation id, a Completed result, a checkpoint ARN) is
// still known after a crash. A line cut short by a crash is ignored on reading.
#pragma once
#include <mutex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace rlloop::server {

class Journal {
 public:
  // Opens (creating) <dir>/journal.jsonl for appending; throws io_error.
  explicit Journal(const std::string& dir);
  ~Journal();
  Journal(const Journal&) = delete;
  Journal& operator=(const Journal&) = delete;

  // Writes one record and fsyncs it. Thread-safe.
  void append(const nlohmann::json& record);
  // Every complete record written so far, oldest first (read once at start-up).
  std::vector<nlohmann::json> read_all() const;
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
  std::string path_;
  int fd_ = -1;
  std::mutex mu_;
};

}  // namespace rlloop::server
