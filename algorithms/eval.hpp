// Held-out evaluation: one greedy completion per problem, scored by a reward.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include <rlloop/clients.hpp>
#include <rlloop/env.hpp>
#include <rlloop/reward.hpp>
#include <rlloop/rewards/batch.hpp>
#include <rlloop/tokenizer.hpp>

namespace rlloop::algorithms {

struct EvalResult {
  double accuracy = 0;  // share of completions whose Score is ok
  double reward_mean = 0;
  std::vector<std::string> completions;
};

template <Session S, PromptedProblem P, Reward<P> R>
EvalResult evaluate_greedy(const SamplingClient<S>& sampler, const Tokenizer& tokenizer, const std::vector<P>& problems,
                           const R& reward, SamplingParams params) {
  params.temperature = 0.0;
  std::vector<Future<SampleResponse>> pending;
  for (const auto& p : problems)
    pending.push_back(sampler.sample(ModelInput::from_tokens(tokenizer.encode(std::string_view(p.prompt))), 1, params));
  EvalResult out;
  for (auto& f : pending) out.completions.push_back(tokenizer.decode(f.get().sequences[0].tokens, true));
  const auto scores = rewards::score_batch(reward, problems, out.completions);
  for (const auto& s : scores) {
    out.accuracy += s.ok() ? 1.0 : 0.0;
    out.reward_mean += s.value;
  }
  if (!scores.empty()) {
    out.accuracy /= static_cast<double>(scores.size());
    out.reward_mean /= static_cast<double>(scores.size());
  }
  return out;
}

}  // namespace rlloop::algorithms
