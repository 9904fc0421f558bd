// Code grading in the sandbox, its correctness half (hostile_test.cpp is the other): the shipped problems'
// reference solutions pass, wrong solutions fail, and pass_rate / all_pass modes give the right values.
#include <gtest/gtest.h>

#include <oneapi/tbb/global_control.h>

#include <rlloop/envs/competitive_programming.hpp>
#include <rlloop/rewards/batch.hpp>
#include <rlloop/rewards/code.hpp>

using namespace rlloop;
using namespace rlloop::rewards;

namespace {
std::string data(const std::string& name) { return std::string(RLLOOP_SOURCE_DIR) + "/data/problems/" + name; }

const std::vector<CodeProblem>& all_problems() {
  static const auto problems = [] {
    auto p = envs::load_code_problems(data("problems.jsonl"));
    auto f = envs::load_code_problems(data("function_problems.jsonl"));
    p.insert(p.end(), f.begin(), f.end());
    return p;
  }();
  return problems;
}

const CodeProblem& problem(const std::string& id) {
  for (const auto& p : all_problems())
    if (p.task_id == id) return p;
  throw std::runtime_error("no problem " + id);
}

std::shared_ptr<const sandbox::Sandbox> shared_sandbox() {
  static auto sb = std::make_shared<const sandbox::Sandbox>();
  return sb;
}
}  // namespace

TEST(Problems, ShippedSetIsComplete) {
  const auto stdio = envs::load_code_problems(data("problems.jsonl"));
  EXPECT_GE(stdio.size(), 30u);
  for (const auto& p : all_problems()) {
    EXPECT_FALSE(p.reference_solution.empty()) << p.task_id;
    EXPECT_TRUE(p.assert_style() || p.tests.size() >= 3) << p.task_id;
  }
}

TEST(Problems, EveryReferenceSolutionPasses) {
  tbb::global_control parallelism(tbb::global_control::max_allowed_parallelism, 4);
  std::vector<std::string> refs;
  for (const auto& p : all_problems()) refs.push_back(p.reference_solution);
  const CodeReward reward(shared_sandbox(), {.mode = CodeRewardMode::all_pass});
  const auto scores = score_batch(reward, all_problems(), refs);
  for (std::size_t i = 0; i < scores.size(); ++i) {
    EXPECT_EQ(scores[i].value, 1.0) << all_problems()[i].task_id << ": " << scores[i].details;
    EXPECT_EQ(scores[i].status, ScoreStatus::ok) << all_problems()[i].task_id;
  }
}

TEST(Problems, WrongSolutionsFail) {
  struct Case {
    const char* id;
    const char* code;
    ScoreStatus status;
  };
  const Case cases[] = {
      {"cp/sum-two", "a, b = map(int, input().split())\nprint(a - b)\n", ScoreStatus::wrong_answer},
      {"cp/fizzbuzz", "n = int(input())\nfor i in range(1, n):\n    print(i)\n", ScoreStatus::wrong_answer},
      {"cp/average", "n = int(input())\nprint(sum(map(int, input().split())) // n)\n", ScoreStatus::wrong_answer},
      {"cp/reverse-string", "print(input()\n", ScoreStatus::runtime_error},  // syntax error
      {"cp/factorial", "import math\nprint(math.factorial(int(input()) + 1))\n", ScoreStatus::wrong_answer},
      {"cp/collatz-steps", "while True: pass\n", ScoreStatus::timeout},
      // skips the last number
      {"cp/cpp-sum-array",
       "#include <iostream>\nint main(){long long n,s=0,x;std::cin>>n;while(--n>0){std::cin>>x;s+=x;}std::cout<<s;}\n",
       ScoreStatus::wrong_answer},
      {"cp/cpp-lcm", "#include <iostream>\nint main(){ std::cout << a * b; }\n", ScoreStatus::compile_error},
      {"fn/add", "    return a - b\n", ScoreStatus::runtime_error},  // AssertionError
      {"fn/median", "    return sorted(xs)[len(xs) // 2]\n", ScoreStatus::runtime_error},
      {"fn/flatten", "    return xs\n", ScoreStatus::runtime_error},
  };
  tbb::global_control parallelism(tbb::global_control::max_allowed_parallelism, 4);
  CodeRewardOptions opts;
  opts.limits.cpu_seconds = 1;
  opts.stop_at_first_failure = true;
  const CodeReward reward(shared_sandbox(), opts);
  std::vector<CodeProblem> problems;
  std::vector<std::string> codes;
  for (const auto& c : cases) problems.push_back(problem(c.id)), codes.push_back(c.code);
  const auto scores = score_batch(reward, problems, codes);
  for (std::size_t i = 0; i < scores.size(); ++i) {
    EXPECT_LT(scores[i].value, 1.0) << cases[i].id << ": " << scores[i].details;
    EXPECT_EQ(scores[i].status, cases[i].status)
        << cases[i].id << ": " << to_string(scores[i].status) << " " << scores[i].details;
  }
}

TEST(Problems, PassRateAndAllPassModes) {
  // Calls 1 prime: fails exactly 1 of the 5 is-prime tests.
  const std::string almost =
      "n = int(input())\nprint('YES' if n == 1 or all(n % d for d in range(2, int(n**0.5) + 1)) else 'NO')\n";
  const auto& p = problem("cp/is-prime");
  const CodeReward rate(shared_sandbox(), {.mode = CodeRewardMode::pass_rate});
  const CodeGrade g = rate.grade(p, almost);
  EXPECT_EQ(g.passed, 4);
  EXPECT_EQ(g.total, 5);
  EXPECT_DOUBLE_EQ(g.score.value, 0.8);
  EXPECT_EQ(g.score.status, ScoreStatus::wrong_answer);
  EXPECT_NE(g.score.details.find("4/5 tests passed"), std::string::npos) << g.score.details;
  const CodeReward all(shared_sandbox(), {.mode = CodeRewardMode::all_pass});
  EXPECT_EQ(all(p, almost).value, 0.0);
}

TEST(Problems, FencedCompletionsAndFloatTolerance) {
  const CodeReward reward(shared_sandbox());
  const Score fenced = reward(problem("cp/sum-two"),
                              "Here you go:\n```python\na, b = map(int, input().split())\nprint(a + b)\n```\nDone.");
  EXPECT_EQ(fenced.value, 1.0) << fenced.details;
  // Prints the area with a different number of digits: within 1e-6, so accepted.
  const Score area =
      reward(problem("cp/circle-area"), "r = float(input())\nprint('%.9f' % (3.14159265358979 * r * r))\n");
  EXPECT_EQ(area.value, 1.0) << area.details;
}

TEST(Problems, LoaderRejectsBrokenFiles) { EXPECT_THROW(envs::load_code_problems("/nonexistent.jsonl"), io_error); }
