// A sampled completion on its way to training, and the datums the policy-gradient loop builds from it: the
// policy's (rollout_datum, for ppo / importance_sampling / cispo) and the critic's (value_datum, for `value`).
#pragma once
#include <optional>
#include <vector>

#include <rlloop/error.hpp>
#include <rlloop/types.hpp>

namespace rlloop::algorithms {

struct Rollout {
  std::vector<token_id> prompt;
  std::vector<token_id> completion;
  std::vector<double> logprobs;    // sampler logprobs of the completion tokens
  std::vector<double> advantages;  // per completion token
  // Filled by a critic (CriticAdvantage) only: its value before each completion token at rollout time, and
  // the returns it regresses on.
  std::vector<double> values;
  std::vector<double> returns;
  // The sampler's routes (SampledSequence::routed_experts) when sampled with them: the datums carry them, so that
  // training routes every token as sampling did (routing replay, models with experts).
  std::optional<TensorData> routed_experts;
};

// Sequence-level reward as per-token rewards: zero everywhere except the last token (the usual LLM setting,
// where the reward model or verifier scores the whole completion).
inline std::vector<double> terminal_rewards(std::size_t length, double reward) {
  if (length == 0) throw invalid_argument("terminal_rewards: length must be >= 1");
  std::vector<double> r(length, 0.0);
  r.back() = reward;
  return r;
}

// Next-token datum of prompt + completion: only completion tokens carry weight, advantage and logprob.
inline Datum rollout_datum(const Rollout& r, double weight) {
  std::vector<token_id> full = r.prompt;
  full.insert(full.end(), r.completion.begin(), r.completion.end());
  const std::size_t n = full.size() - 1, start = r.prompt.size() - 1;
  std::vector<float> w(n, 0.0f), adv(n, 0.0f), q(n, 0.0f);
  for (std::size_t j = 0; j < r.completion.size(); ++j) {
    w[start + j] = static_cast<float>(weight);
    adv[start + j] = static_cast<float>(r.advantages[j]);
    q[start + j] = static_cast<float>(r.logprobs[j]);
  }
  Datum d;
  d.model_input = ModelInput::from_tokens(std::vector<token_id>(full.begin(), full.end() - 1));
  d.loss_fn_inputs["target_tokens"] = TensorData::from_tokens(std::vector<token_id>(full.begin() + 1, full.end()));
  d.loss_fn_inputs["weights"] = TensorData::from_floats(std::move(w));
  d.loss_fn_inputs["advantages"] = TensorData::from_floats(std::move(adv));
  d.loss_fn_inputs["logprobs"] = TensorData::from_floats(std::move(q));
  if (r.routed_experts) d.loss_fn_inputs["routed_experts"] = *r.routed_experts;
  return d;
}

// The critic's datum: values at the completion positions regress on the returns; prompt positions weigh 0.
// The value before the first completion token is read at the last prompt position, so the input is
// prompt + completion without its last token, as in rollout_datum.
inline Datum value_datum(const Rollout& r, double weight) {
  std::vector<token_id> input = r.prompt;
  input.insert(input.end(), r.completion.begin(), r.completion.end() - 1);
  const std::size_t n = input.size(), start = r.prompt.size() - 1;
  std::vector<float> w(n, 0.0f), returns(n, 0.0f), old(n, 0.0f);
  for (std::size_t j = 0; j < r.completion.size(); ++j) {
    w[start + j] = static_cast<float>(weight);
    returns[start + j] = static_cast<float>(r.returns[j]);
    old[start + j] = static_cast<float>(r.values[j]);
  }
  Datum d;
  d.model_input = ModelInput::from_tokens(std::move(input));
  d.loss_fn_inputs["weights"] = TensorData::from_floats(std::move(w));
  d.loss_fn_inputs["returns"] = TensorData::from_floats(std::move(returns));
  d.loss_fn_inputs["old_values"] = TensorData::from_floats(std::move(old));
  if (r.routed_experts) d.loss_fn_inputs["routed_experts"] = *r.routed_experts;
  return d;
}

}  // namespace rlloop::algorithms
