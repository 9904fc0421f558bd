// On-policy distillation's arithmetic on the fake session, where every number is known: a uniform student over 4
// tokens (student_lp = log 1/4 at every sampled token) against a teacher that gives every token logprob -0.5, so
// A_t = kl_coef * (-0.5 - log 1/4) without the baseline and, with TokenMean weights and r = 1,
// loss = -kl_coef * 0.886294; with the baseline the KL term is 0 and a task reward's group advantage is what is left.
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <rlloop/algorithms/callbacks.hpp>
#include <rlloop/algorithms/distillation.hpp>

#include "fake_session.hpp"

using namespace rlloop;
using namespace rlloop::algorithms;
using rlloop::testing::CharTokenizer;
using rlloop::testing::FakeSession;

namespace {

// Scores every token after the first at `logprob`, and keeps what it was asked.
struct FixedTeacher {
  double logprob = -0.5;
  std::shared_ptr<std::vector<std::vector<token_id>>> inputs = std::make_shared<std::vector<std::vector<token_id>>>();
  Future<std::vector<double>> compute_logprobs(const ModelInput& input) const {
    inputs->push_back(input.tokens());
    std::vector<double> lp(input.tokens().size(), logprob);
    lp[0] = 0.0;
    return Future<std::vector<double>>::ready(std::move(lp));
  }
  std::string tokenizer_name() const { return "chars"; }
};

// The student's prompt, and the same question in the teacher's chat format.
struct ChatProblem {
  std::string prompt;
  std::string teacher_prompt;
};

// 1 for a completion that starts with 'a', else 0.
struct StartsWithA {
  double operator()(const ChatProblem&, std::string_view completion) const {
    return !completion.empty() && completion[0] == 'a' ? 1.0 : 0.0;
  }
};

const double log_quarter = std::log(0.25);

TrainingClient<FakeSession> uniform_student() {
  return TrainingClient<FakeSession>(std::make_shared<FakeSession>(
      rlloop::testing::FakeSessionOptions{.vocab_size = 4, .eos_token_id = 3, .tokenizer = "chars"}));
}

}  // namespace

TEST(Distillation, ReverseKlAdvantagesAndLossOnAUniformStudent) {
  const auto tokenizer = std::make_shared<CharTokenizer>("abc");
  const FixedTeacher teacher;
  auto student = uniform_student();
  Distillation<FakeSession, FixedTeacher> distill(
      student, tokenizer, teacher, tokenizer,
      {.group_size = 2,
       .sampling = {.max_tokens = 3, .seed = 7},
       .kl_coef = 2.0,
       .kl_baseline = false,
       .adam = {.learning_rate = 0.1}});
  const std::vector<ChatProblem> problems{{"a", "cc"}, {"b", "cc"}};
  const auto stats = distill.step(problems);

  // The teacher saw its own prompt in front of each of the 4 completions.
  ASSERT_EQ(teacher.inputs->size(), 4u);
  std::int64_t completion_tokens = 0;
  for (const auto& in : *teacher.inputs) {
    ASSERT_GT(in.size(), 2u);
    EXPECT_EQ(in[0], 2);
    EXPECT_EQ(in[1], 2);
    completion_tokens += static_cast<std::int64_t>(in.size()) - 2;
  }
  EXPECT_EQ(stats.sampled_tokens, completion_tokens);
  EXPECT_EQ(stats.trained_tokens, completion_tokens);  // a 1-token prompt + completion, minus the last: the completion
  EXPECT_NEAR(stats.reverse_kl, log_quarter + 0.5, 1e-12);  // -0.886294: the teacher is surer than the student
  EXPECT_NEAR(stats.teacher_logprob, -0.5, 1e-12);
  EXPECT_NEAR(stats.entropy, -log_quarter, 1e-12);
  // Every token's A = 2 * (-0.5 - log 1/4) = 1.772589, weighted 1 / tokens: loss = -A.
  EXPECT_NEAR(stats.loss, -2.0 * (-0.5 - log_quarter), 1e-6);
  EXPECT_EQ(stats.reward_mean, 0.0);
  EXPECT_EQ(student.get_info().step, 1);
  EXPECT_EQ(distill.state(), (DistillationState{.step = 1, .batches_submitted = 1}));
}

TEST(Distillation, TaskRewardAddsItsGroupAdvantage) {
  const auto tokenizer = std::make_shared<CharTokenizer>("abc");
  auto student = uniform_student();
  const SamplingParams sampling{.max_tokens = 3, .seed = 11};
  // The samples the step will draw: the same seeds (seed + i for batch 0) from the same weights.
  const std::vector<ChatProblem> problems{{"a", "a"}, {"b", "b"}, {"c", "c"}};
  std::vector<SampleResponse> drawn;
  for (std::size_t i = 0; i < problems.size(); ++i) {
    SamplingParams p = sampling;
    p.seed = *sampling.seed + static_cast<std::int64_t>(i);
    drawn.push_back(student.live_sampling_client()
                        .sample(ModelInput::from_tokens(tokenizer->encode(problems[i].prompt)), 4, p)
                        .get());
  }
  // Expected: A = 0.5 * (r - group mean) + 0.25 * (KL mean - KL) per token, the second term 0 here (every token's
  // KL is the mean); loss = -sum(A) / tokens.
  double a_sum = 0, reward_sum = 0;
  std::int64_t tokens = 0;
  for (const auto& resp : drawn) {
    std::vector<double> r;
    for (const auto& seq : resp.sequences) r.push_back(StartsWithA{}({}, tokenizer->decode(seq.tokens, true)));
    const double mean = (r[0] + r[1] + r[2] + r[3]) / 4;
    for (std::size_t j = 0; j < 4; ++j) {
      const auto len = static_cast<double>(resp.sequences[j].tokens.size());
      a_sum += len * 0.5 * (r[j] - mean);
      tokens += static_cast<std::int64_t>(len);
      reward_sum += r[j];
    }
  }
  Distillation<FakeSession, FixedTeacher> distill(
      student, tokenizer, FixedTeacher{}, tokenizer,
      {.group_size = 4, .sampling = sampling, .kl_coef = 0.25, .reward_coef = 0.5, .adam = {.learning_rate = 0.1}});
  const auto stats = distill.step(problems, StartsWithA{});
  EXPECT_EQ(stats.sampled_tokens, tokens);
  EXPECT_NEAR(stats.reward_mean, reward_sum / 12, 1e-12);
  EXPECT_NE(a_sum, 0.0);  // the draws differ in reward within a group, so the reward term is there to see
  EXPECT_NEAR(stats.loss, -a_sum / static_cast<double>(tokens), 1e-6);
  EXPECT_NEAR(stats.reverse_kl, log_quarter + 0.5, 1e-12);

  // reward_coef > 0 without a reward, and a batch too stale, are refused by name.
  auto batch = distill.submit(problems);
  try {
    distill.learn(batch);
    FAIL() << "learn without a reward";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("reward_coef"), std::string::npos) << e.what();
  }
  distill.step(problems, StartsWithA{});
  distill.step(problems, StartsWithA{});
  try {
    distill.learn(batch, StartsWithA{});
    FAIL() << "a batch 2 steps old";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("max_staleness = 1"), std::string::npos) << e.what();
  }
}

TEST(Distillation, OptionsAreValidatedByNameAndTrainDrivesIt) {
  const auto tokenizer = std::make_shared<CharTokenizer>("abc");
  auto student = uniform_student();
  auto refused = [&](DistillationOptions o) {
    try {
      Distillation<FakeSession, FixedTeacher>(student, tokenizer, FixedTeacher{}, tokenizer, o);
    } catch (const invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  EXPECT_NE(refused({.group_size = 0}).find("DistillationOptions::group_size"), std::string::npos);
  EXPECT_NE(refused({.kl_coef = -1}).find("DistillationOptions::kl_coef"), std::string::npos);
  EXPECT_NE(refused({.kl_coef = NAN}).find("DistillationOptions::kl_coef"), std::string::npos);
  EXPECT_NE(refused({.kl_coef = 0}).find("kl_coef and reward_coef are both 0"), std::string::npos);
  EXPECT_NE(refused({.substeps = 0}).find("DistillationOptions::substeps"), std::string::npos);
  EXPECT_NE(refused({.adam = {.learning_rate = 0}}).find("DistillationOptions::adam.learning_rate"),
            std::string::npos);
  // The student reads 4 ids, a teacher reading 5 is another tokenizer, named as it names itself.
  const auto wider = std::make_shared<CharTokenizer>("abcd");
  try {
    Distillation<FakeSession, FixedTeacher>(student, tokenizer, FixedTeacher{}, wider, {});
    FAIL() << "another tokenizer";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("'chars' (4 ids, fingerprint"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("'chars' (5 ids, fingerprint"), std::string::npos) << e.what();
  }

  // train() drives it like the other algorithms; substeps split the batch into optimizer steps.
  Distillation<FakeSession, FixedTeacher> distill(student, tokenizer, FixedTeacher{}, tokenizer,
                                                  {.group_size = 2, .sampling = {.max_tokens = 2}, .substeps = 2});
  const std::vector<ChatProblem> problems{{"a", "a"}, {"b", "b"}};
  const auto last = train(distill, 3, [&] { return problems; });
  EXPECT_EQ(last.step, 2);
  EXPECT_EQ(student.get_info().step, 3 * 2);
  EXPECT_EQ(to_json(last).at("reverse_kl").get<double>(), last.reverse_kl);
}
