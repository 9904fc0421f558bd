// Per-step metrics: one JSON object per line (JSONL), kept in memory too for callbacks and plots.
#pragma once
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <rlloop/error.hpp>

namespace rlloop {

class MetricsLog {
 public:
  explicit MetricsLog(const std::string& path) : path_(path), out_(path, std::ios::trunc) {
    if (!out_) throw io_error("MetricsLog: cannot write '" + path + "'");
  }
  // Appends one record; flushed at once so a killed run keeps every finished step.
  void write(const nlohmann::json& record) {
    out_ << record.dump() << '\n';
    out_.flush();
    records_.push_back(record);
  }
  const std::vector<nlohmann::json>& records() const { return records_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::ofstream out_;
  std::vector<nlohmann::json> records_;
};

}  // namespace rlloop
