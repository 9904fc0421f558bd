// The arithmetic recipe's data helpers (examples/common/arith_recipe.hpp): the careless demonstrator's carry-free
// sums and the fixed SFT set.
#include <gtest/gtest.h>

#include <set>

#include "../../examples/common/arith_recipe.hpp"

using namespace rlloop;

TEST(ArithRecipe, CarryFreeSumForgetsEveryCarry) {
  EXPECT_EQ(examples::carry_free_sum("58+67="), "15");  // 125 with its carries
  EXPECT_EQ(examples::carry_free_sum("99+24="), "13");
  EXPECT_EQ(examples::carry_free_sum("5+5="), "0");
  EXPECT_EQ(examples::carry_free_sum("12+30="), "42");  // no carry: the true sum
  EXPECT_EQ(examples::carry_free_sum("7+65+8="), "60");
  EXPECT_EQ(examples::carry_free_sum("70-3="), std::nullopt);  // not a sum: the demonstrator writes it correctly
  EXPECT_EQ(examples::carry_free_sum("7*3="), std::nullopt);
}

TEST(ArithRecipe, CarryFreeSumIsRightExactlyWithoutCarries) {
  envs::ArithmeticTask task(envs::ArithmeticOptions::for_difficulty(2), 5);
  int with_carry = 0;
  for (const auto& p : task.sample(2000, envs::Split::train)) {
    const auto plus = p.prompt.find('+');
    const int a = std::stoi(p.prompt.substr(0, plus)), b = std::stoi(p.prompt.substr(plus + 1));
    const bool carry = a % 10 + b % 10 >= 10 || (a / 10 + b / 10 + (a % 10 + b % 10) / 10) >= 10;
    with_carry += carry;
    EXPECT_EQ(*examples::carry_free_sum(p.prompt) == p.answer, !carry) << p.prompt;
  }
  EXPECT_NEAR(with_carry / 2000.0, 0.70, 0.04);  // 1 - 0.55^2 for uniform operands 0..99
}

TEST(ArithRecipe, SftPoolHoldsDistinctTrainingProblems) {
  envs::ArithmeticTask task(envs::ArithmeticOptions::for_difficulty(2), 5);
  const auto pool = examples::sft_pool(task, 300);
  ASSERT_EQ(pool.size(), 300u);
  std::set<std::string> prompts;
  for (const auto& p : pool) {
    prompts.insert(p.prompt);
    EXPECT_EQ(envs::ArithmeticTask::split_of(p.prompt, task.options().held_out_fraction), envs::Split::train);
  }
  EXPECT_EQ(prompts.size(), 300u);
  envs::ArithmeticTask one_digit(envs::ArithmeticOptions::for_difficulty(1), 5);  // at most 100 problems
  EXPECT_THROW(examples::sft_pool(one_digit, 500), invalid_argument);
}
