// Number parsing and answer extraction of the math reward.
#include <gtest/gtest.h>

#include <rlloop/rewards/math.hpp>

using namespace rlloop;
using namespace rlloop::rewards;

TEST(ParseNumber, AcceptsCommonNotations) {
  EXPECT_DOUBLE_EQ(*parse_number("1,234"), 1234);
  EXPECT_DOUBLE_EQ(*parse_number("$18"), 18);
  EXPECT_DOUBLE_EQ(*parse_number("\\$1,000.50"), 1000.5);
  EXPECT_DOUBLE_EQ(*parse_number("18.0"), 18);
  EXPECT_DOUBLE_EQ(*parse_number("18."), 18);
  EXPECT_DOUBLE_EQ(*parse_number("-3"), -3);
  EXPECT_DOUBLE_EQ(*parse_number("-$5"), -5);
  EXPECT_DOUBLE_EQ(*parse_number("3/4"), 0.75);
  EXPECT_DOUBLE_EQ(*parse_number("-\\frac{1}{2}"), -0.5);
  EXPECT_DOUBLE_EQ(*parse_number("\\dfrac{10}{4}"), 2.5);
  EXPECT_DOUBLE_EQ(*parse_number("50%"), 50);
  EXPECT_DOUBLE_EQ(*parse_number("  7  "), 7);
}

TEST(ParseNumber, RejectsNonNumbers) {
  EXPECT_FALSE(parse_number(""));
  EXPECT_FALSE(parse_number("abc"));
  EXPECT_FALSE(parse_number("1/0"));
  EXPECT_FALSE(parse_number("12 apples"));
  EXPECT_FALSE(parse_number("1.2.3"));
  EXPECT_FALSE(parse_number("--4"));
}

TEST(NumbersEqual, ToleratesRoundingOnly) {
  EXPECT_TRUE(numbers_equal(0.5, *parse_number("1/2")));
  EXPECT_TRUE(numbers_equal(1e8, 1e8 + 1e-3));
  EXPECT_FALSE(numbers_equal(1.0 / 3.0, 0.333));
  EXPECT_FALSE(numbers_equal(100, 101));
}

TEST(Extract, BoxedTakesLastBalanced) {
  EXPECT_EQ(*extract_boxed("first \\boxed{1} then \\boxed{\\frac{3}{4}}"), "\\frac{3}{4}");
  EXPECT_FALSE(extract_boxed("\\boxed{12"));
  EXPECT_FALSE(extract_boxed("no box"));
}

TEST(Extract, HashesTakeLastLine) {
  EXPECT_EQ(*extract_after_hashes("a\n#### 5\nmore\n#### 72 \nrest"), "72");
  EXPECT_FALSE(extract_after_hashes("#### \n"));
}

TEST(MathAnswerReward, ScoresCorrectWrongAndUnparseable) {
  const MathAnswerReward reward;
  const std::string reference = "She makes 9 * 2 = $18.\n#### 18";
  const Score right = reward(reference, "so \\boxed{18}");
  EXPECT_EQ(right.value, 1.0);
  EXPECT_EQ(right.status, ScoreStatus::ok);
  const Score wrong = reward(reference, "#### 19");
  EXPECT_EQ(wrong.value, 0.0);
  EXPECT_EQ(wrong.status, ScoreStatus::wrong_answer);
  EXPECT_NE(wrong.details.find("expected 18"), std::string::npos) << wrong.details;
  const Score none = reward(reference, "the answer is 18");
  EXPECT_EQ(none.status, ScoreStatus::unparseable);
  EXPECT_EQ(none.value, 0.0);
  const Score not_number = reward(reference, "\\boxed{eighteen}");
  EXPECT_EQ(not_number.status, ScoreStatus::unparseable);
}

TEST(MathAnswerReward, LastNumberFallbackIsOptIn) {
  const MathAnswerReward strict;
  const MathAnswerReward lenient(MathAnswerOptions{.fallback_to_last_number = true});
  EXPECT_EQ(strict("#### 42", "I think it is 42").status, ScoreStatus::unparseable);
  EXPECT_EQ(lenient("#### 42", "I think it is 42").value, 1.0);
  EXPECT_EQ(lenient("#### 1200", "so 1,200").value, 1.0);
}

TEST(MathAnswerReward, WorksOnStructsWithAnswerMember) {
  struct P {
    std::string answer;
  };
  static_assert(Reward<MathAnswerReward, P>);
  static_assert(Reward<MathAnswerReward, std::string>);
  EXPECT_EQ(MathAnswerReward{}(P{"-10"}, "#### -10.0").value, 1.0);
}

TEST(MathAnswerReward, BrokenReferenceThrows) {
  EXPECT_THROW(MathAnswerReward{}(std::string("#### none"), "#### 1"), invalid_argument);
}
