// Control for bad_reward.cpp: the same call with a real reward compiles.
#include <string>
#include <string_view>
#include <vector>

#include <rlloop/reward.hpp>

struct Problem {
  std::string answer;
};

struct ExactMatch {
  double operator()(const Problem& p, std::string_view completion) const { return completion == p.answer; }
};

int main() {
  static_assert(rlloop::Reward<ExactMatch, Problem>);
  return rlloop::score_one(ExactMatch{}, Problem{"4"}, "4").value == 1.0 ? 0 : 1;
}
