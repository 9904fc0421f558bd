// A throwaway operation, appended to rlloop::Operations only in the test-only build of operation_list_test
// (RLLOOP_TEST_OPERATION): its descriptor, and nothing else in src/, is what the test adds.
#pragma once
#include <string>

#include <rlloop/future.hpp>

namespace rlloop::op {

struct TestOutput {
  std::string echoed;
};

struct Test {
  static constexpr std::string_view name = "test_operation";
  static constexpr bool mutates = true, replayed = true, autosaved = false;
  using Result = TestOutput;
  using Params = op::Params<const std::string&>;
  static auto call(auto& s, const std::string& text) -> decltype(s.test_operation(text)) {
    return s.test_operation(text);
  }
  template <class Self>
  struct Method {
    Future<Result> test_operation(const std::string& text) { return run<Test>(static_cast<Self&>(*this), text); }
  };
};

}  // namespace rlloop::op
