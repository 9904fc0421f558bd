// The policy-gradient skeleton: sample a group of completions per prompt, score them, turn rewards into
// per-token advantages (an AdvantagePolicy), weight tokens (an AggregationPolicy), and train with ppo /
// importance_sampling / cispo through any Session, for `epochs` passes of `substeps` minibatches. GRPO, Dr. GRPO,
// DAPO and RLOO (grpo.hpp) are group baselines; PPO (ppo.hpp) is the same loop with a learned critic (CriticGae).
//
//   rlloop::algorithms::GRPO<rlloop::LocalSession> grpo(training_client, tokenizer, {.group_size = 8});
//   for (int s = 0; s < steps; ++s) auto stats = grpo.step(next_problems(), reward);   // the user owns the loop
//
// All run state is in state() (PolicyGradientState, JSON-serialisable): saved with the session's save_state and
// restored with load_state, a run continues exactly as if it had not stopped (same seeds, same step numbers).
#pragma once
#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <rlloop/clients.hpp>
#include <rlloop/env.hpp>
#include <rlloop/reward.hpp>
#include <rlloop/rewards/batch.hpp>
#include <rlloop/tokenizer.hpp>

#include <rlloop/algorithms/advantages.hpp>
#include <rlloop/algorithms/aggregation.hpp>
#include <rlloop/algorithms/kl.hpp>
#include <rlloop/algorithms/rollout.hpp>

namespace rlloop::algorithms {

struct PolicyGradientOptions {
  int group_size = 8;  // completions per prompt
  SamplingParams sampling{.max_tokens = 64, .temperature = 1.0};
  LossFn loss = LossFn::ppo;        // ppo, importance_sampling or cispo
  double epsilon_low = 0.2;         // the ratio is clipped to [1 - epsilon_low, 1 + epsilon_high], as in LossSpec
  double epsilon_high = 0.2;        // (asymmetric in DAPO, e.g. 0.2 / 0.28)
  int epochs = 1;                   // passes over each batch of rollouts
  int substeps = 1;                 // optimizer steps per epoch: the rollouts are split into this many minibatches
  bool drop_uniform_groups = true;  // group advantages: a group whose rewards are all equal carries no signal
                                    // (a critic's baseline still learns from it: never dropped there)
  double kl_coef = 0.0;             // > 0 needs set_reference(): per-token penalty kl_coef * (logp - logp_ref)
  int max_staleness = 1;            // off-policy mode: a batch may be learned at most this many steps after sampling
  bool replay_routes = false;       // models with experts: train with the routes each token took when sampled
                                    // (routing replay: the ratio then compares weights, not routings)
  AdamParams adam{.learning_rate = 1e-5};

  void validate() const {
    if (group_size < 1) throw invalid_argument("PolicyGradientOptions::group_size must be >= 1");
    if (sampling.max_tokens < 1) throw invalid_argument("PolicyGradientOptions::sampling.max_tokens must be >= 1");
    if (loss != LossFn::ppo && loss != LossFn::importance_sampling && loss != LossFn::cispo)
      throw invalid_argument("PolicyGradientOptions::loss must be ppo, importance_sampling or cispo");
    if (!(epsilon_low >= 0 && epsilon_low <= 1))
      throw invalid_argument("PolicyGradientOptions::epsilon_low must be in [0, 1]");
    if (!(epsilon_high >= 0 && epsilon_high <= 9))
      throw invalid_argument("PolicyGradientOptions::epsilon_high must be in [0, 9]");
    if (epochs < 1) throw invalid_argument("PolicyGradientOptions::epochs must be >= 1");
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
  double loss = 0;           // summed weighted loss over the last epoch's minibatches
  double clip_fraction = 0;  // ppo / cispo, mean over the last epoch's minibatches
  double kl = 0;             // mean per-token k3 estimate against the reference (when kl_coef > 0)
  double entropy = 0;        // mean per-token -logprob of the sampled tokens (a sample estimate of entropy)
  double seconds_sampling = 0, seconds_training = 0;
  std::int64_t staleness = 0;  // optimizer steps between sampling this batch and learning from it
  // With a critic (CriticAdvantage) only, else 0: its loss summed over the last epoch's minibatches, the mean
  // share of its tokens where the clipped error was taken, and how much of the returns' variance it explains.
  double value_loss = 0, value_clip_fraction = 0, explained_variance = 0;
};

inline nlohmann::json to_json(const PolicyGradientStats& s) {
  return {{"step", s.step},
          {"reward_mean", s.reward_mean},
          {"reward_std", s.reward_std},
          {"accuracy", s.accuracy},
          {"groups_used", s.groups_used},
          {"groups_dropped", s.groups_dropped},
          {"sampled_tokens", s.sampled_tokens},
          {"trained_tokens", s.trained_tokens},
          {"loss", s.loss},
          {"clip_fraction", s.clip_fraction},
          {"kl", s.kl},
          {"entropy", s.entropy},
          {"seconds_sampling", s.seconds_sampling},
          {"seconds_training", s.seconds_training},
          {"staleness", s.staleness},
          {"value_loss", s.value_loss},
          {"value_clip_fraction", s.value_clip_fraction},
          {"explained_variance", s.explained_variance}};
}

// Sampling submitted for a batch of problems, not yet learned from (see PolicyGradient::submit).
template <class P>
struct PendingBatch {
  std::vector<P> problems;
  std::vector<std::vector<token_id>> prompts;
  std::vector<Future<SampleResponse>> samples;
  std::int64_t sampled_at_step = 0;
};

// Run state, apart from the immutable options: save it (as JSON) beside the session's save_state. A batch in
// flight (PendingBatch) is not part of it: save between learn() calls with none outstanding.
struct PolicyGradientState {
  std::int64_t step = 0;               // learn() calls so far
  std::int64_t batches_submitted = 0;  // submit() calls so far: picks the sampling seeds of the next batch
  bool operator==(const PolicyGradientState&) const = default;
};
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(PolicyGradientState, step, batches_submitted)

template <Session S, AdvantagePolicy<S> Advantage, AggregationPolicy Aggregation>
class PolicyGradient {
  // A type satisfying both concepts is used as a critic.
  static constexpr bool has_critic = CriticAdvantage<Advantage, S>;

 public:
  // Batch b's prompt i samples with seed + b * seed_stride + i, so no two prompts of a run share a seed while a
  // batch holds fewer prompts than seed_stride (submit() refuses a larger seeded batch). 100003, the first prime
  // over 10^5, is far above any batch size in use.
  static constexpr std::int64_t seed_stride = 100003;

  PolicyGradient(TrainingClient<S> client, std::shared_ptr<const Tokenizer> tokenizer, PolicyGradientOptions options,
                 Advantage advantage = {}, Aggregation aggregation = {})
      : client_(std::move(client)),
        tokenizer_(std::move(tokenizer)),
        options_(std::move(options)),
        advantage_(std::move(advantage)),
        aggregation_(std::move(aggregation)) {
    options_.validate();
    if (!tokenizer_) throw invalid_argument("PolicyGradient: a tokenizer is required");
    if constexpr (has_critic) advantage_.check_session(client_);
  }

  // Reference policy for the KL penalty (e.g. a sampling client of the base weights).
  void set_reference(SamplingClient<S> reference) { reference_ = std::move(reference); }

  const PolicyGradientOptions& options() const { return options_; }
  const PolicyGradientState& state() const { return state_; }
  PolicyGradientState& state() { return state_; }
  TrainingClient<S>& client() { return client_; }

  // One synchronous batch: every problem gets group_size samples from the current weights, then
  // epochs x substeps optimizer steps. Equivalent to learn(submit(problems), reward).
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
    if (options_.sampling.seed && problems.size() >= static_cast<std::size_t>(seed_stride))
      throw invalid_argument("PolicyGradient::submit: a seeded batch holds at most " + std::to_string(seed_stride - 1) +
                             " problems (got " + std::to_string(problems.size()) + "); split it");
    PendingBatch<P> batch{problems, {}, {}, state_.step};
    auto sampler = client_.live_sampling_client();
    for (std::size_t i = 0; i < problems.size(); ++i) {
      batch.prompts.push_back(tokenizer_->encode(std::string_view(problems[i].prompt)));
      SamplingParams params = options_.sampling;
      // Seeds follow the submission count (equal to the step count in synchronous use), so a batch submitted
      // ahead never repeats the draws of the one before it.
      if (params.seed)
        params.seed = *params.seed + state_.batches_submitted * seed_stride + static_cast<std::int64_t>(i);
      SampleRequest request{ModelInput::from_tokens(batch.prompts.back()), options_.group_size, params};
      request.include_routed_experts = options_.replay_routes;
      batch.samples.push_back(sampler.sample(std::move(request)));
    }
    ++state_.batches_submitted;
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
    std::vector<SampleResponse> responses;
    for (auto& f : batch.samples) responses.push_back(f.get());

    // Score all completions in parallel.
    std::vector<P> contexts;
    std::vector<std::string> completions;
    for (std::size_t i = 0; i < batch.problems.size(); ++i)
      for (const auto& seq : responses[i].sequences) {
        contexts.push_back(batch.problems[i]);
        completions.push_back(tokenizer_->decode(seq.tokens, /*skip_special=*/true));
      }
    const auto scores = rewards::score_batch(reward, contexts, completions);
    stats.seconds_sampling = std::chrono::duration<double>(clock::now() - t0).count();

    std::vector<double> rewards;
    double logprob_sum = 0;
    for (const auto& s : scores) {
      rewards.push_back(s.value);
      stats.accuracy += s.ok() ? 1.0 : 0.0;
    }
    stats.reward_mean = detail::mean_of(rewards);
    stats.reward_std = detail::std_of(rewards);
    stats.accuracy /= std::max<std::size_t>(1, scores.size());
    for (const auto& r : responses)
      for (const auto& seq : r.sequences) {
        stats.sampled_tokens += static_cast<std::int64_t>(seq.tokens.size());
        for (double lp : seq.logprobs) logprob_sum += lp;
      }
    stats.entropy = stats.sampled_tokens ? -logprob_sum / static_cast<double>(stats.sampled_tokens) : 0.0;

    std::vector<Rollout> rollouts;
    if constexpr (has_critic)
      rollouts = reward_rollouts(batch.prompts, responses, rewards, stats);
    else
      rollouts = group_rollouts(batch.prompts, responses, rewards, stats);
    if (options_.kl_coef > 0) apply_kl_penalty(rollouts, stats);
    if constexpr (has_critic)
      if (!rollouts.empty()) stats.explained_variance = advantage_.estimate(client_, rollouts).explained_variance;

    const auto t1 = clock::now();
    if (!rollouts.empty()) train(rollouts, stats);
    stats.seconds_training = std::chrono::duration<double>(clock::now() - t1).count();
    ++state_.step;
    return stats;
  }

 private:
  // Group baselines: one advantage per completion from its group's rewards, the same for all its tokens.
  std::vector<Rollout> group_rollouts(const std::vector<std::vector<token_id>>& prompts,
                                      const std::vector<SampleResponse>& responses, const std::vector<double>& rewards,
                                      PolicyGradientStats& stats) const requires(!has_critic) {
    std::vector<Rollout> rollouts;
    std::size_t k = 0;
    for (std::size_t i = 0; i < responses.size(); ++i) {
      const auto& seqs = responses[i].sequences;
      const std::span<const double> group(rewards.data() + k, seqs.size());
      k += seqs.size();
      const bool uniform = std::all_of(group.begin(), group.end(), [&](double r) { return r == group.front(); });
      if (options_.drop_uniform_groups && uniform) {
        ++stats.groups_dropped;
        continue;
      }
      ++stats.groups_used;
      const std::vector<double> adv = advantage_(group);
      for (std::size_t j = 0; j < seqs.size(); ++j) {
        rollouts.push_back(
            {prompts[i], seqs[j].tokens, seqs[j].logprobs, std::vector<double>(seqs[j].tokens.size(), adv[j])});
        rollouts.back().routed_experts = seqs[j].routed_experts;
      }
    }
    return rollouts;
  }

  // For a critic: every completion, its `advantages` holding the per-token rewards (the score at the last
  // token) until the critic's estimate replaces them.
  static std::vector<Rollout> reward_rollouts(const std::vector<std::vector<token_id>>& prompts,
                                              const std::vector<SampleResponse>& responses,
                                              const std::vector<double>& rewards,
                                              PolicyGradientStats& stats) requires has_critic {
    std::vector<Rollout> rollouts;
    std::size_t k = 0;
    for (std::size_t i = 0; i < responses.size(); ++i) {
      ++stats.groups_used;
      for (const auto& seq : responses[i].sequences) {
        rollouts.push_back({prompts[i], seq.tokens, seq.logprobs, terminal_rewards(seq.tokens.size(), rewards[k++])});
        rollouts.back().routed_experts = seq.routed_experts;
      }
    }
    return rollouts;
  }

  // Per-token penalty A_t -= kl_coef * (logp_t - logp_ref_t); with a critic it shapes the per-token rewards
  // before GAE. The sampler logprobs stand for the policy (they are on-policy at sampling time).
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

  // epochs passes of substeps minibatches, each its policy (and critic) forward_backward then an optim_step,
  // submitted back to back: the session runs them in order while the next minibatch is built. The reported
  // losses and clip fractions are the last epoch's.
  void train(const std::vector<Rollout>& rollouts, PolicyGradientStats& stats) {
    const LossSpec loss{options_.loss, options_.epsilon_low, options_.epsilon_high};
    const std::size_t n = rollouts.size();
    const std::size_t per =
        (n + static_cast<std::size_t>(options_.substeps) - 1) / static_cast<std::size_t>(options_.substeps);
    for (int epoch = 0; epoch < options_.epochs; ++epoch) {
      std::vector<Future<ForwardBackwardOutput>> policy_out, critic_out;
      std::vector<Future<OptimStepOutput>> steps;
      for (std::size_t begin = 0; begin < n; begin += per) {
        const std::size_t end = std::min(n, begin + per);
        std::vector<std::size_t> lengths;
        for (std::size_t i = begin; i < end; ++i) lengths.push_back(rollouts[i].completion.size());
        const std::vector<double> weights = aggregation_(lengths, options_.sampling.max_tokens);
        std::vector<Datum> minibatch;
        for (std::size_t i = begin; i < end; ++i) {
          minibatch.push_back(rollout_datum(rollouts[i], weights[i - begin]));
          stats.trained_tokens += static_cast<std::int64_t>(minibatch.back().model_input.length());
        }
        policy_out.push_back(client_.forward_backward(minibatch, loss));
        if constexpr (has_critic)
          critic_out.push_back(
              advantage_.train(client_, std::span<const Rollout>(rollouts).subspan(begin, end - begin)));
        steps.push_back(client_.optim_step(options_.adam));
      }
      double clipped = 0, value_clipped = 0;
      stats.loss = stats.value_loss = 0;
      for (auto& f : policy_out) {
        const auto& m = f.get().metrics;
        stats.loss += m.at("loss:sum");
        if (auto it = m.find("clip_fraction"); it != m.end()) clipped += it->second;
      }
      for (auto& f : critic_out) {
        const auto& m = f.get().metrics;
        stats.value_loss += m.at("loss:sum");
        value_clipped += m.at("value_clip_fraction");
      }
      for (auto& s : steps) s.get();
      stats.clip_fraction = clipped / static_cast<double>(policy_out.size());
      if constexpr (has_critic) stats.value_clip_fraction = value_clipped / static_cast<double>(critic_out.size());
    }
  }

  TrainingClient<S> client_;
  std::shared_ptr<const Tokenizer> tokenizer_;
  PolicyGradientOptions options_;
  Advantage advantage_;
  Aggregation aggregation_;
  std::optional<SamplingClient<S>> reference_;
  PolicyGradientState state_;
};

}  // namespace rlloop::algorithms
