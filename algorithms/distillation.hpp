// On-policy distillation (Agarwal et al., "On-Policy Distillation of Language Models", ICLR 2024): the student
// samples, a teacher scores the student's own tokens, and the per-token reverse KL is the advantage of an
// importance-sampling update. With student_lp_t the sampler's logprob of completion token t and teacher_lp_t the
// teacher's logprob of the same token after the same context,
//   A_t = kl_coef * (teacher_lp_t - student_lp_t + b)  +  reward_coef * RewardAdvantage(group rewards)_i
// with b the batch's mean of student_lp - teacher_lp (a baseline, DistillationOptions::kl_baseline; 0 without it)
// and the second term only when a task reward is given. The importance_sampling loss -(r * A).sum() then descends the
// reverse KL E_student[log student - log teacher] token by token: the student moves its mass to where the teacher
// puts its own, on the states the student reaches itself (SFT on the teacher's samples trains on states the
// student may never reach).
//
//   Distillation<LocalSession, SamplingClient<LocalSession>> distill(student, tokenizer, teacher, tokenizer, {});
//   for (int s = 0; s < steps; ++s) auto stats = distill.step(next_problems());   // the user owns the loop
//
// The teacher is anything that scores tokens (the Teacher concept): a SamplingClient of another session, of
// another base model, or a client of a remote service. It must read the student's tokenizer, since it scores the
// student's token ids as they are; the constructor refuses a teacher whose tokenizer is another, naming both.
// Their chat renderers may differ: a problem with a `teacher_prompt` member gives the teacher that prompt (the same
// conversation in the teacher's format) in front of the student's completion.
//
// The loop is the policy-gradient one's (policy_gradient.hpp): submit() is PolicyGradient::submit (the same seeds),
// learn() builds Rollouts and trains on rollout_datum()s, state() is a PolicyGradientState. One pass over each batch
// (substeps minibatches): the teacher's advantages are those of the sampling weights, and importance_sampling does
// not clip a ratio that later passes would move away from 1.
#pragma once
#include <algorithm>
#include <chrono>
#include <concepts>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include <rlloop/clients.hpp>
#include <rlloop/env.hpp>
#include <rlloop/reward.hpp>
#include <rlloop/rewards/batch.hpp>
#include <rlloop/tokenizer.hpp>

#include <rlloop/algorithms/advantages.hpp>
#include <rlloop/algorithms/aggregation.hpp>
#include <rlloop/algorithms/completion.hpp>
#include <rlloop/algorithms/policy_gradient.hpp>
#include <rlloop/algorithms/rollout.hpp>

namespace rlloop::algorithms {

// A teacher scores tokens: the logprob of every token of an input given the ones before it (the first gets 0.0),
// as SamplingClient::compute_logprobs does. A teacher may also say what its tokenizer is called, for errors:
// `std::string tokenizer_name() const`; a SamplingClient's is its session's SessionInfo::tokenizer.
template <class T>
concept Teacher = std::copy_constructible<T> && requires(const T& teacher, const ModelInput& input) {
  { teacher.compute_logprobs(input) } -> std::same_as<Future<std::vector<double>>>;
};

// A teacher that also scores a whole batch in one call: compute_logprobs_batch(inputs)[i] is what
// compute_logprobs(inputs[i]) gives, within float rounding. teacher_logprobs asks such a teacher once per step
// (TrainingTeacher below: one padded forward pass instead of one pass per completion).
template <class T>
concept BatchTeacher = Teacher<T> && requires(const T& teacher, std::span<const ModelInput> inputs) {
  { teacher.compute_logprobs_batch(inputs) } -> std::same_as<std::vector<std::vector<double>>>;
};

// A teacher scored by a training session's forward pass with the session's current weights (what its live
// SamplingClient samples): a batch in one pass. The main job's 64 completions (SmolLM2-135M, Q4_1 base, LoRA, 2 CPU
// cores): 23.3 s as 64 compute_logprobs calls, 10.7 s as one batch (bench/README.md, teacher_scoring_bench).
template <Session S>
class TrainingTeacher {
 public:
  explicit TrainingTeacher(TrainingClient<S> client) : client_(std::move(client)) {}

  Future<std::vector<double>> compute_logprobs(const ModelInput& input) const {
    return client_.live_sampling_client().compute_logprobs(input);
  }
  std::vector<std::vector<double>> compute_logprobs_batch(std::span<const ModelInput> inputs) const {
    // Datum i predicts tokens 1..n-1 of input i from the ones before (its first token as the "prompt"); token 0
    // gets 0.0, as compute_logprobs gives.
    std::vector<Datum> data;
    std::vector<std::size_t> scored;  // which inputs have a token to predict
    for (std::size_t i = 0; i < inputs.size(); ++i) {
      const std::vector<token_id> tokens = inputs[i].tokens();
      if (tokens.empty()) throw invalid_argument("TrainingTeacher: input " + std::to_string(i) + " is empty");
      if (tokens.size() == 1) continue;
      data.push_back(completion_datum({tokens.front()}, std::vector<token_id>(tokens.begin() + 1, tokens.end())));
      scored.push_back(i);
    }
    std::vector<std::vector<double>> out(inputs.size());
    for (std::size_t i = 0; i < inputs.size(); ++i) out[i].assign(inputs[i].length(), 0.0);
    if (data.empty()) return out;
    TrainingClient<S> client = client_;  // (forward is not const: it runs on the session)
    const ForwardBackwardOutput pass = client.forward(data, LossSpec::cross_entropy()).get();
    for (std::size_t k = 0; k < scored.size(); ++k) {
      const std::vector<double> lp = pass.logprobs(k);
      std::vector<double>& row = out[scored[k]];
      if (lp.size() + 1 != row.size())
        throw invalid_argument("TrainingTeacher: the forward pass returned " + std::to_string(lp.size()) +
                               " logprobs for " + std::to_string(row.size() - 1) + " targets");
      std::copy(lp.begin(), lp.end(), row.begin() + 1);
    }
    return out;
  }
  std::string tokenizer_name() const { return client_.get_info().tokenizer; }

 private:
  TrainingClient<S> client_;
};

// What makes two tokenizers one for distillation: every id decodes to the same bytes. The teacher scores the
// student's ids as they are, so only the id -> bytes map matters; merges, normalizers and chat templates shape how
// text becomes ids, not what an id means. The hash is FNV-1a (64-bit) over each id's decoded bytes, each prefixed
// by its length (so that "a" + "bc" and "ab" + "c" differ); an id the tokenizer cannot decode counts as a length of
// 2^64 - 1. Computed once per tokenizer (one decode per id: 0.03 s for Qwen3's 151,669 ids).
struct TokenizerFingerprint {
  std::int64_t vocab_size = 0;
  std::uint64_t hash = 0;
  bool operator==(const TokenizerFingerprint&) const = default;

  std::string to_string() const {
    char hex[17];
    std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(hash));
    return std::to_string(vocab_size) + " ids, fingerprint " + hex;
  }
};

inline TokenizerFingerprint tokenizer_fingerprint(const Tokenizer& tokenizer) {
  std::uint64_t h = 1469598103934665603ull;
  auto mix = [&h](std::string_view bytes) {
    for (unsigned char c : bytes) h = (h ^ c) * 1099511628211ull;
  };
  auto mix_length = [&mix](std::uint64_t n) {
    char le[8];
    for (int k = 0; k < 8; ++k) le[k] = static_cast<char>((n >> (8 * k)) & 0xff);
    mix(std::string_view(le, 8));
  };
  const std::int64_t n = tokenizer.vocab_size();
  for (std::int64_t id = 0; id < n; ++id) {
    const token_id one[1] = {static_cast<token_id>(id)};
    std::string bytes;
    try {
      bytes = tokenizer.decode(std::span<const token_id>(one, 1), /*skip_special=*/false);
    } catch (const invalid_argument&) {
      mix_length(~std::uint64_t{0});
      continue;
    }
    mix_length(bytes.size());
    mix(bytes);
  }
  return {n, h};
}

struct DistillationOptions {
  int group_size = 4;  // student samples per prompt
  SamplingParams sampling{.max_tokens = 64, .temperature = 1.0};
  double kl_coef = 1.0;      // weight of the reverse-KL advantage teacher_lp - student_lp
  // Subtract the batch's mean reverse KL from every token's advantage (a baseline, as Tinker's cookbook does): the
  // same expected gradient, less variance. Without it a student far from the teacher sees almost every token's
  // advantage far below 0 and mostly learns what not to write (rlloop-small, a teacher SFT-trained for 60 steps,
  // 8 prompts x 4 samples per step: the held-out KL fell 6.52 -> 3.72 in 20 steps without it, -> 3.21 with it).
  bool kl_baseline = true;
  double reward_coef = 0.0;  // weight of the task reward's group advantage; > 0 needs step(problems, reward)
  int substeps = 1;          // optimizer steps per batch: the rollouts are split into this many minibatches
  int max_staleness = 1;     // off-policy mode: a batch may be learned at most this many steps after sampling
  AdamParams adam{.learning_rate = 1e-4};

  void validate() const {
    if (group_size < 1) throw invalid_argument("DistillationOptions::group_size must be >= 1");
    if (sampling.max_tokens < 1) throw invalid_argument("DistillationOptions::sampling.max_tokens must be >= 1");
    if (!(kl_coef >= 0 && kl_coef < 1e6)) throw invalid_argument("DistillationOptions::kl_coef must be in [0, 1e6)");
    if (!(reward_coef >= 0 && reward_coef < 1e6))
      throw invalid_argument("DistillationOptions::reward_coef must be in [0, 1e6)");
    if (kl_coef == 0 && reward_coef == 0)
      throw invalid_argument("DistillationOptions::kl_coef and reward_coef are both 0: nothing to learn from");
    if (substeps < 1) throw invalid_argument("DistillationOptions::substeps must be >= 1");
    if (max_staleness < 0) throw invalid_argument("DistillationOptions::max_staleness must be >= 0");
    if (!(adam.learning_rate > 0)) throw invalid_argument("DistillationOptions::adam.learning_rate must be > 0");
  }
};

struct DistillationStats {
  std::int64_t step = 0;
  // Mean over the batch's sampled tokens of student_lp - teacher_lp: the per-token reverse KL KL(student || teacher)
  // estimated on the student's own samples (k1; unbiased, a single token's can be negative). What distillation
  // lowers.
  double reverse_kl = 0;
  double teacher_logprob = 0;  // mean teacher logprob of the sampled tokens
  double entropy = 0;          // mean -student_lp of the sampled tokens (a sample estimate of the student's entropy)
  double reward_mean = 0, reward_std = 0, accuracy = 0;  // with a task reward only, else 0
  std::int64_t sampled_tokens = 0, trained_tokens = 0;
  // Summed weighted loss over the batch's minibatches. With TokenMean weights it is -mean(A) at the sampling
  // weights: about 0 with the baseline and no reward (the gradient carries the signal; watch reverse_kl).
  double loss = 0;
  double seconds_sampling = 0, seconds_teacher = 0, seconds_training = 0;
  std::int64_t staleness = 0;  // optimizer steps between sampling this batch and learning from it
};

inline nlohmann::json to_json(const DistillationStats& s) {
  return {{"step", s.step},
          {"reverse_kl", s.reverse_kl},
          {"teacher_logprob", s.teacher_logprob},
          {"entropy", s.entropy},
          {"reward_mean", s.reward_mean},
          {"reward_std", s.reward_std},
          {"accuracy", s.accuracy},
          {"sampled_tokens", s.sampled_tokens},
          {"trained_tokens", s.trained_tokens},
          {"loss", s.loss},
          {"seconds_sampling", s.seconds_sampling},
          {"seconds_teacher", s.seconds_teacher},
          {"seconds_training", s.seconds_training},
          {"staleness", s.staleness}};
}

// The run state is the policy-gradient loop's: learn() calls and submit() calls (which pick the sampling seeds).
using DistillationState = PolicyGradientState;

namespace detail {
// A problem's prompt for the teacher: its `teacher_prompt` when it has one (the conversation in the teacher's chat
// format), else the student's.
template <class P>
std::string_view teacher_prompt_of(const P& problem) {
  if constexpr (requires {
                  { problem.teacher_prompt } -> std::convertible_to<std::string_view>;
                })
    return problem.teacher_prompt;
  else
    return problem.prompt;
}

template <class T>
std::string teacher_tokenizer_name(const T& teacher) {
  if constexpr (requires {
                  { teacher.tokenizer_name() } -> std::convertible_to<std::string>;
                })
    return teacher.tokenizer_name();
  else if constexpr (requires { teacher.session().info().tokenizer; })
    return teacher.session().info().tokenizer;
  else
    return "unnamed";
}
}  // namespace detail

// The teacher's logprob of every completion token of prompts[i] + completions[i]: one batch call for a
// BatchTeacher, else every compute_logprobs call submitted before the first is awaited.
template <Teacher T>
std::vector<std::vector<double>> teacher_logprobs(const T& teacher, std::span<const std::vector<token_id>> prompts,
                                                  std::span<const std::vector<token_id>> completions) {
  if (prompts.size() != completions.size())
    throw invalid_argument("teacher_logprobs: " + std::to_string(prompts.size()) + " prompts but " +
                           std::to_string(completions.size()) + " completions");
  std::vector<ModelInput> inputs;
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    std::vector<token_id> full = prompts[i];
    full.insert(full.end(), completions[i].begin(), completions[i].end());
    inputs.push_back(ModelInput::from_tokens(std::move(full)));
  }
  std::vector<std::vector<double>> scores;
  if constexpr (BatchTeacher<T>) {
    scores = teacher.compute_logprobs_batch(inputs);
    if (scores.size() != inputs.size())
      throw invalid_argument("teacher_logprobs: the teacher scored " + std::to_string(scores.size()) + " of " +
                             std::to_string(inputs.size()) + " inputs");
  } else {
    std::vector<Future<std::vector<double>>> pending;
    for (const auto& input : inputs) pending.push_back(teacher.compute_logprobs(input));
    for (auto& p : pending) scores.push_back(p.get());
  }
  std::vector<std::vector<double>> out;
  for (std::size_t i = 0; i < scores.size(); ++i) {
    const auto& lp = scores[i];
    const std::size_t start = prompts[i].size(), n = completions[i].size();
    if (lp.size() != start + n)
      throw invalid_argument("teacher_logprobs: the teacher returned " + std::to_string(lp.size()) +
                             " logprobs for " + std::to_string(start + n) + " tokens");
    out.emplace_back(lp.begin() + static_cast<std::ptrdiff_t>(start), lp.end());
  }
  return out;
}

// The per-token reverse KL of a student against a teacher on the student's own samples: the mean of
// student_lp - teacher_lp over every sampled token of num_samples completions of each prompt. How a held-out set
// measures what Distillation lowers (DistillationStats::reverse_kl is the same on the training batch). A seeded
// `sampling` gives prompt i the seed seed + i.
struct ReverseKl {
  double per_token = 0;
  double teacher_logprob = 0;  // mean over the same tokens
  std::int64_t tokens = 0;
};

template <Session S, Teacher T>
ReverseKl measure_reverse_kl(const SamplingClient<S>& student, const T& teacher,
                             const std::vector<std::vector<token_id>>& prompts, int num_samples,
                             const SamplingParams& sampling) {
  std::vector<Future<SampleResponse>> samples;
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    SamplingParams params = sampling;
    if (params.seed) params.seed = *params.seed + static_cast<std::int64_t>(i);
    samples.push_back(student.sample(ModelInput::from_tokens(prompts[i]), num_samples, params));
  }
  std::vector<std::vector<token_id>> contexts, completions;
  std::vector<double> student_lp;
  for (std::size_t i = 0; i < samples.size(); ++i)
    for (const auto& seq : samples[i].get().sequences) {
      contexts.push_back(prompts[i]);
      completions.push_back(seq.tokens);
      student_lp.insert(student_lp.end(), seq.logprobs.begin(), seq.logprobs.end());
    }
  ReverseKl out;
  std::size_t k = 0;
  for (const auto& lp : teacher_logprobs(teacher, std::span<const std::vector<token_id>>(contexts),
                                         std::span<const std::vector<token_id>>(completions)))
    for (double t : lp) {
      out.per_token += student_lp[k++] - t;
      out.teacher_logprob += t;
      ++out.tokens;
    }
  if (out.tokens) {
    out.per_token /= static_cast<double>(out.tokens);
    out.teacher_logprob /= static_cast<double>(out.tokens);
  }
  return out;
}

template <Session S, Teacher T, GroupAdvantage RewardAdvantage = GroupCentered,
          AggregationPolicy Aggregation = TokenMean>
class Distillation {
 public:
  // `tokenizer` is the student's, `teacher_tokenizer` the teacher's: refused unless they are one tokenizer
  // (tokenizer_fingerprint), with an error naming both.
  Distillation(TrainingClient<S> student, std::shared_ptr<const Tokenizer> tokenizer, T teacher,
               std::shared_ptr<const Tokenizer> teacher_tokenizer, DistillationOptions options,
               RewardAdvantage reward_advantage = {}, Aggregation aggregation = {})
      : client_(std::move(student)),
        tokenizer_(required(std::move(tokenizer), "student's")),
        teacher_(std::move(teacher)),
        options_(validated(std::move(options))),
        reward_advantage_(std::move(reward_advantage)),
        aggregation_(std::move(aggregation)),
        sampler_(client_, tokenizer_,
                 {.group_size = options_.group_size,
                  .sampling = options_.sampling,
                  .max_staleness = options_.max_staleness}) {
    const auto mine = tokenizer_fingerprint(*tokenizer_);
    const auto theirs = tokenizer_fingerprint(*required(std::move(teacher_tokenizer), "teacher's"));
    if (mine != theirs)
      throw invalid_argument("Distillation: the student's tokenizer '" + client_.get_info().tokenizer + "' (" +
                             mine.to_string() + ") is not the teacher's tokenizer '" +
                             detail::teacher_tokenizer_name(teacher_) + "' (" + theirs.to_string() +
                             "); the teacher scores the student's token ids, so both must read one tokenizer");
  }

  const DistillationOptions& options() const { return options_; }
  const DistillationState& state() const { return sampler_.state(); }
  DistillationState& state() { return sampler_.state(); }
  TrainingClient<S>& client() { return client_; }
  const T& teacher() const { return teacher_; }

  // One synchronous batch: group_size samples of every problem from the current weights, scored by the teacher,
  // then substeps optimizer steps. Equivalent to learn(submit(problems)).
  template <PromptedProblem P>
  DistillationStats step(const std::vector<P>& problems) {
    auto batch = submit(problems);
    return learn(batch);
  }
  // The same with a task reward, mixed in with reward_coef (at 0 it is only reported: reward_mean, accuracy).
  template <PromptedProblem P, Reward<P> R>
  DistillationStats step(const std::vector<P>& problems, const R& reward) {
    auto batch = submit(problems);
    return learn(batch, reward);
  }

  // Off-policy mode, as PolicyGradient::submit / learn: a batch submitted ahead is sampled from the weights before
  // the next update, and the importance ratio against the sampler's logprobs corrects for it. Sampling is the
  // policy-gradient loop's own submit() (seeds, prompts), run by a PolicyGradient that never trains.
  template <PromptedProblem P>
  PendingBatch<P> submit(const std::vector<P>& problems) {
    return sampler_.submit(problems);
  }

  template <PromptedProblem P>
  DistillationStats learn(PendingBatch<P>& batch) {
    if (options_.reward_coef > 0)
      throw invalid_argument("Distillation::learn: DistillationOptions::reward_coef > 0 needs a reward");
    return learn_with(batch, [](const std::vector<SampleResponse>&) { return std::vector<Score>{}; });
  }
  template <PromptedProblem P, Reward<P> R>
  DistillationStats learn(PendingBatch<P>& batch, const R& reward) {
    return learn_with(batch, [&](const std::vector<SampleResponse>& responses) {
      std::vector<P> contexts;
      std::vector<std::string> completions;
      for (std::size_t i = 0; i < batch.problems.size(); ++i)
        for (const auto& seq : responses[i].sequences) {
          contexts.push_back(batch.problems[i]);
          completions.push_back(tokenizer_->decode(seq.tokens, /*skip_special=*/true));
        }
      return rewards::score_batch(reward, contexts, completions);
    });
  }

 private:
  // Checked before the members that use them are built (the sampler's PolicyGradient checks them too, in its words).
  static DistillationOptions validated(DistillationOptions o) {
    o.validate();
    return o;
  }
  static std::shared_ptr<const Tokenizer> required(std::shared_ptr<const Tokenizer> t, const std::string& whose) {
    if (!t) throw invalid_argument("Distillation: the " + whose + " tokenizer is required");
    return t;
  }

  // Waits for the batch, scores it (score_all: one Score per sequence, or none without a reward), asks the teacher
  // for its logprobs of every sampled token, and trains on the rollouts.
  template <class P, class ScoreAll>
  DistillationStats learn_with(PendingBatch<P>& batch, const ScoreAll& score_all) {
    using clock = std::chrono::steady_clock;
    DistillationStats stats;
    stats.step = state().step;
    stats.staleness = state().step - batch.sampled_at_step;
    if (stats.staleness > options_.max_staleness)
      throw invalid_argument("Distillation::learn: the batch was sampled " + std::to_string(stats.staleness) +
                             " steps ago, more than max_staleness = " + std::to_string(options_.max_staleness));
    const auto t0 = clock::now();
    std::vector<SampleResponse> responses;
    for (auto& f : batch.samples) responses.push_back(f.get());
    const std::vector<Score> scores = score_all(responses);
    stats.seconds_sampling = std::chrono::duration<double>(clock::now() - t0).count();

    // Rollouts, the reward's group advantage in their advantages (0 without a reward). An empty completion has no
    // token to learn from.
    std::vector<Rollout> rollouts;
    std::vector<std::vector<token_id>> teacher_prompts;
    std::vector<double> rewards;
    for (const auto& s : scores) {
      rewards.push_back(s.value);
      stats.accuracy += s.ok() ? 1.0 : 0.0;
    }
    if (!scores.empty()) {
      stats.reward_mean = detail::mean_of(rewards);
      stats.reward_std = detail::std_of(rewards);
      stats.accuracy /= static_cast<double>(scores.size());
    }
    std::size_t k = 0;
    for (std::size_t i = 0; i < responses.size(); ++i) {
      const auto& seqs = responses[i].sequences;
      std::vector<double> adv(seqs.size(), 0.0);
      if (!scores.empty() && options_.reward_coef > 0)
        adv = reward_advantage_(std::span<const double>(rewards.data() + k, seqs.size()));
      k += seqs.size();
      const auto teacher_prompt = tokenizer_->encode(detail::teacher_prompt_of(batch.problems[i]));
      for (std::size_t j = 0; j < seqs.size(); ++j) {
        if (seqs[j].tokens.empty()) continue;
        rollouts.push_back({batch.prompts[i], seqs[j].tokens, seqs[j].logprobs,
                            std::vector<double>(seqs[j].tokens.size(), options_.reward_coef * adv[j])});
        teacher_prompts.push_back(teacher_prompt);
      }
    }

    // The reverse-KL advantage of every token, and the batch's KL.
    const auto t1 = clock::now();
    std::vector<std::vector<token_id>> completions;
    for (const auto& r : rollouts) completions.push_back(r.completion);
    const auto teacher_lp = teacher_logprobs(teacher_, std::span<const std::vector<token_id>>(teacher_prompts),
                                             std::span<const std::vector<token_id>>(completions));
    double kl_sum = 0, teacher_sum = 0;
    for (std::size_t i = 0; i < rollouts.size(); ++i)
      for (std::size_t j = 0; j < rollouts[i].completion.size(); ++j) {
        kl_sum += rollouts[i].logprobs[j] - teacher_lp[i][j];
        teacher_sum += teacher_lp[i][j];
        stats.entropy -= rollouts[i].logprobs[j];
        ++stats.sampled_tokens;
      }
    if (stats.sampled_tokens) {
      const auto n = static_cast<double>(stats.sampled_tokens);
      stats.reverse_kl = kl_sum / n;
      stats.teacher_logprob = teacher_sum / n;
      stats.entropy /= n;
    }
    const double baseline = options_.kl_baseline ? stats.reverse_kl : 0.0;
    for (std::size_t i = 0; i < rollouts.size(); ++i)
      for (std::size_t j = 0; j < rollouts[i].completion.size(); ++j)
        rollouts[i].advantages[j] += options_.kl_coef * (baseline - (rollouts[i].logprobs[j] - teacher_lp[i][j]));
    stats.seconds_teacher = std::chrono::duration<double>(clock::now() - t1).count();

    const auto t2 = clock::now();
    if (!rollouts.empty()) train(rollouts, stats);
    stats.seconds_training = std::chrono::duration<double>(clock::now() - t2).count();
    ++state().step;
    return stats;
  }

  // substeps minibatches, each a forward_backward then an optim_step, submitted back to back.
  void train(const std::vector<Rollout>& rollouts, DistillationStats& stats) {
    const std::size_t n = rollouts.size(), parts = static_cast<std::size_t>(options_.substeps);
    const std::size_t per = (n + parts - 1) / parts;
    std::vector<Future<ForwardBackwardOutput>> losses;
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
      losses.push_back(client_.forward_backward(minibatch, LossSpec::importance_sampling()));
      steps.push_back(client_.optim_step(options_.adam));
    }
    for (auto& f : losses) stats.loss += f.get().metrics.at("loss:sum");
    for (auto& s : steps) s.get();
  }

  TrainingClient<S> client_;
  std::shared_ptr<const Tokenizer> tokenizer_;
  T teacher_;
  DistillationOptions options_;
  RewardAdvantage reward_advantage_;
  Aggregation aggregation_;
  PolicyGradient<S, GroupCentered, Aggregation> sampler_;  // submit() and the run state only
};

}  // namespace rlloop::algorithms
