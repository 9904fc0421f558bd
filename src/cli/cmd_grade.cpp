// `rlloop grade`: grade completions against code problems in the sandbox and print per-problem results and
// the pass rate. Problems: HumanEval JSONL or the stdin/stdout schema (envs/competitive_programming.hpp).
// Completions: {"task_id", "completion", "language"?} per line.
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include <rlloop/envs/competitive_programming.hpp>
#include <rlloop/envs/jsonl.hpp>
#include <rlloop/rewards/batch.hpp>
#include <rlloop/rewards/code.hpp>

#include "command.hpp"

namespace {

struct Completion {
  std::string task_id;
  std::string text;
  std::string language;  // empty: the problem's
};

std::vector<Completion> load_completions(const std::string& path) {
  std::vector<Completion> out;
  rlloop::envs::detail::for_each_jsonl(path, [&](const nlohmann::json& j, std::size_t line) {
    out.push_back({rlloop::envs::detail::required_string(j, "task_id", path, line),
                   rlloop::envs::detail::required_string(j, "completion", path, line),
                   rlloop::envs::detail::optional_string(j, "language")});
    return true;
  });
  return out;
}

int run(int argc, char** argv) {
  CLI::App app{"Grade code completions against unit tests in the sandbox", "rlloop grade"};
  std::vector<std::string> problem_files;
  std::string completions_file;
  std::string mode = "all-pass";
  double cpu_seconds = 2, wall_seconds = 6;
  int jobs = 0;
  bool verbose = false;
  app.add_option("--problems", problem_files, "problems JSONL (HumanEval or stdin/stdout schema); repeatable")
      ->required()
      ->check(CLI::ExistingFile);
  app.add_option("--completions", completions_file, "completions JSONL: {\"task_id\", \"completion\"}")
      ->required()
      ->check(CLI::ExistingFile);
  app.add_option("--mode", mode, "score per problem: all-pass (1/0) or pass-rate (fraction of tests)")
      ->check(CLI::IsMember({"all-pass", "pass-rate"}));
  app.add_option("--cpu-seconds", cpu_seconds, "CPU limit per test run");
  app.add_option("--wall-seconds", wall_seconds, "wall-clock limit per test run");
  app.add_option("--jobs", jobs, "completions graded at once (0 = one per core)");
  app.add_flag("-v,--verbose", verbose, "print the failure details of every problem");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  std::map<std::string, rlloop::rewards::CodeProblem> problems;
  for (const auto& f : problem_files)
    for (auto& p : rlloop::envs::load_code_problems(f)) problems[p.task_id] = std::move(p);
  const auto completions = load_completions(completions_file);

  rlloop::rewards::CodeRewardOptions opts;
  opts.mode =
      mode == "pass-rate" ? rlloop::rewards::CodeRewardMode::pass_rate : rlloop::rewards::CodeRewardMode::all_pass;
  opts.limits.cpu_seconds = cpu_seconds;
  opts.limits.wall_seconds = wall_seconds;
  const rlloop::rewards::CodeReward reward(opts);

  std::vector<rlloop::rewards::CodeGrade> grades(completions.size());
  std::vector<std::string> missing(completions.size());
  rlloop::rewards::detail::parallel_indices(completions.size(), {.max_concurrency = jobs}, [&](std::size_t i) {
    const auto& c = completions[i];
    auto it = problems.find(c.task_id);
    if (it == problems.end()) {
      missing[i] = "no problem with this task_id";
      return;
    }
    const auto lang = c.language.empty() ? it->second.language : rlloop::sandbox::parse_language(c.language);
    grades[i] = reward.grade_program(it->second, lang, c.text);
  });

  int solved = 0;
  double total = 0;
  for (std::size_t i = 0; i < completions.size(); ++i) {
    const auto& g = grades[i];
    if (!missing[i].empty()) {
      std::printf("%-28s %-5s %s\n", completions[i].task_id.c_str(), "SKIP", missing[i].c_str());
      continue;
    }
    const bool pass = g.passed == g.total;
    solved += pass;
    total += g.score.value;
    std::printf("%-28s %-5s %d/%d tests  %s\n", completions[i].task_id.c_str(), pass ? "PASS" : "FAIL", g.passed,
                g.total, std::string(rlloop::to_string(g.score.status)).c_str());
    if (verbose && !pass) std::printf("    %s\n", g.score.details.c_str());
  }
  const double n = static_cast<double>(completions.size());
  std::printf("passed %d/%zu problems (pass rate %.3f), mean score %.3f\n", solved, completions.size(),
              n > 0 ? solved / n : 0.0, n > 0 ? total / n : 0.0);
  return 0;
}

rlloop::cli::RegisterCommand reg({"grade", "grade code completions against unit tests in the sandbox", &run});

}  // namespace
