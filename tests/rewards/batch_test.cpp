// Batch scoring: results in input order, equal to one-by-one scoring, and misuse rejected.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include <rlloop/rewards/batch.hpp>
#include <rlloop/rewards/math.hpp>

using namespace rlloop;
using namespace rlloop::rewards;

TEST(ScoreBatch, MatchesSerialScoringInOrder) {
  std::vector<std::string> refs, completions;
  for (int i = 0; i < 500; ++i) {
    refs.push_back("#### " + std::to_string(i));
    completions.push_back(i % 3 == 0 ? "#### " + std::to_string(i) : i % 3 == 1 ? "#### -1" : "no answer");
  }
  const MathAnswerReward reward;
  for (int conc : {0, 1, 2, 8}) {
    const auto scores = score_batch(reward, refs, completions, {.max_concurrency = conc});
    ASSERT_EQ(scores.size(), refs.size());
    for (std::size_t i = 0; i < refs.size(); ++i) {
      const Score expect = reward(refs[i], completions[i]);
      ASSERT_EQ(scores[i].value, expect.value) << i;
      ASSERT_EQ(scores[i].status, expect.status) << i;
    }
  }
}

TEST(ScoreBatch, RunsConcurrently) {
  // A reward that records how many calls overlap. In the parallel case each call waits (up to 5 s) for a
  // partner to show up, so a loaded machine slows the test down but cannot make it fail.
  struct Overlap {
    std::atomic<int>* active;
    std::atomic<int>* peak;
    bool wait_for_partner;
    double operator()(const int&, std::string_view) const {
      const int now = ++*active;
      int p = peak->load();
      while (now > p && !peak->compare_exchange_weak(p, now)) {
      }
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
      while (wait_for_partner && peak->load() < 2 && std::chrono::steady_clock::now() < until)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      --*active;
      return 1;
    }
  };
  if (std::thread::hardware_concurrency() < 2) GTEST_SKIP() << "needs 2 cores";
  std::atomic<int> active{0}, peak{0};
  const std::vector<int> ctx(8, 0);
  const std::vector<std::string> comps(8, "x");
  score_batch(Overlap{&active, &peak, false}, ctx, comps, {.max_concurrency = 1});
  EXPECT_EQ(peak.load(), 1);
  peak = 0;
  score_batch(Overlap{&active, &peak, true}, ctx, comps, {.max_concurrency = 2});
  EXPECT_GE(peak.load(), 2);
}

TEST(ScoreBatch, MismatchedSizesThrow) {
  EXPECT_THROW(score_batch(MathAnswerReward{}, std::vector<std::string>{"#### 1"}, std::vector<std::string>{}),
               invalid_argument);
  EXPECT_THROW(
      score_batch(MathAnswerReward{}, std::vector<std::string>{}, std::vector<std::string>{}, {.max_concurrency = -1}),
      invalid_argument);
}
