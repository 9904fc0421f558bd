// Reading JSON Lines files for the env loaders: one object per non-empty line, errors name file and line.
#pragma once
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include <rlloop/error.hpp>

namespace rlloop::envs::detail {

// Calls fn(object, line_number) for each line; stops early when fn returns false.
template <class Fn>
void for_each_jsonl(const std::string& path, Fn&& fn) {
  std::ifstream in(path);
  if (!in) throw io_error("cannot open '" + path + "'");
  std::string line;
  std::size_t number = 0;
  while (std::getline(in, line)) {
    ++number;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::parse_error& e) {
      throw invalid_argument(path + ":" + std::to_string(number) + ": not JSON: " + e.what());
    }
    if (!j.is_object()) throw invalid_argument(path + ":" + std::to_string(number) + ": expected a JSON object");
    if (!fn(j, number)) return;
  }
}

// j[key] as a string; throws naming file, line and field when it is missing or not a string.
inline std::string required_string(const nlohmann::json& j, const char* key, const std::string& path,
                                   std::size_t line) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_string())
    throw invalid_argument(path + ":" + std::to_string(line) + ": field '" + key + "' missing or not a string");
  return it->get<std::string>();
}

inline std::string optional_string(const nlohmann::json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_string() ? it->get<std::string>() : std::string{};
}

}  // namespace rlloop::envs::detail
