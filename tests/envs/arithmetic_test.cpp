// The synthetic arithmetic task: right answers, reproducible draws, disjoint train/held-out splits.
#include <gtest/gtest.h>

#include <set>

#include <rlloop/envs/arithmetic.hpp>

using namespace rlloop;
using namespace rlloop::envs;

namespace {
// Independent evaluator of "a+b-c*d=" (precedence: * first).
long long eval(std::string e) {
  e.pop_back();  // '='
  std::vector<long long> terms;
  std::vector<char> ops;
  std::size_t i = 0;
  auto number = [&] {
    long long v = 0;
    while (i < e.size() && std::isdigit(static_cast<unsigned char>(e[i]))) v = v * 10 + (e[i++] - '0');
    return v;
  };
  long long cur = number();
  char pending = '+';
  long long total = 0;
  while (i < e.size()) {
    const char op = e[i++];
    const long long x = number();
    if (op == '*') {
      cur *= x;
    } else {
      total += pending == '+' ? cur : -cur;
      cur = x;
      pending = op;
    }
  }
  return total + (pending == '+' ? cur : -cur);
}
}  // namespace

TEST(Arithmetic, ProblemsAreRightAndShort) {
  for (int level = 1; level <= 6; ++level) {
    ArithmeticTask task(ArithmeticOptions::for_difficulty(level), 7);
    for (const auto& p : task.sample(300, Split::train)) {
      ASSERT_EQ(std::to_string(eval(p.prompt)), p.answer) << p.prompt;
      ASSERT_EQ(p.target, "#### " + p.answer);
      ASSERT_GE(std::stoll(p.answer), 0) << p.prompt;
      ASSERT_LE(p.prompt.size(), 12u);
    }
  }
  ArithmeticTask task({.digits = 2, .operands = 2, .operators = "+"}, 1);
  const auto p = task.next(Split::train);
  EXPECT_EQ(p.prompt.back(), '=');
  EXPECT_EQ(p.prompt.find_first_not_of("0123456789+="), std::string::npos);
}

TEST(Arithmetic, SameSeedSameProblemsOtherSeedOthers) {
  ArithmeticTask a(ArithmeticOptions::for_difficulty(3), 42), b(ArithmeticOptions::for_difficulty(3), 42),
      c(ArithmeticOptions::for_difficulty(3), 43);
  const auto pa = a.sample(50, Split::train), pb = b.sample(50, Split::train), pc = c.sample(50, Split::train);
  for (std::size_t i = 0; i < pa.size(); ++i) EXPECT_EQ(pa[i].prompt, pb[i].prompt);
  int same = 0;
  for (std::size_t i = 0; i < pa.size(); ++i) same += pa[i].prompt == pc[i].prompt;
  EXPECT_LT(same, 5);
}

TEST(Arithmetic, SplitsAreDisjointAndSized) {
  const auto opts = ArithmeticOptions::for_difficulty(2);
  ArithmeticTask train_task(opts, 1), eval_task(opts, 2);
  std::set<std::string> train, held;
  for (const auto& p : train_task.sample(3000, Split::train)) train.insert(p.prompt);
  for (const auto& p : eval_task.sample(300, Split::held_out)) held.insert(p.prompt);
  for (const auto& h : held) EXPECT_EQ(train.count(h), 0u) << h;
  // The held-out share of the whole 2-digit a+b space is close to the requested 10%.
  int in_held = 0;
  for (int x = 0; x < 100; ++x)
    for (int y = 0; y < 100; ++y)
      in_held += ArithmeticTask::split_of(std::to_string(x) + "+" + std::to_string(y) + "=", 0.1) == Split::held_out;
  EXPECT_GT(in_held, 800);
  EXPECT_LT(in_held, 1200);
}

TEST(Arithmetic, EnvRewardsTheTarget) {
  ArithmeticTask task(ArithmeticOptions::for_difficulty(2), 3);
  const auto p = task.next(Split::held_out);
  auto env = arithmetic_env(p);
  static_assert(Env<ArithmeticEnv>);
  EXPECT_EQ(env.reset(), p.prompt);
  EXPECT_EQ(env.step(p.target).reward.value, 1.0);
  env.reset();
  EXPECT_EQ(env.step("#### " + std::to_string(std::stoll(p.answer) + 1)).reward.status, ScoreStatus::wrong_answer);
  EXPECT_THROW(env.step("again"), conflict);
}

TEST(Arithmetic, OptionsAreValidated) {
  EXPECT_THROW(ArithmeticTask({.digits = 0}), invalid_argument);
  EXPECT_THROW(ArithmeticTask({.operators = "/"}), invalid_argument);
  EXPECT_THROW(ArithmeticOptions::for_difficulty(9), invalid_argument);
  try {
    ArithmeticTask({.operands = 1});
    FAIL();
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("ArithmeticOptions::operands"), std::string::npos);
  }
}
