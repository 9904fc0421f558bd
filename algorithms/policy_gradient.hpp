// The policy-gradient core: sample a group of completions per prompt, score them, turn rewards into
// advantages (AdvantagePolicy), weight tokens (AggregationPolicy), and train with ppo / importance_sampling /
// cispo through any Session. GRPO, Dr. GRPO, DAPO and RLOO are aliases at the bottom (grpo.hpp).
//
//   rlloop::algorithms::GRPO<rlloop::LocalSession> grpo(training_client, tokenizer, {.group_size = 8});
//   for (int s = 0; s < steps; ++s) auto stats = grpo.step(next_problems(), reward);   // the user owns the loop
#pragma once
#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <rlloop/clients.hpp>
#include <rlloop/env.hpp>
#include <rlloop/reward.hpp>
#include <rlloop/rewards/batch.hpp>
#include <rlloop/tokenizer.hpp>

#include <rlloop/algorithms/advantages.hpp>
#include <rlloop/algorithms/aggregation.hpp>
#include <rlloop/algorithms/kl.hpp>

namespace rlloop::algorithms {

struct PolicyGradientOptions {
  int group_size = 8;  // completions per prompt
  SamplingParams sampling{.max_tokens = 64, .temperature = 1.0};
  LossFn loss = LossFn::ppo;  // ppo, importance_sampling or cispo
  double clip_low = 0.2;      // the ratio is clipped to [1 - clip_low, 1 + clip_high] (asymmetric in DAPO)
  double clip_high = 0.2;
  int substeps = 1;                 // optimizer steps per batch: the rollouts are split into this many minibatches
  bool drop_uniform_groups = true;  // a group whose rewards are all equal carries no signal
  double kl_coef = 0.0;             // > 0 needs set_reference(): per-token penalty kl_coef * (logp - logp_ref)
  int max_staleness = 1;            // off-policy mode: a batch may be learned at most this many steps after sampling
  AdamParams adam{.learning_rate = 1e-5};

  void validate() const {
    if (group_size < 1) throw invalid_argument("PolicyGradientOptions::group_size must be >= 1");
    if (sampling.max_tokens < 1) throw invalid_argument("PolicyGradientOptions::sampling.max_tokens must be >= 1");
    if (loss != LossFn::ppo && loss != LossFn::importance_sampling && loss != LossFn::cispo)
      throw invalid_argument("PolicyGradientOptions::loss must be ppo, importance_sampling or cispo");
    if (!(clip_low >= 0 && clip_low <= 1)) throw invalid_argument("PolicyGradientOptions::clip_low must be in [0, 1]");
    if (!(clip_high >= 0 && clip_high <= 9))
      throw invalid_argument("PolicyGradientOptions::clip_high must be in [0, 9]");
    if (substeps < 1) throw invalid_argument("PolicyGradientOptions::substeps must be >= 1");
    if (!(kl_coef >= 0)) throw invalid_argument("PolicyGradientOptions::kl_coef must be >= 0");
    if (max_staleness < 0) throw invalid_argument("PolicyGradientOptions::max_staleness must be >= 0");
  }
};

struct PolicyGradientStats {
  std::int64_t step = 0;
  double reward_mean = 0, reward_std = 0;
  double accuracy = 0;  // share of completions whose Score is ok (graded right)
  int groups_used = 0, groups_dropped = 0;
  std::int64_t sampled_tokens = 0, trained_tokens = 0;
  double loss = 0;           // summed weighted loss over the minibatches
  double clip_fraction = 0;  // ppo / cispo
  double kl = 0;             // mean per-token k3 estimate against the reference (when kl_coef > 0)
  double entropy = 0;        // mean per-token -logprob of the sampled tokens (a sample estimate of entropy)
  double seconds_sampling = 0, seconds_training = 0;
  std::int64_t staleness = 0;  // optimizer steps between sampling this batch and learning from it
};

// Sampling submitted for a batch of problems, not yet learned from (see PolicyGradient::submit).
template <class P>
struct PendingBatch {
  std::vector<P> problems;
  std::vector<std::vector<token_id>> prompts;
  std::vector<Future<SampleResponse>> samples;
  std::int64_t sampled_at_step = 0;
};

// Run state, apart from the immutable options (saved with the session checkpoint by the caller if needed).
struct PolicyGradientState {
  std::int64_t step = 0;
};

// One sampled completion ready for training.
struct Rollout {
  std::vector<token_id> prompt;
  std::vector<token_id> completion;
  std::vector<double> logprobs;    // sampler logprobs of the completion tokens
  std::vector<double> advantages;  // per completion token
};

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
  return d;
}

template <Session S, class AdvantagePolicy, class AggregationPolicy>
class PolicyGradient {
 public:
  PolicyGradient(TrainingClient<S> client, std::shared_ptr<const Tokenizer> tokenizer, PolicyGradientOptions options,
                 AdvantagePolicy advantage = {}, AggregationPolicy aggregation = {})
      : client_(std::move(client)),
        tokenizer_(std::move(tokenizer)),
        options_(std::move(options)),
        advantage_(std::move(advantage)),
        aggregation_(std::move(aggregation)) {
    options_.validate();
    if (!tokenizer_) throw invalid_argument("PolicyGradient: a tokenizer is required");
  }

  // Reference policy for the KL penalty (e.g. a sampling client of the base weights).
  void set_reference(SamplingClient<S> reference) { reference_ = std::move(reference); }

  const PolicyGradientOptions& options() const { return options_; }
  const PolicyGradientState& state() const { return state_; }
  PolicyGradientState& state() { return state_; }
  TrainingClient<S>& client() { return client_; }

  // One synchronous batch: every problem gets group_size samples from the current weights, then substeps
  // optimizer steps. Equivalent to learn(submit(problems), reward).
  template <PromptedProblem P, Reward<P> R>
  PolicyGradientStats step(const std::vector<P>& problems, const R& reward) {
    auto batch = submit(problems);
    return learn(batch, reward);
  }

  // Off-policy mode, for overlapping rollouts with learning:
  //   auto pending = algo.submit(next());
  //   for (...) { auto ahead = algo.submit(next()); stats = algo.learn(pending, reward); pending = std::move(ahead); }
  // `ahead` is sampled from the weights before learn()'s update (staleness 1); the ppo / cispo ratio against
  // the sampler's logprobs corrects for it, and scoring one batch overlaps sampling the next.
  template <PromptedProblem P>
  PendingBatch<P> submit(const std::vector<P>& problems) {
    PendingBatch<P> batch{problems, {}, {}, state_.step};
    auto sampler = client_.live_sampling_client();
    for (std::size_t i = 0; i < problems.size(); ++i) {
      batch.prompts.push_back(tokenizer_->encode(std::string_view(problems[i].prompt)));
      SamplingParams params = options_.sampling;
      // Seeds follow the submission count (equal to the step count in synchronous use), so a batch submitted
      // ahead never repeats the draws of the one before it.
      if (params.seed) params.seed = *params.seed + submitted_ * 100003 + static_cast<std::int64_t>(i);
      batch.samples.push_back(
          sampler.sample(ModelInput::from_tokens(batch.prompts.back()), options_.group_size, params));
    }
    ++submitted_;
    return batch;
  }

  // Waits for a submitted batch, scores it and trains on it. Refuses a batch older than max_staleness steps.
  template <PromptedProblem P, Reward<P> R>
  PolicyGradientStats learn(PendingBatch<P>& batch, const R& reward) {
    using clock = std::chrono::steady_clock;
    if (options_.kl_coef > 0 && !reference_)
      throw invalid_argument("PolicyGradient::learn: kl_coef > 0 needs set_reference()");
    PolicyGradientStats stats;
    stats.step = state_.step;
    stats.staleness = state_.step - batch.sampled_at_step;
    if (stats.staleness > options_.max_staleness)
      throw invalid_argument("PolicyGradient::learn: the batch was sampled " + std::to_string(stats.staleness) +
                             " steps ago, more than max_staleness = " + std::to_string(options_.max_staleness));
    const auto t0 = clock::now();
    const auto& problems = batch.problems;
    const auto& prompts = batch.prompts;
    auto& pending = batch.samples;
    std::vector<SampleResponse> responses;
    for (auto& f : pending) responses.push_back(f.get());

    // Score all completions in parallel.
    std::vector<P> contexts;
    std::vector<std::string> completions;
    for (std::size_t i = 0; i < problems.size(); ++i)
      for (const auto& seq : responses[i].sequences) {
        contexts.push_back(problems[i]);
        completions.push_back(tokenizer_->decode(seq.tokens, /*skip_special=*/true));
      }
    const auto scores = rewards::score_batch(reward, contexts, completions);
    stats.seconds_sampling = std::chrono::duration<double>(clock::now() - t0).count();

    std::vector<double> all_rewards;
    double logprob_sum = 0;
    for (const auto& s : scores) {
      all_rewards.push_back(s.value);
      stats.accuracy += s.ok() ? 1.0 : 0.0;
    }
    stats.reward_mean = detail::mean_of(all_rewards);
    stats.reward_std = detail::std_of(all_rewards);
    stats.accuracy /= std::max<std::size_t>(1, scores.size());

    std::vector<Rollout> rollouts;
    std::size_t k = 0;
    for (std::size_t i = 0; i < problems.size(); ++i) {
      const auto& seqs = responses[i].sequences;
      std::vector<double> group(all_rewards.begin() + static_cast<std::ptrdiff_t>(k),
                                all_rewards.begin() + static_cast<std::ptrdiff_t>(k + seqs.size()));
      k += seqs.size();
      for (const auto& seq : seqs) {
        stats.sampled_tokens += static_cast<std::int64_t>(seq.tokens.size());
        for (double lp : seq.logprobs) logprob_sum += lp;
      }
      const bool uniform = std::all_of(group.begin(), group.end(), [&](double r) { return r == group.front(); });
      if (options_.drop_uniform_groups && uniform) {
        ++stats.groups_dropped;
        continue;
      }
      ++stats.groups_used;
      const auto adv = advantage_(group);
      for (std::size_t j = 0; j < seqs.size(); ++j)
        rollouts.push_back(
            {prompts[i], seqs[j].tokens, seqs[j].logprobs, std::vector<double>(seqs[j].tokens.size(), adv[j])});
    }
    stats.entropy = stats.sampled_tokens ? -logprob_sum / static_cast<double>(stats.sampled_tokens) : 0.0;
    if (options_.kl_coef > 0) apply_kl_penalty(rollouts, stats);

    const auto t1 = clock::now();
    if (!rollouts.empty()) train(rollouts, stats);
    stats.seconds_training = std::chrono::duration<double>(clock::now() - t1).count();
    ++state_.step;
    return stats;
  }

 private:
  // Per-token penalty in the advantage: A_t -= kl_coef * (logp_t - logp_ref_t). The sampler logprobs stand
  // for the policy (they are on-policy at sampling time).
  void apply_kl_penalty(std::vector<Rollout>& rollouts, PolicyGradientStats& stats) {
    std::vector<Future<std::vector<double>>> refs;
    for (const auto& r : rollouts) {
      std::vector<token_id> full = r.prompt;
      full.insert(full.end(), r.completion.begin(), r.completion.end());
      refs.push_back(reference_->compute_logprobs(ModelInput::from_tokens(std::move(full))));
    }
    double kl_sum = 0;
    std::int64_t tokens = 0;
    for (std::size_t i = 0; i < rollouts.size(); ++i) {
      const auto& ref = refs[i].get();
      auto& r = rollouts[i];
      for (std::size_t j = 0; j < r.completion.size(); ++j) {
        const double log_ratio = r.logprobs[j] - ref[r.prompt.size() + j];
        r.advantages[j] -= options_.kl_coef * kl_k1(log_ratio);
        kl_sum += kl_k3(log_ratio);
        ++tokens;
      }
    }
    stats.kl = tokens ? kl_sum / static_cast<double>(tokens) : 0.0;
  }

  void train(const std::vector<Rollout>& rollouts, PolicyGradientStats& stats) {
    const LossSpec loss{options_.loss, 1.0 - options_.clip_low, 1.0 + options_.clip_high};
    const std::size_t n = rollouts.size();
    const std::size_t per =
        (n + static_cast<std::size_t>(options_.substeps) - 1) / static_cast<std::size_t>(options_.substeps);
    std::vector<Future<ForwardBackwardOutput>> fbs;
    std::vector<Future<OptimStepOutput>> steps;
    for (std::size_t begin = 0; begin < n; begin += per) {
      const std::size_t end = std::min(n, begin + per);
      std::vector<std::size_t> lengths;
      for (std::size_t i = begin; i < end; ++i) lengths.push_back(rollouts[i].completion.size());
      const auto weights = aggregation_(lengths, options_.sampling.max_tokens);
      std::vector<Datum> batch;
      for (std::size_t i = begin; i < end; ++i) {
        batch.push_back(rollout_datum(rollouts[i], weights[i - begin]));
        stats.trained_tokens += static_cast<std::int64_t>(batch.back().model_input.length());
      }
      // Submitted back to back: the session runs them in order while we build the next minibatch.
      fbs.push_back(client_.forward_backward(batch, loss));
      steps.push_back(client_.optim_step(options_.adam));
    }
    double clipped = 0;
    for (auto& f : fbs) {
      const auto& out = f.get();
      stats.loss += out.metrics.at("loss:sum");
      if (auto it = out.metrics.find("clip_fraction"); it != out.metrics.end()) clipped += it->second;
    }
    for (auto& s : steps) s.get();
    stats.clip_fraction = clipped / static_cast<double>(fbs.size());
  }

  TrainingClient<S> client_;
  std::shared_ptr<const Tokenizer> tokenizer_;
  PolicyGradientOptions options_;
  AdvantagePolicy advantage_;
  AggregationPolicy aggregation_;
  std::optional<SamplingClient<S>> reference_;
  PolicyGradientState state_;
  std::int64_t submitted_ = 0;  // batches submitted so far
};

}  // namespace rlloop::algorithms
