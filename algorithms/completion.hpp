// A completion after a prompt as one next-token datum, the layout SFT and the preference objectives (DPO / IPO,
// KTO) train on, and the completion's summed logprob read back from it.
#pragma once
#include <span>
#include <string>
#include <vector>

#include <rlloop/error.hpp>
#include <rlloop/types.hpp>

namespace rlloop::algorithms {

// Prompt + completion as one next-token datum: weight 0 on the prompt, 1 on the completion.
inline Datum completion_datum(const std::vector<token_id>& prompt, const std::vector<token_id>& completion) {
  if (prompt.empty() || completion.empty())
    throw invalid_argument("completion_datum: prompt and completion must be non-empty");
  std::vector<token_id> full = prompt;
  full.insert(full.end(), completion.begin(), completion.end());
  std::vector<float> w(full.size() - 1, 0.0f);
  for (std::size_t j = prompt.size() - 1; j < w.size(); ++j) w[j] = 1.0f;
  Datum d;
  d.model_input = ModelInput::from_tokens(std::vector<token_id>(full.begin(), full.end() - 1));
  d.loss_fn_inputs["target_tokens"] = TensorData::from_tokens(std::vector<token_id>(full.begin() + 1, full.end()));
  d.loss_fn_inputs["weights"] = TensorData::from_floats(std::move(w));
  return d;
}

// Sum of a datum's logprobs weighted by its "weights" (1 on the completion tokens of completion_datum).
inline double weighted_logprob_sum(const Datum& d, std::span<const double> logprobs) {
  const auto w = d.loss_fn_inputs.at("weights").as_doubles();
  if (w.size() != logprobs.size())
    throw invalid_argument("weighted_logprob_sum: " + std::to_string(w.size()) + " weights but " +
                           std::to_string(logprobs.size()) + " logprobs");
  double s = 0;
  for (std::size_t j = 0; j < w.size(); ++j) s += w[j] * logprobs[j];
  return s;
}

}  // namespace rlloop::algorithms
