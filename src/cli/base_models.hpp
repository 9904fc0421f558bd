// The --base-model NAME=MODEL_DIR entries of the commands that host sessions (serve, worker).
#pragma once
#include <string>
#include <utility>
#include <vector>

#include <rlloop/error.hpp>

namespace rlloop::cli {

inline std::vector<std::pair<std::string, std::string>> parse_base_models(const std::vector<std::string>& entries) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& entry : entries) {
    const auto eq = entry.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == entry.size())
      throw invalid_argument("--base-model expects NAME=MODEL_DIR, got '" + entry + "'");
    out.emplace_back(entry.substr(0, eq), entry.substr(eq + 1));
  }
  return out;
}

}  // namespace rlloop::cli
