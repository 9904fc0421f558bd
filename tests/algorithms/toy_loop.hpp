// One GRPO loop written once against the Session concept. The fake-session test and the LibTorch test both call
// run_toy_grpo; that they compile and run from the same template is the point.
#pragma once
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <rlloop/algorithms/grpo.hpp>

namespace toy {

struct LetterProblem {
  std::string prompt;
};

// Share of the completion's characters that are in `wanted` (0 for an empty completion): a dense reward, so
// almost every group carries a signal even from a random model.
struct ShareOf {
  std::string wanted;
  double operator()(const LetterProblem&, std::string_view completion) const {
    if (completion.empty()) return 0.0;
    double hits = 0;
    for (char c : completion) hits += wanted.find(c) != std::string::npos ? 1.0 : 0.0;
    return hits / static_cast<double>(completion.size());
  }
};

template <rlloop::Session S>
std::vector<rlloop::algorithms::PolicyGradientStats> run_toy_grpo(rlloop::TrainingClient<S> client,
                                                                  std::shared_ptr<const rlloop::Tokenizer> tokenizer,
                                                                  const std::vector<LetterProblem>& problems,
                                                                  const ShareOf& reward, int steps,
                                                                  rlloop::algorithms::PolicyGradientOptions options) {
  rlloop::algorithms::GRPO<S> grpo(std::move(client), std::move(tokenizer), std::move(options));
  std::vector<rlloop::algorithms::PolicyGradientStats> out;
  for (int s = 0; s < steps; ++s) out.push_back(grpo.step(problems, reward));
  return out;
}

}  // namespace toy
