// Data the tests read that the repository never holds (GSM8K, the AWS SigV4 test suite): files under
// $RLLOOP_DATA_DIR, by default ../shared/data beside the checkout. Where a file is missing the test is skipped
// with a message naming it and where it comes from; under CI=true (what CI sets) it fails instead, so CI cannot
// pass without the data.
#pragma once
#include <cstdlib>
#include <filesystem>
#include <string>

#include <gtest/gtest.h>

namespace rlloop::testing {

inline std::filesystem::path data_dir() {
  if (const char* dir = std::getenv("RLLOOP_DATA_DIR"); dir && *dir) return dir;
  return std::filesystem::path(RLLOOP_SOURCE_DIR) / ".." / "shared" / "data";
}

inline std::filesystem::path data_file(const std::string& relative) { return data_dir() / relative; }

inline bool running_in_ci() {
  const char* ci = std::getenv("CI");
  return ci && std::string(ci) == "true";
}

inline std::string missing_data_message(const std::filesystem::path& path, const std::string& origin) {
  return path.string() + " is missing (" + origin + "); set RLLOOP_DATA_DIR to the folder that holds " +
         "gsm8k/ and sigv4/ (default ../shared/data)";
}

}  // namespace rlloop::testing

// At the top of a test (or a fixture's SetUp): skips it when `path` does not exist, fails it under CI=true.
#define RLLOOP_REQUIRE_DATA(path, origin)                                                          \
  do {                                                                                             \
    if (!std::filesystem::exists(path)) {                                                          \
      if (::rlloop::testing::running_in_ci()) FAIL() << ::rlloop::testing::missing_data_message(path, origin); \
      GTEST_SKIP() << ::rlloop::testing::missing_data_message(path, origin);                       \
    }                                                                                              \
  } while (0)
