// Must NOT compile: NotAReward takes only the completion (no context) and returns a string.
#include <string>
#include <string_view>

#include <rlloop/reward.hpp>

struct Problem {
  std::string answer;
};

struct NotAReward {
  std::string operator()(std::string_view completion) const { return std::string(completion); }
};

int main() { return rlloop::score_one(NotAReward{}, Problem{"4"}, "4").value == 1.0 ? 0 : 1; }
