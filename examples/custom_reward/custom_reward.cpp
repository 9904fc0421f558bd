// A user-written reward in a few lines, checked by the Reward concept, combined with a built-in one and
// scored over a batch in parallel.
#include <cstdio>
#include <string>
#include <vector>

#include <rlloop/reward.hpp>
#include <rlloop/rewards/batch.hpp>
#include <rlloop/rewards/combinators.hpp>
#include <rlloop/rewards/math.hpp>

// ---- the whole reward: context type + functor ----------------------------------------------------------------
struct Question {
  std::string prompt;
  std::string answer;  // reference, "#### 42" or "42"
};

// Rewards short answers: 1 at or under `budget` characters, falling linearly to 0 at twice the budget.
struct Brevity {
  std::size_t budget = 40;
  rlloop::Score operator()(const Question&, std::string_view completion) const {
    const double n = static_cast<double>(completion.size()), b = static_cast<double>(budget);
    const double v = n <= b ? 1.0 : n >= 2 * b ? 0.0 : 2.0 - n / b;
    return {v, rlloop::ScoreStatus::ok, std::to_string(completion.size()) + " chars"};
  }
};
static_assert(rlloop::Reward<Brevity, Question>);  // a type that is not a reward fails here, naming the concept
// ----------------------------------------------------------------------------------------------------------------

int main() {
  using namespace rlloop::rewards;
  // 1.0 for the right number plus up to 0.2 for brevity.
  const auto reward = weighted_sum(std::pair{1.0, MathAnswerReward{}}, std::pair{0.2, Brevity{}});

  const std::vector<Question> questions(4, Question{"What is 6*7?", "#### 42"});
  const std::vector<std::string> completions = {
      "#### 42", "6*7 is 42, because six sevens make forty-two, as everyone knows.\n#### 42", "#### 41", "42"};
  const auto scores = score_batch(reward, questions, completions);  // parallel (TBB)
  for (std::size_t i = 0; i < scores.size(); ++i)
    std::printf("%.3f  %-12s %s\n", scores[i].value, std::string(rlloop::to_string(scores[i].status)).c_str(),
                scores[i].details.c_str());
}
