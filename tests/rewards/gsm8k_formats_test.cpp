// Every reference answer of GSM8K's test split, written in each accepted answer format, is
// graded correct; perturbed answers are graded wrong. Reads gsm8k/test.jsonl of the external data folder
// (tests/external_data.hpp; not shipped).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <functional>

#include <rlloop/envs/gsm8k.hpp>
#include <rlloop/rewards/math.hpp>

#include "external_data.hpp"

using namespace rlloop;
using namespace rlloop::rewards;

namespace {
std::string gsm8k_test_path() { return rlloop::testing::data_file("gsm8k/test.jsonl").string(); }

std::string with_commas(long long v) {
  std::string digits = std::to_string(v < 0 ? -v : v), out;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return (v < 0 ? "-" : "") + out;
}
}  // namespace

TEST(Gsm8k, EveryReferenceIsCorrectInEveryFormatAndPerturbationsAreWrong) {
  const auto path = gsm8k_test_path();
  RLLOOP_REQUIRE_DATA(path, "GSM8K's test split, github.com/openai/grade-school-math");
  const auto problems = envs::load_gsm8k(path);
  ASSERT_EQ(problems.size(), 1319u);
  const MathAnswerReward reward;

  std::size_t checked = 0;
  for (const auto& p : problems) {
    const double v = reference_value(p.solution);
    ASSERT_EQ(v, std::floor(v)) << p.id << ": GSM8K answers are integers";
    const long long n = static_cast<long long>(v);
    const std::string plain = std::to_string(n);
    const std::string accepted[] = {
        p.solution,                                           // the reference worked solution itself
        "#### " + p.answer,                                   // as written in the data set (maybe with commas)
        "Let me think.\n#### " + plain,                       // bare after ####
        "#### " + with_commas(n),                             // thousands separators
        "#### $" + with_commas(n),                            // currency
        "#### " + plain + ".00",                              // trailing decimals
        "#### " + plain + ".",                                // sentence full stop
        "The answer is \\boxed{" + plain + "}.",              // LaTeX box
        "\\boxed{\\$" + with_commas(n) + "}",                 // escaped dollar inside the box
        "\\boxed{" + plain + ".0}",                           // float form
        "\\boxed{\\frac{" + std::to_string(2 * n) + "}{2}}",  // a fraction equal to it
        "#### 1\nno wait\n#### " + plain,                     // the last answer counts
    };
    for (const auto& c : accepted) {
      const Score s = reward(p, c);
      ASSERT_EQ(s.value, 1.0) << p.id << " rejected a correct answer: [" << c << "] " << s.details;
      ASSERT_EQ(s.status, ScoreStatus::ok);
    }
    std::vector<std::string> perturbed = {"#### " + std::to_string(n + 1), "#### " + std::to_string(n - 1),
                                          "\\boxed{" + std::to_string(n * 10 + 1) + "}", "\\boxed{" + plain + ".5}",
                                          "#### " + plain + "\n#### " + std::to_string(n + 7)};
    if (n != 0) perturbed.push_back("#### " + std::to_string(-n));
    if (std::llabs(n) >= 10) perturbed.push_back("#### " + plain.substr(0, plain.size() - 1));  // dropped digit
    for (const auto& c : perturbed) {
      const Score s = reward(p, c);
      ASSERT_EQ(s.value, 0.0) << p.id << " accepted a wrong answer: [" << c << "]";
      ASSERT_EQ(s.status, ScoreStatus::wrong_answer);
    }
    // No answer at all, or the right number outside any answer format.
    ASSERT_EQ(reward(p, "I am not sure.").status, ScoreStatus::unparseable);
    ASSERT_EQ(reward(p, "maybe " + plain).status, ScoreStatus::unparseable);
    ++checked;
  }
  EXPECT_EQ(checked, 1319u);
}

TEST(Gsm8k, LoaderBuildsPromptsAndIds) {
  const auto path = gsm8k_test_path();
  RLLOOP_REQUIRE_DATA(path, "GSM8K's test split, github.com/openai/grade-school-math");
  const auto problems = envs::load_gsm8k(path, {.limit = 3});
  ASSERT_EQ(problems.size(), 3u);
  EXPECT_EQ(problems[0].id, "test-1");
  EXPECT_EQ(problems[0].answer, "18");
  EXPECT_EQ(problems[0].prompt.rfind(problems[0].question, 0), 0u);
  EXPECT_NE(problems[0].prompt.find("####"), std::string::npos);
}
