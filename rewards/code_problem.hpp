// A programming problem as the code reward sees it. Two test styles (a problem uses one):
//  - stdin/stdout: `tests` lists inputs and expected outputs (CodeContests / LiveCodeBench / TACO style);
//    the completion is a whole program.
//  - assert-based: `test_code` defines check(candidate) and `entry_point` names the function
//    (HumanEval / MBPP style); the program is prompt + completion + test_code + "check(entry_point)".
#pragma once
#include <string>
#include <vector>

#include <rlloop/sandbox.hpp>

namespace rlloop::rewards {

struct IoTest {
  std::string input;
  std::string output;
};

struct CodeProblem {
  std::string task_id;
  std::string prompt;  // what the model sees
  sandbox::Language language = sandbox::Language::python;
  std::vector<IoTest> tests;
  std::string test_code;
  std::string entry_point;
  std::string reference_solution;  // optional; a completion that passes (shipped problems all have one)

  bool assert_style() const noexcept { return !test_code.empty(); }
};

}  // namespace rlloop::rewards
