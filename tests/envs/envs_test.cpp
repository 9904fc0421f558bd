// Env concept, groups, GSM8K and code envs, and the multi-turn guess-the-number env.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>

#include <rlloop/env.hpp>
#include <rlloop/envs/competitive_programming.hpp>
#include <rlloop/envs/gsm8k.hpp>
#include <rlloop/envs/guess_number.hpp>

#include "external_data.hpp"

using namespace rlloop;
using namespace rlloop::envs;

static_assert(Env<Gsm8kEnv>);
static_assert(Env<CodeEnv>);
static_assert(Env<GuessNumberEnv>);
static_assert(!Env<int>);
static_assert(!Env<rewards::MathAnswerReward>);

TEST(Groups, CopiesAreIndependentEpisodes) {
  MathProblem p{.id = "x", .question = "2+2?", .solution = "#### 4", .answer = "4", .prompt = "2+2?"};
  auto group = make_group(gsm8k_env(p), 4);
  ASSERT_EQ(group.size(), 4u);
  std::vector<double> r;
  const char* answers[] = {"#### 4", "#### 5", "\\boxed{4}", "four"};
  for (std::size_t i = 0; i < group.size(); ++i) {
    EXPECT_EQ(group[i].reset(), "2+2?");
    r.push_back(group[i].step(answers[i]).reward.value);
  }
  EXPECT_EQ(r, (std::vector<double>{1, 0, 1, 0}));
  EXPECT_THROW(make_group(gsm8k_env(p), 0), invalid_argument);

  const std::vector<MathProblem> problems(3, p);
  const auto groups = make_groups(problems, 5, [](const MathProblem& q) { return gsm8k_env(q); });
  EXPECT_EQ(groups.size(), 3u);
  EXPECT_EQ(groups[2].size(), 5u);
}

TEST(Gsm8kEnv, LoadsRealDataAndGradesTheReferenceSolution) {
  const auto path = rlloop::testing::data_file("gsm8k/train.jsonl");
  RLLOOP_REQUIRE_DATA(path, "GSM8K's train split, github.com/openai/grade-school-math");
  const auto problems = load_gsm8k(path, {.limit = 20});
  ASSERT_EQ(problems.size(), 20u);
  for (const auto& p : problems) {
    auto env = gsm8k_env(p);
    env.reset();
    EXPECT_EQ(env.step(p.solution).reward.value, 1.0) << p.id;
  }
}

TEST(Gsm8kEnv, BadFilesGiveClearErrors) {
  EXPECT_THROW(load_gsm8k("/nonexistent/gsm8k.jsonl"), io_error);
  const auto dir = std::filesystem::temp_directory_path() / ("rlloop-envs-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  { std::ofstream(dir / "bad.jsonl") << "{\"question\": \"q\", \"answer\": \"no final answer\"}\n"; }
  try {
    load_gsm8k((dir / "bad.jsonl").string());
    FAIL();
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("bad.jsonl:1"), std::string::npos) << e.what();
  }
  std::filesystem::remove_all(dir);
}

TEST(CodeEnv, LoadsShippedProblemsInBothSchemas) {
  const auto stdio = load_code_problems(std::string(RLLOOP_SOURCE_DIR) + "/data/problems/problems.jsonl");
  const auto fns = load_code_problems(std::string(RLLOOP_SOURCE_DIR) + "/data/problems/function_problems.jsonl");
  ASSERT_GE(stdio.size(), 30u);
  EXPECT_FALSE(stdio[0].assert_style());
  EXPECT_EQ(stdio[0].tests[0].input, "1 2\n");
  ASSERT_FALSE(fns.empty());
  EXPECT_TRUE(fns[0].assert_style());
  EXPECT_EQ(fns[0].entry_point, "add");
  int cpp = 0;
  for (const auto& p : stdio) cpp += p.language == sandbox::Language::cpp;
  EXPECT_GE(cpp, 1);
}

TEST(GuessNumber, BinarySearchPolicyWins) {
  GuessNumberEnv env({.lo = 1, .hi = 100, .max_turns = 8}, 11);
  int lo = 1, hi = 100, guess = 0;
  auto policy = [&](std::string_view obs) {
    if (obs == "higher") lo = guess + 1;
    if (obs == "lower") hi = guess - 1;
    guess = (lo + hi) / 2;
    return "my guess: " + std::to_string(guess);
  };
  const Episode ep = run_episode(env, policy);
  EXPECT_TRUE(ep.finished);
  EXPECT_EQ(guess, env.secret());
  EXPECT_LE(ep.actions.size(), 7u);
  EXPECT_DOUBLE_EQ(ep.total_reward, 1.0 - 0.05 * (ep.actions.size() - 1));
}

TEST(GuessNumber, RunsOutOfTurnsAndMarksGibberish) {
  GuessNumberEnv env({.lo = 1, .hi = 100, .max_turns = 3}, 5);
  const Episode ep = run_episode(env, [](std::string_view) { return std::string("no idea"); });
  EXPECT_TRUE(ep.finished);
  ASSERT_EQ(ep.rewards.size(), 3u);
  EXPECT_EQ(ep.rewards[0].status, ScoreStatus::unparseable);
  EXPECT_EQ(ep.rewards[2].status, ScoreStatus::wrong_answer);
  EXPECT_EQ(ep.total_reward, 0.0);
  EXPECT_THROW(GuessNumberEnv({.lo = 5, .hi = 1}), invalid_argument);
}
