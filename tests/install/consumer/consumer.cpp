// Uses the header-only core through every include root a user writes: <rlloop/...>, <rlloop/algorithms/...>,
// <rlloop/rewards/...>, <rlloop/envs/...>.
#include <cstdio>

#include <rlloop/algorithms/advantages.hpp>
#include <rlloop/envs/arithmetic.hpp>
#include <rlloop/rewards/math.hpp>
#include <rlloop/rlloop.hpp>

int main() {
  rlloop::envs::ArithmeticTask task({}, 3);
  const auto p = task.next(rlloop::envs::Split::train);
  const rlloop::rewards::MathAnswerReward reward;
  const double right = rlloop::score_one(reward, p, p.target).value;
  const auto adv = rlloop::algorithms::GroupCentered{}(std::vector<double>{right, 0.0});
  const rlloop::LossSpec spec{.fn = rlloop::loss_fn_from_string("ppo"), .epsilon_low = 0.3};
  std::printf("%s %g %g %g\n", p.prompt.c_str(), right, adv[0], spec.min_ratio());
  return right == 1.0 && adv[0] == 0.5 && spec.min_ratio() == 0.7 ? 0 : 1;
}
