// Run state: an algorithm's state() through JSON plus the session's save_state is everything a run needs to
// continue exactly as if it had never stopped, the sampling seeds included.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <rlloop/algorithms/dpo.hpp>
#include <rlloop/algorithms/grpo.hpp>
#include <rlloop/algorithms/sft.hpp>

#include "fake_session.hpp"
#include "toy_loop.hpp"

using namespace rlloop;
using namespace rlloop::algorithms;
using namespace rlloop::testing;

namespace {
// Everything a step reports except wall-clock times.
nlohmann::json reported(const PolicyGradientStats& s) {
  auto j = to_json(s);
  j.erase("seconds_sampling");
  j.erase("seconds_training");
  return j;
}

const PolicyGradientOptions options{
    .group_size = 8, .sampling = {.max_tokens = 4, .seed = 7}, .substeps = 2, .adam = {.learning_rate = 0.1}};
const std::vector<toy::LetterProblem> problems{{"b"}, {"cd"}, {"dc"}, {"bb"}};
const toy::ShareOf reward{"a"};
}  // namespace

TEST(RunState, SaveThenRestoreContinuesIdentically) {
  auto session = std::make_shared<FakeSession>(FakeSessionOptions{.vocab_size = 5, .seed = 1, .eos_token_id = 4});
  TrainingClient<FakeSession> client(session);
  auto tokenizer = std::make_shared<CharTokenizer>("abcd");
  GRPO<FakeSession> grpo(client, tokenizer, options);
  for (int s = 0; s < 3; ++s) grpo.step(problems, reward);

  const auto checkpoint = client.save_state("mid-run").get().path;
  const std::string saved = nlohmann::json(grpo.state()).dump();
  EXPECT_EQ(saved, R"({"batches_submitted":3,"step":3})");
  std::vector<nlohmann::json> uninterrupted;
  for (int s = 0; s < 4; ++s) uninterrupted.push_back(reported(grpo.step(problems, reward)));

  // A new process: the session's weights and optimizer from its checkpoint, the algorithm's state from JSON.
  client.load_state(checkpoint, /*with_optimizer=*/true).get();
  GRPO<FakeSession> resumed(client, tokenizer, options);
  resumed.state() = nlohmann::json::parse(saved).get<PolicyGradientState>();
  for (int s = 0; s < 4; ++s) EXPECT_EQ(reported(resumed.step(problems, reward)), uninterrupted[s]) << "step " << s;
  EXPECT_EQ(resumed.state(), grpo.state());
  EXPECT_EQ(resumed.state().step, 7);

  // Without the algorithm's state the seeds start again at batch 0: the same weights, other completions.
  client.load_state(checkpoint, /*with_optimizer=*/true).get();
  GRPO<FakeSession> forgetful(client, tokenizer, options);
  const auto first = reported(forgetful.step(problems, reward));
  EXPECT_EQ(first.at("step"), 0);
  EXPECT_NE(first.at("loss"), uninterrupted[0].at("loss"));
}

// Off-policy submissions count separately from steps: the seed counter runs ahead of the step counter.
TEST(RunState, SeedsFollowSubmissionsNotSteps) {
  auto session = std::make_shared<FakeSession>(FakeSessionOptions{.vocab_size = 5, .seed = 1, .eos_token_id = 4});
  GRPO<FakeSession> grpo(TrainingClient<FakeSession>(session), std::make_shared<CharTokenizer>("abcd"), options);
  auto pending = grpo.submit(problems);
  auto ahead = grpo.submit(problems);
  grpo.learn(pending, reward);
  EXPECT_EQ(grpo.state(), (PolicyGradientState{.step = 1, .batches_submitted = 2}));
  grpo.learn(ahead, reward);
  EXPECT_EQ(grpo.state(), (PolicyGradientState{.step = 2, .batches_submitted = 2}));
}

TEST(RunState, SftAndDpoStatesRoundTripThroughJson) {
  Sft<FakeSession> sft(TrainingClient<FakeSession>(std::make_shared<FakeSession>(FakeSessionOptions{.vocab_size = 5})),
                       {.adam = {.learning_rate = 0.1}});
  sft.step({completion_datum({1}, {2})});
  EXPECT_EQ(nlohmann::json(sft.state()).dump(), R"({"step":1})");

  TrainingClient<FakeSession> dpo_client(std::make_shared<FakeSession>(FakeSessionOptions{.vocab_size = 5}));
  DPO<FakeSession> dpo(dpo_client, dpo_client.save_weights_and_get_sampling_client("reference"), {.beta = 0.5});
  const std::vector<PreferencePair> pairs{{{1}, {0}, {2}}};
  dpo.step(pairs);
  const auto restored = nlohmann::json::parse(nlohmann::json(dpo.state()).dump()).get<DpoState>();
  EXPECT_EQ(restored, dpo.state());
  ASSERT_EQ(restored.reference_logprobs.size(), 2u);
  // Uniform 5-token start: each one-token completion has reference logprob log(1/5).
  for (const auto& [key, sum] : restored.reference_logprobs) EXPECT_NEAR(sum, std::log(0.2), 1e-12);
}
