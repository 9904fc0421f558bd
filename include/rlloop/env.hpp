// Environments: text in, text out. An Env gives an observation, takes the model's action (a completion),
// and answers with a reward, the next observation and whether the episode is over. Single-turn tasks
// (GSM8K, code, arithmetic) end after one step; multi-turn ones (envs/guess_number.hpp) keep going.
// Tokenization happens elsewhere.
//
//   template <rlloop::Env E> ...
//   std::string obs = env.reset();
//   while (true) { auto r = env.step(policy(obs)); total += r.reward.value; if (r.done) break; obs = r.observation; }
#pragma once
#include <concepts>
#include <cstddef>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <rlloop/error.hpp>
#include <rlloop/reward.hpp>

namespace rlloop {

struct StepResult {
  std::string observation;  // what the model sees next (empty when done)
  Score reward;             // reward for this step
  bool done = true;
};

// E is an environment: reset() starts an episode and returns the first observation; step(action) plays one
// action. Copies of an Env are independent episodes (that is how a GRPO group is made).
template <class E>
concept Env = std::copy_constructible<E> && requires(E& env, std::string_view action) {
  { env.reset() } -> std::convertible_to<std::string>;
  { env.step(action) } -> std::same_as<StepResult>;
};

// A problem with a prompt for the model: MathProblem, CodeProblem, ArithmeticProblem, ...
template <class P>
concept PromptedProblem = std::copy_constructible<P> && requires(const P& p) {
  { p.prompt } -> std::convertible_to<std::string_view>;
};

// The single-turn env of any prompted problem and reward: observation = prompt, one completion, scored, done.
template <PromptedProblem Problem, Reward<Problem> R>
class SingleTurnEnv {
 public:
  SingleTurnEnv(Problem problem, R reward) : problem_(std::move(problem)), reward_(std::move(reward)) {}

  std::string reset() {
    stepped_ = false;
    return std::string(problem_.prompt);
  }
  StepResult step(std::string_view completion) {
    if (stepped_) throw conflict("SingleTurnEnv::step: episode is over; call reset() first");
    stepped_ = true;
    return {{}, score_one(reward_, problem_, completion), true};
  }

  const Problem& problem() const noexcept { return problem_; }
  const R& reward() const noexcept { return reward_; }

 private:
  Problem problem_;
  R reward_;
  bool stepped_ = false;
};

// N independent copies of one env: the group of a GRPO step (same prompt, N samples, rewards compared
// within the group).
template <Env E>
std::vector<E> make_group(const E& env, std::size_t n) {
  if (n == 0) throw invalid_argument("make_group: group size must be >= 1");
  return std::vector<E>(n, env);
}

// One GRPO group per problem: groups[i] holds `group_size` copies of make_env(problems[i]).
template <class Problem, class MakeEnv>
requires Env<std::invoke_result_t<MakeEnv&, const Problem&>>
auto make_groups(const std::vector<Problem>& problems, std::size_t group_size, MakeEnv&& make_env) {
  std::vector<std::vector<std::invoke_result_t<MakeEnv&, const Problem&>>> groups;
  groups.reserve(problems.size());
  for (const auto& p : problems) groups.push_back(make_group(make_env(p), group_size));
  return groups;
}

// One played episode: every (observation, action) pair and the rewards.
struct Episode {
  std::vector<std::string> observations;
  std::vector<std::string> actions;
  std::vector<Score> rewards;
  double total_reward = 0;
  bool finished = false;  // the env said done (rather than running out of turns)
};

// Plays `env` with `policy` (callable: std::string(std::string_view observation)) for at most max_turns.
template <Env E, class Policy>
requires std::convertible_to<std::invoke_result_t<Policy&, std::string_view>, std::string> Episode
run_episode(E& env, Policy&& policy, int max_turns = 64) {
  Episode ep;
  std::string obs = env.reset();
  for (int t = 0; t < max_turns; ++t) {
    ep.observations.push_back(obs);
    ep.actions.push_back(policy(std::string_view(obs)));
    StepResult r = env.step(ep.actions.back());
    ep.total_reward += r.reward.value;
    ep.rewards.push_back(std::move(r.reward));
    if (r.done) {
      ep.finished = true;
      break;
    }
    obs = std::move(r.observation);
  }
  return ep;
}

}  // namespace rlloop
