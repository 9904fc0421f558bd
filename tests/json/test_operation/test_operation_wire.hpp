// The SageMaker binding of the throwaway operation of test_operation.hpp: a training-call member "testOperation"
// with a "text" member, answered by {"echoed": ...}. Included by src/wire/operations.hpp in the test-only build.
#pragma once
#include <string>

namespace rlloop::wire {

struct TestOp {
  std::string text;
  bool operator==(const TestOp&) const = default;
};
struct TestResult {
  std::string echoed;
};

template <>
struct Binding<op::Test> : Bound<Call::training, TestOp, TestResult> {
  static constexpr const char* name = "testOperation";
  static json write(const TestOp& r) { return {{"text", r.text}}; }
  static TestOp read(const json& c, const std::string& path) {
    read::only_keys(c, path, {"text"});
    return TestOp{read::string(read::need(c, path, "text"), read::join(path, "text"))};
  }
  static json write_result(const TestResult& r) { return {{"echoed", r.echoed}}; }
  static TestResult read_result(const json& c, const std::string& path) {
    return TestResult{read::string(read::need(c, path, "echoed"), read::join(path, "echoed"))};
  }
};

}  // namespace rlloop::wire
