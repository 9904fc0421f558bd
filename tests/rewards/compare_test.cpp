// Output comparison of the code reward: whitespace- and float-tolerant, otherwise exact.
#include <gtest/gtest.h>

#include <rlloop/rewards/compare.hpp>

using namespace rlloop::rewards;

TEST(OutputsMatch, IgnoresWhitespaceLayout) {
  EXPECT_TRUE(outputs_match("1 2 3\n", "1\t2  3"));
  EXPECT_TRUE(outputs_match("YES\n", "YES"));
  EXPECT_TRUE(outputs_match("a\nb\n", "  a b  \n\n"));
  EXPECT_TRUE(outputs_match("", "\n"));
  EXPECT_FALSE(outputs_match("1 2 3", "1 2"));
  EXPECT_FALSE(outputs_match("YES", "yes"));
  EXPECT_FALSE(outputs_match("ab", "a b"));
}

TEST(OutputsMatch, FloatsWithinTolerance) {
  EXPECT_TRUE(outputs_match("0.3333333", "0.33333331"));
  EXPECT_TRUE(outputs_match("2.5", "2.500000"));
  EXPECT_TRUE(outputs_match("1000000", "1000000.5", {.abs_tol = 1e-6, .rel_tol = 1e-6}));
  EXPECT_FALSE(outputs_match("0.333", "0.334"));
  EXPECT_FALSE(outputs_match("2.5", "2.5000", {.float_tolerant = false}));
  EXPECT_FALSE(outputs_match("1", "nan"));
  EXPECT_FALSE(outputs_match("10", "0x0a"));
}
