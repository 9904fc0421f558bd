// Competitive-programming and function-completion problems from JSONL, graded by the code reward.
// Accepted line schemas (one per line, mixed freely):
//   stdin/stdout: {"task_id", "prompt", "tests": [{"input", "output"}], "language"?, "solution"?}
//                 also {"inputs": [...], "outputs": [...]} instead of "tests" (TACO / APPS style)
//   HumanEval:    {"task_id", "prompt", "test", "entry_point", "canonical_solution"?}
// The shipped set lives in data/problems/problems.jsonl.
#pragma once
#include <string>
#include <vector>

#include <rlloop/env.hpp>
#include <rlloop/envs/jsonl.hpp>
#include <rlloop/rewards/code.hpp>

namespace rlloop::envs {

using rewards::CodeProblem;

namespace detail {
inline CodeProblem parse_code_problem(const nlohmann::json& j, const std::string& path, std::size_t line) {
  const std::string where = path + ":" + std::to_string(line) + ": ";
  CodeProblem p;
  p.task_id = required_string(j, "task_id", path, line);
  p.prompt = required_string(j, "prompt", path, line);
  if (auto lang = optional_string(j, "language"); !lang.empty()) p.language = sandbox::parse_language(lang);
  if (j.contains("test")) {  // HumanEval
    p.test_code = required_string(j, "test", path, line);
    p.entry_point = required_string(j, "entry_point", path, line);
    p.reference_solution = optional_string(j, "canonical_solution");
  } else if (j.contains("tests")) {
    if (!j["tests"].is_array() || j["tests"].empty())
      throw invalid_argument(where + "'tests' must be a non-empty array");
    for (const auto& t : j["tests"]) {
      if (!t.is_object() || !t.contains("input") || !t.contains("output") || !t["input"].is_string() ||
          !t["output"].is_string())
        throw invalid_argument(where + "each test needs string 'input' and 'output'");
      p.tests.push_back({t["input"].get<std::string>(), t["output"].get<std::string>()});
    }
  } else if (j.contains("inputs") && j.contains("outputs")) {
    const auto& in = j["inputs"];
    const auto& out = j["outputs"];
    if (!in.is_array() || !out.is_array() || in.size() != out.size() || in.empty())
      throw invalid_argument(where + "'inputs' and 'outputs' must be non-empty arrays of equal length");
    for (std::size_t i = 0; i < in.size(); ++i)
      p.tests.push_back({in[i].get<std::string>(), out[i].get<std::string>()});
  } else {
    throw invalid_argument(where + "problem '" + p.task_id + "' has no tests ('tests', 'inputs'/'outputs' or 'test')");
  }
  if (p.reference_solution.empty()) p.reference_solution = optional_string(j, "solution");
  return p;
}
}  // namespace detail

inline std::vector<CodeProblem> load_code_problems(const std::string& path) {
  std::vector<CodeProblem> out;
  detail::for_each_jsonl(path, [&](const nlohmann::json& j, std::size_t line) {
    out.push_back(detail::parse_code_problem(j, path, line));
    return true;
  });
  return out;
}

using CodeEnv = SingleTurnEnv<CodeProblem, rewards::CodeReward>;

inline CodeEnv code_env(CodeProblem problem, rewards::CodeReward reward) {
  return CodeEnv(std::move(problem), std::move(reward));
}

}  // namespace rlloop::envs
