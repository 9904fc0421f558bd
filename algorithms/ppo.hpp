// PPO with a learned value function (critic) and GAE. The session must be created with a value head
// (SessionOptions::value_head = true, local sessions): the critic is trained with the built-in `value` loss,
// the policy with `ppo`, both on the same weights, several epochs over minibatches per batch of rollouts.
//
//   auto opts = rlloop::SessionOptions{.base_model = "rlloop-small", .value_head = true};
//   rlloop::algorithms::PPO<rlloop::LocalSession> ppo(service.create_training_client(opts), tokenizer, {});
//   for (...) auto stats = ppo.step(problems, reward);
#pragma once
#include <chrono>
#include <memory>
#include <vector>

#include <rlloop/algorithms/gae.hpp>
#include <rlloop/algorithms/policy_gradient.hpp>

namespace rlloop::algorithms {

struct PpoOptions {
  int samples_per_prompt = 4;
  SamplingParams sampling{.max_tokens = 64, .temperature = 1.0};
  GaeOptions gae{};
  double clip_low = 0.2, clip_high = 0.2;  // policy ratio clipped to [1 - clip_low, 1 + clip_high]
  double value_clip = 0.2;                 // the critic may move this far from its rollout-time values per batch
  double value_coef = 0.5;                 // weight of the value loss against the policy loss
  int epochs = 2;                          // passes over each batch of rollouts
  int minibatches = 2;                     // optimizer steps per epoch
  bool whiten_advantages = true;
  AdamParams adam{.learning_rate = 1e-5};

  void validate() const {
    if (samples_per_prompt < 1) throw invalid_argument("PpoOptions::samples_per_prompt must be >= 1");
    if (sampling.max_tokens < 1) throw invalid_argument("PpoOptions::sampling.max_tokens must be >= 1");
    gae.validate();
    if (!(clip_low >= 0 && clip_low <= 1)) throw invalid_argument("PpoOptions::clip_low must be in [0, 1]");
    if (!(clip_high >= 0 && clip_high <= 9)) throw invalid_argument("PpoOptions::clip_high must be in [0, 9]");
    if (!(value_clip >= 0)) throw invalid_argument("PpoOptions::value_clip must be >= 0");
    if (!(value_coef > 0)) throw invalid_argument("PpoOptions::value_coef must be > 0");
    if (epochs < 1) throw invalid_argument("PpoOptions::epochs must be >= 1");
    if (minibatches < 1) throw invalid_argument("PpoOptions::minibatches must be >= 1");
  }
};

struct PpoStats {
  std::int64_t step = 0;
  double reward_mean = 0, accuracy = 0;
  std::int64_t sampled_tokens = 0;
  double policy_loss = 0, value_loss = 0;  // last epoch, summed over its minibatches
  double clip_fraction = 0, value_clip_fraction = 0;
  double explained_variance = 0;  // of the returns by the rollout-time values: 1 = perfect critic
  double seconds = 0;
};

// Rollout-time data of one completion for PPO.
struct PpoRollout {
  Rollout policy;               // advantages filled by GAE
  std::vector<double> values;   // critic value before each completion token
  std::vector<double> returns;  // GAE returns: the critic's targets
};

// The critic's datum: values at the completion positions regress on the returns; prompt positions weigh 0.
inline Datum value_datum(const PpoRollout& r, double weight) {
  const auto& p = r.policy;
  std::vector<token_id> input = p.prompt;
  input.insert(input.end(), p.completion.begin(), p.completion.end() - 1);
  const std::size_t n = input.size(), start = p.prompt.size() - 1;
  std::vector<float> w(n, 0.0f), returns(n, 0.0f), old(n, 0.0f);
  for (std::size_t j = 0; j < p.completion.size(); ++j) {
    w[start + j] = static_cast<float>(weight);
    returns[start + j] = static_cast<float>(r.returns[j]);
    old[start + j] = static_cast<float>(r.values[j]);
  }
  Datum d;
  d.model_input = ModelInput::from_tokens(std::move(input));
  d.loss_fn_inputs["weights"] = TensorData::from_floats(std::move(w));
  d.loss_fn_inputs["returns"] = TensorData::from_floats(std::move(returns));
  d.loss_fn_inputs["old_values"] = TensorData::from_floats(std::move(old));
  return d;
}

template <Session S>
class PPO {
 public:
  PPO(TrainingClient<S> client, std::shared_ptr<const Tokenizer> tokenizer, PpoOptions options)
      : client_(std::move(client)), tokenizer_(std::move(tokenizer)), options_(std::move(options)) {
    options_.validate();
    if (!tokenizer_) throw invalid_argument("PPO: a tokenizer is required");
    if (!client_.get_info().value_head)
      throw invalid_argument("PPO: the session needs a value head (create it with SessionOptions::value_head = true)");
  }

  const PpoOptions& options() const { return options_; }
  const PolicyGradientState& state() const { return state_; }

  template <PromptedProblem P, Reward<P> R>
  PpoStats step(const std::vector<P>& problems, const R& reward) {
    const auto t0 = std::chrono::steady_clock::now();
    PpoStats stats;
    stats.step = state_.step;
    auto rollouts = sample_and_score(problems, reward, stats);
    estimate_advantages(rollouts, stats);
    train(rollouts, stats);
    ++state_.step;
    stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return stats;
  }

 private:
  template <class P, class R>
  std::vector<PpoRollout> sample_and_score(const std::vector<P>& problems, const R& reward, PpoStats& stats) {
    auto sampler = client_.live_sampling_client();
    std::vector<std::vector<token_id>> prompts;
    std::vector<Future<SampleResponse>> pending;
    for (std::size_t i = 0; i < problems.size(); ++i) {
      prompts.push_back(tokenizer_->encode(std::string_view(problems[i].prompt)));
      SamplingParams params = options_.sampling;
      if (params.seed) params.seed = *params.seed + state_.step * 100003 + static_cast<std::int64_t>(i);
      pending.push_back(sampler.sample(ModelInput::from_tokens(prompts.back()), options_.samples_per_prompt, params));
    }
    std::vector<PpoRollout> rollouts;
    std::vector<P> contexts;
    std::vector<std::string> completions;
    for (std::size_t i = 0; i < problems.size(); ++i)
      for (const auto& seq : pending[i].get().sequences) {
        rollouts.push_back({{prompts[i], seq.tokens, seq.logprobs, {}}, {}, {}});
        contexts.push_back(problems[i]);
        completions.push_back(tokenizer_->decode(seq.tokens, /*skip_special=*/true));
        stats.sampled_tokens += static_cast<std::int64_t>(seq.tokens.size());
      }
    const auto scores = rewards::score_batch(reward, contexts, completions);
    for (std::size_t k = 0; k < scores.size(); ++k) {
      rollouts[k].policy.advantages = terminal_rewards(rollouts[k].policy.completion.size(), scores[k].value);
      stats.reward_mean += scores[k].value / static_cast<double>(scores.size());
      stats.accuracy += (scores[k].ok() ? 1.0 : 0.0) / static_cast<double>(scores.size());
    }
    return rollouts;
  }

  // Rollout-time values from the critic, then GAE per completion (rewards only at the last token).
  void estimate_advantages(std::vector<PpoRollout>& rollouts, PpoStats& stats) {
    std::vector<Datum> probe;
    for (auto& r : rollouts) {
      r.values.assign(r.policy.completion.size(), 0.0);
      r.returns.assign(r.policy.completion.size(), 0.0);
      probe.push_back(value_datum(r, 0.0));
    }
    const auto out = client_.forward(probe, LossSpec::value(options_.value_clip)).get();
    std::vector<double> all_adv, all_returns, all_values;
    for (std::size_t k = 0; k < rollouts.size(); ++k) {
      auto& r = rollouts[k];
      const auto v = out.loss_fn_outputs[k].at("values").as_doubles();
      const std::size_t start = r.policy.prompt.size() - 1, n = r.policy.completion.size();
      for (std::size_t j = 0; j < n; ++j) r.values[j] = v[start + j];
      std::vector<double> dones(n, 0.0);
      dones.back() = 1.0;
      auto g = gae(r.policy.advantages, r.values, dones, options_.gae);  // advantages hold the per-token rewards
      r.policy.advantages = std::move(g.advantages);
      r.returns = std::move(g.returns);
      all_adv.insert(all_adv.end(), r.policy.advantages.begin(), r.policy.advantages.end());
      all_returns.insert(all_returns.end(), r.returns.begin(), r.returns.end());
      all_values.insert(all_values.end(), r.values.begin(), r.values.end());
    }
    stats.explained_variance = explained_variance(all_values, all_returns);
    if (options_.whiten_advantages) {
      const auto w = whiten(all_adv);
      std::size_t i = 0;
      for (auto& r : rollouts)
        for (auto& a : r.policy.advantages) a = w[i++];
    }
  }

  void train(const std::vector<PpoRollout>& rollouts, PpoStats& stats) {
    const LossSpec policy_loss{LossFn::ppo, 1.0 - options_.clip_low, 1.0 + options_.clip_high};
    const LossSpec critic_loss = LossSpec::value(options_.value_clip);
    const std::size_t n = rollouts.size(), mb = static_cast<std::size_t>(options_.minibatches);
    const std::size_t per = (n + mb - 1) / mb;
    for (int epoch = 0; epoch < options_.epochs; ++epoch) {
      std::vector<Future<ForwardBackwardOutput>> policy_out, value_out;
      std::vector<Future<OptimStepOutput>> steps;
      for (std::size_t begin = 0; begin < n; begin += per) {
        const std::size_t end = std::min(n, begin + per);
        std::size_t tokens = 0;
        for (std::size_t i = begin; i < end; ++i) tokens += rollouts[i].policy.completion.size();
        // Token mean within the minibatch for both losses; value_coef scales the critic's share.
        std::vector<Datum> policy_batch, value_batch;
        for (std::size_t i = begin; i < end; ++i) {
          policy_batch.push_back(rollout_datum(rollouts[i].policy, 1.0 / static_cast<double>(tokens)));
          value_batch.push_back(value_datum(rollouts[i], options_.value_coef / static_cast<double>(tokens)));
        }
        policy_out.push_back(client_.forward_backward(policy_batch, policy_loss));
        value_out.push_back(client_.forward_backward(value_batch, critic_loss));
        steps.push_back(client_.optim_step(options_.adam));
      }
      stats.policy_loss = stats.value_loss = stats.clip_fraction = stats.value_clip_fraction = 0;
      for (auto& f : policy_out) {
        stats.policy_loss += f.get().metrics.at("loss:sum");
        stats.clip_fraction += f.get().metrics.at("clip_fraction") / static_cast<double>(policy_out.size());
      }
      for (auto& f : value_out) {
        stats.value_loss += f.get().metrics.at("loss:sum");
        stats.value_clip_fraction += f.get().metrics.at("value_clip_fraction") / static_cast<double>(value_out.size());
      }
      for (auto& s : steps) s.get();
    }
  }

  static double explained_variance(const std::vector<double>& predicted, const std::vector<double>& target) {
    if (target.size() < 2) return 0.0;
    std::vector<double> residual;
    for (std::size_t i = 0; i < target.size(); ++i) residual.push_back(target[i] - predicted[i]);
    const double var_target = std::pow(detail::std_of(target), 2);
    return var_target > 0 ? 1.0 - std::pow(detail::std_of(residual), 2) / var_target : 0.0;
  }

  TrainingClient<S> client_;
  std::shared_ptr<const Tokenizer> tokenizer_;
  PpoOptions options_;
  PolicyGradientState state_;
};

}  // namespace rlloop::algorithms
