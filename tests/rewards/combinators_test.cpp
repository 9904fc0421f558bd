// Weighted sums, clipping and format bonuses/penalties, with real rewards inside.
#include <gtest/gtest.h>

#include <rlloop/rewards/combinators.hpp>
#include <rlloop/rewards/format.hpp>
#include <rlloop/rewards/math.hpp>

using namespace rlloop;
using namespace rlloop::rewards;

namespace {
struct LengthReward {  // returns a plain number: an `ok` score
  double operator()(const std::string&, std::string_view c) const { return static_cast<double>(c.size()); }
};
}  // namespace

TEST(Combinators, WeightedSumAddsAndKeepsFirstFailureStatus) {
  const auto r = weighted_sum(std::pair{1.0, MathAnswerReward{}}, std::pair{0.25, format_reward(has_final_answer{})});
  static_assert(Reward<decltype(r), std::string>);
  const std::string ref = "#### 12";
  EXPECT_DOUBLE_EQ(r(ref, "#### 12").value, 1.25);
  const Score wrong = r(ref, "#### 13");
  EXPECT_DOUBLE_EQ(wrong.value, 0.25);
  EXPECT_EQ(wrong.status, ScoreStatus::wrong_answer);
  const Score none = r(ref, "12");
  EXPECT_DOUBLE_EQ(none.value, 0.0);
  EXPECT_EQ(none.status, ScoreStatus::unparseable);
  EXPECT_NE(none.details.find("format not met"), std::string::npos);
}

TEST(Combinators, ClipBoundsTheValue) {
  const auto r = clip(LengthReward{}, 0.0, 5.0);
  EXPECT_EQ(r(std::string{}, "abc").value, 3.0);
  EXPECT_EQ(r(std::string{}, "abcdefgh").value, 5.0);
  EXPECT_THROW(clip(LengthReward{}, 2.0, 1.0), invalid_argument);
}

TEST(Combinators, FormatBonusAndPenalty) {
  const auto bonus = with_format_bonus(MathAnswerReward{}, max_length{10}, 0.5);
  EXPECT_DOUBLE_EQ(bonus(std::string("#### 3"), "#### 3").value, 1.5);
  EXPECT_DOUBLE_EQ(bonus(std::string("#### 3"), "long reasoning #### 3").value, 1.0);
  const auto penalty = with_format_penalty(MathAnswerReward{}, matches_regex("#### -?[0-9]+"), 0.5);
  EXPECT_DOUBLE_EQ(penalty(std::string("#### 3"), "#### 3").value, 1.0);
  const Score boxed = penalty(std::string("#### 3"), "\\boxed{3}");
  EXPECT_DOUBLE_EQ(boxed.value, 0.5);
  EXPECT_NE(boxed.details.find("format not met"), std::string::npos);
  EXPECT_THROW(with_format_penalty(MathAnswerReward{}, max_length{}, -1.0), invalid_argument);
}

TEST(Combinators, Nest) {
  const auto r = clip(weighted_sum(std::pair{2.0, MathAnswerReward{}}, std::pair{-0.1, LengthReward{}}), -1.0, 1.0);
  EXPECT_DOUBLE_EQ(r(std::string("#### 4"), "#### 4").value, 1.0);               // 2 - 0.6 clipped to 1
  EXPECT_DOUBLE_EQ(r(std::string("#### 4"), "#### 5").value, -0.6);              // 0 - 0.6
  EXPECT_DOUBLE_EQ(r(std::string("#### 4"), std::string(40, 'x')).value, -1.0);  // -4 clipped
}
