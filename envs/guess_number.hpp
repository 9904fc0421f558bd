// A small multi-turn env: find a secret integer in [lo, hi] by guessing; the env answers "higher" or "lower".
// The reward comes at the end: 1 for finding it, minus `turn_cost` per extra guess; 0 when turns run out.
// An action without a number costs a turn and is marked unparseable (data, not an exception).
#pragma once
#include <cstdint>
#include <random>
#include <string>

#include <rlloop/env.hpp>
#include <rlloop/error.hpp>
#include <rlloop/rewards/math.hpp>

namespace rlloop::envs {

struct GuessNumberOptions {
  int lo = 1;
  int hi = 100;
  int max_turns = 8;
  double turn_cost = 0.05;

  void validate() const {
    if (lo > hi) throw invalid_argument("GuessNumberOptions::lo must be <= hi");
    if (max_turns < 1) throw invalid_argument("GuessNumberOptions::max_turns must be >= 1");
    if (!(turn_cost >= 0)) throw invalid_argument("GuessNumberOptions::turn_cost must be >= 0");
  }
};

class GuessNumberEnv {
 public:
  // The secret comes from `seed`: copies of an env (a GRPO group) share the same secret.
  explicit GuessNumberEnv(GuessNumberOptions opts = {}, std::uint64_t seed = 0) : opts_(opts) {
    opts_.validate();
    std::mt19937_64 rng(seed);
    secret_ = opts_.lo + static_cast<int>(rng() % static_cast<std::uint64_t>(opts_.hi - opts_.lo + 1));
  }

  std::string reset() {
    turns_ = 0;
    done_ = false;
    return "I picked an integer between " + std::to_string(opts_.lo) + " and " + std::to_string(opts_.hi) +
           ". Guess it; I will say higher or lower. You have " + std::to_string(opts_.max_turns) + " guesses.";
  }

  StepResult step(std::string_view action) {
    if (done_) throw conflict("GuessNumberEnv::step: episode is over; call reset() first");
    ++turns_;
    const bool last = turns_ >= opts_.max_turns;
    const auto guess = rewards::first_number_in(action);
    StepResult r;
    if (!guess) {
      r.reward = {0.0, ScoreStatus::unparseable, "no number in the guess"};
      r.observation = "Please answer with a number.";
    } else if (static_cast<long long>(*guess) == secret_ && *guess == static_cast<double>(secret_)) {
      r.reward = {1.0 - opts_.turn_cost * (turns_ - 1), ScoreStatus::ok,
                  "found in " + std::to_string(turns_) + " guesses"};
      r.done = done_ = true;
      return r;
    } else {
      r.reward = {0.0, ScoreStatus::ok, {}};
      r.observation = *guess < secret_ ? "higher" : "lower";
    }
    r.done = done_ = last;
    if (last) {
      r.observation.clear();
      r.reward.status = ScoreStatus::wrong_answer;
      r.reward.details = "out of guesses; the number was " + std::to_string(secret_);
    }
    return r;
  }

  int secret() const noexcept { return secret_; }
  int turns() const noexcept { return turns_; }

 private:
  GuessNumberOptions opts_;
  int secret_ = 0;
  int turns_ = 0;
  bool done_ = false;
};

}  // namespace rlloop::envs
