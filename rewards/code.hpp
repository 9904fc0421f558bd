// Code reward: run the completion against the problem's tests in the sandbox. Value = fraction of tests
// passed (pass_rate) or 1/0 (all_pass). Compile errors, crashes, timeouts and hostile programs are failures
// recorded in the Score, never exceptions. Link rlloop::sandbox.
#pragma once
#include <memory>
#include <string>
#include <string_view>

#include <rlloop/error.hpp>
#include <rlloop/reward.hpp>
#include <rlloop/rewards/code_problem.hpp>
#include <rlloop/rewards/compare.hpp>
#include <rlloop/sandbox.hpp>

namespace rlloop::rewards {

enum class CodeRewardMode { pass_rate, all_pass };

struct CodeRewardOptions {
  CodeRewardMode mode = CodeRewardMode::pass_rate;
  sandbox::Limits limits = default_limits();  // each test run
  sandbox::Limits compile_limits = sandbox::Program::compile_defaults();
  OutputCompare compare;
  // Take the first ``` fenced block when the completion has one (chat models wrap code in markdown).
  bool extract_fenced_code = true;
  // Skip the remaining tests after a failure (always so in all_pass mode: the value is 0 anyway).
  bool stop_at_first_failure = false;

  static sandbox::Limits default_limits() {
    sandbox::Limits l;
    l.cpu_seconds = 2;
    l.wall_seconds = 6;
    return l;
  }
  void validate() const {
    limits.validate();
    compile_limits.validate();
    compare.validate();
  }
};

// The code inside the first ``` fence (language tag dropped), or the whole completion when it has none.
inline std::string extract_code(std::string_view completion) {
  const auto open = completion.find("```");
  if (open == std::string_view::npos) return std::string(completion);
  auto body_start = completion.find('\n', open);
  if (body_start == std::string_view::npos) return std::string(completion);
  ++body_start;
  const auto close = completion.find("```", body_start);
  return std::string(
      completion.substr(body_start, close == std::string_view::npos ? std::string_view::npos : close - body_start));
}

// The program the sandbox runs for `problem` given the model's code.
inline std::string assemble_program(const CodeProblem& problem, const std::string& code) {
  if (!problem.assert_style()) return code;
  if (problem.language == sandbox::Language::python)
    return problem.prompt + code + "\n\n" + problem.test_code + "\n\ncheck(" + problem.entry_point + ")\n";
  return problem.prompt + code + "\n\n" + problem.test_code + "\n";  // C++: test_code brings main()
}

struct CodeGrade {
  int passed = 0;
  int total = 0;
  Score score;
};

class CodeReward {
 public:
  explicit CodeReward(CodeRewardOptions opts = {})
      : CodeReward(std::make_shared<const sandbox::Sandbox>(), std::move(opts)) {}
  CodeReward(std::shared_ptr<const sandbox::Sandbox> sb, CodeRewardOptions opts = {})
      : sb_(std::move(sb)), opts_(std::move(opts)) {
    if (!sb_) throw invalid_argument("CodeReward: sandbox must not be null");
    opts_.validate();
  }

  Score operator()(const CodeProblem& problem, std::string_view completion) const {
    return grade(problem, completion).score;
  }

  CodeGrade grade(const CodeProblem& problem, std::string_view completion) const {
    return grade_program(problem, problem.language, completion);
  }

  // As grade(), with the language given explicitly (a completion file may say which language it is in).
  CodeGrade grade_program(const CodeProblem& problem, sandbox::Language lang, std::string_view completion) const {
    if (!problem.assert_style() && problem.tests.empty())
      throw invalid_argument("CodeReward: problem '" + problem.task_id + "' has neither tests nor test_code");
    const std::string code = opts_.extract_fenced_code ? extract_code(completion) : std::string(completion);
    CodeProblem effective = problem;
    effective.language = lang;
    const sandbox::Program program(*sb_, lang, assemble_program(effective, code), opts_.compile_limits);

    CodeGrade g;
    g.total = problem.assert_style() ? 1 : static_cast<int>(problem.tests.size());
    Score first_failure{0.0, ScoreStatus::ok, {}};
    const bool stop = opts_.stop_at_first_failure || opts_.mode == CodeRewardMode::all_pass;
    if (!program.compiled()) {
      first_failure = {0.0, ScoreStatus::compile_error, "compile error: " + clip_text(program.compile_log(), 400)};
    } else {
      for (int i = 0; i < g.total; ++i) {
        const std::string_view input =
            problem.assert_style() ? std::string_view{} : std::string_view(problem.tests[i].input);
        const auto run = program.run(input, opts_.limits);
        Score t = judge(problem, i, run);
        if (t.ok()) {
          ++g.passed;
        } else if (first_failure.ok()) {
          first_failure = std::move(t);
          if (stop) break;
        }
      }
    }
    const double rate = g.total ? static_cast<double>(g.passed) / g.total : 0.0;
    g.score.value = opts_.mode == CodeRewardMode::pass_rate ? rate : (g.passed == g.total ? 1.0 : 0.0);
    g.score.status = first_failure.status;
    g.score.details = std::to_string(g.passed) + "/" + std::to_string(g.total) + " tests passed";
    if (!first_failure.ok()) g.score.details += "; " + first_failure.details;
    return g;
  }

  const CodeRewardOptions& options() const noexcept { return opts_; }
  const sandbox::Sandbox& sandbox() const noexcept { return *sb_; }

 private:
  static std::string clip_text(std::string_view s, std::size_t n) {
    std::string out(s.substr(0, n));
    if (s.size() > n) out += "...";
    return out;
  }

  Score judge(const CodeProblem& problem, int i, const sandbox::RunResult& r) const {
    using sandbox::Outcome;
    const std::string where = "test " + std::to_string(i + 1) + ": ";
    switch (r.outcome) {
      case Outcome::timeout:
      case Outcome::cpu_limit:
        return {0, ScoreStatus::timeout, where + "time limit exceeded"};
      case Outcome::output_limit:
        return {0, ScoreStatus::output_limit, where + "output limit exceeded"};
      case Outcome::sandbox_error:
        return {0, ScoreStatus::sandbox_error, where + clip_text(r.stderr_data, 200)};
      case Outcome::signaled:
        return {0, ScoreStatus::runtime_error, where + "killed by signal " + std::to_string(r.signal)};
      case Outcome::exited:
        break;
    }
    if (r.exit_code != 0)
      return {0, ScoreStatus::runtime_error,
              where + "exit code " + std::to_string(r.exit_code) + ": " + clip_text(last_line(r.stderr_data), 200)};
    if (problem.assert_style()) return {1, ScoreStatus::ok, {}};
    if (outputs_match(problem.tests[i].output, r.stdout_data, opts_.compare)) return {1, ScoreStatus::ok, {}};
    return {0, ScoreStatus::wrong_answer,
            where + "wrong answer: expected '" + clip_text(problem.tests[i].output, 60) + "', got '" +
                clip_text(r.stdout_data, 60) + "'"};
  }

  static std::string_view last_line(std::string_view s) {
    while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.remove_suffix(1);
    const auto nl = s.rfind('\n');
    return nl == std::string_view::npos ? s : s.substr(nl + 1);
  }

  std::shared_ptr<const sandbox::Sandbox> sb_;
  CodeRewardOptions opts_;
};

}  // namespace rlloop::rewards
