// train() with callbacks: JSONL logging, early stopping, on_end, on the fake session, for the policy-gradient
// family and for the algorithms whose step takes only a batch (SFT, DPO, KTO).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include <rlloop/algorithms/callbacks.hpp>
#include <rlloop/algorithms/dpo.hpp>
#include <rlloop/algorithms/kto.hpp>
#include <rlloop/algorithms/ppo.hpp>
#include <rlloop/algorithms/sft.hpp>

#include "fake_session.hpp"
#include "toy_loop.hpp"

using namespace rlloop;
using namespace rlloop::algorithms;
using namespace rlloop::testing;

namespace {
struct CountSteps {
  int* steps;
  int* ends;
  void on_step(const PolicyGradientStats&) { ++*steps; }
  void on_end(const PolicyGradientStats&) { ++*ends; }
};
struct NotACallback {};
static_assert(StepCallback<CountSteps, PolicyGradientStats>);
static_assert(!StepCallback<NotACallback, PolicyGradientStats>);
static_assert(StepStats<PolicyGradientStats> && StepStats<SftStats> && StepStats<DpoStats> && StepStats<KtoStats>);
// train() takes a reward where step() needs one, and no reward where it does not.
using Problems = std::vector<toy::LetterProblem>;
static_assert(Steppable<GRPO<FakeSession>, Problems (*)(), toy::ShareOf>);
static_assert(Steppable<PPO<FakeSession>, Problems (*)(), toy::ShareOf>);
static_assert(!Steppable<GRPO<FakeSession>, Problems (*)()>);
static_assert(Steppable<Sft<FakeSession>, std::vector<Datum> (*)()>);
static_assert(Steppable<DPO<FakeSession>, std::vector<PreferencePair> (*)()>);
static_assert(Steppable<KTO<FakeSession>, std::vector<KtoExample> (*)()>);
static_assert(!Steppable<KTO<FakeSession>, std::vector<KtoExample> (*)(), toy::ShareOf>);

// Counts the calls for any stats type.
struct Counter {
  int* steps;
  template <class Stats>
  void on_step(const Stats&) {
    ++*steps;
  }
};

GRPO<FakeSession> make_grpo(std::shared_ptr<FakeSession> session) {
  return GRPO<FakeSession>(TrainingClient<FakeSession>(std::move(session)), std::make_shared<CharTokenizer>("abcd"),
                           {.group_size = 8, .sampling = {.max_tokens = 4, .seed = 7}, .adam = {.learning_rate = 0.1}});
}
}  // namespace

TEST(Callbacks, LogEveryStepAndStopWhenTheRewardIsReached) {
  auto session = std::make_shared<FakeSession>(FakeSessionOptions{.vocab_size = 5, .seed = 1, .eos_token_id = 4});
  auto grpo = make_grpo(session);
  const std::vector<toy::LetterProblem> problems{{"b"}, {"cd"}, {"dc"}, {"bb"}};
  const auto path =
      std::filesystem::temp_directory_path() / ("rlloop-callbacks-" + std::to_string(::getpid()) + ".jsonl");
  MetricsLog log(path.string());
  int steps = 0, ends = 0;
  const auto last = train(
      grpo, 100, [&] { return problems; }, toy::ShareOf{"a"}, JsonlLogger{&log}, StopWhen{"reward_mean", 0.6},
      CountSteps{&steps, &ends});
  // Stopped early, at the first step whose reward reached 0.6, and every step was logged once.
  EXPECT_GE(last.reward_mean, 0.6);
  EXPECT_LT(steps, 100);
  EXPECT_EQ(ends, 1);
  EXPECT_EQ(session->info().step, steps);
  std::ifstream in(path);
  std::string line;
  int lines = 0;
  double last_logged = -1;
  while (std::getline(in, line)) {
    ++lines;
    last_logged = nlohmann::json::parse(line).at("reward_mean").get<double>();
  }
  EXPECT_EQ(lines, steps);
  EXPECT_EQ(last_logged, last.reward_mean);
  for (int i = 0; i + 1 < lines; ++i) EXPECT_LT(log.records()[i].at("reward_mean").get<double>(), 0.6);
  std::filesystem::remove(path);
}

TEST(Callbacks, StopWhenNamesAnUnknownField) {
  auto session = std::make_shared<FakeSession>(FakeSessionOptions{.vocab_size = 5, .seed = 1, .eos_token_id = 4});
  auto grpo = make_grpo(session);
  const std::vector<toy::LetterProblem> problems{{"b"}};
  try {
    train(
        grpo, 3, [&] { return problems; }, toy::ShareOf{"a"}, StopWhen{"rewrd", 1.0});
    FAIL();
  } catch (const invalid_argument& e) {
    EXPECT_STREQ(e.what(), "StopWhen: the stats have no field 'rewrd'");
  }
}

TEST(OffPolicy, BatchesSubmittedAheadAreOneStepStaleAndStillLearn) {
  auto session = std::make_shared<FakeSession>(FakeSessionOptions{.vocab_size = 5, .seed = 1, .eos_token_id = 4});
  auto grpo = make_grpo(session);
  const std::vector<toy::LetterProblem> problems{{"b"}, {"cd"}, {"dc"}, {"bb"}};
  auto pending = grpo.submit(problems);
  std::vector<PolicyGradientStats> stats;
  for (int s = 0; s < 30; ++s) {
    auto ahead = grpo.submit(problems);  // sampled before this step's update
    stats.push_back(grpo.learn(pending, toy::ShareOf{"a"}));
    pending = std::move(ahead);
  }
  EXPECT_EQ(stats[0].staleness, 0);
  for (int s = 1; s < 30; ++s) EXPECT_EQ(stats[s].staleness, 1) << s;
  EXPECT_LT((stats[0].reward_mean + stats[1].reward_mean) / 2, 0.4);
  EXPECT_GT((stats[28].reward_mean + stats[29].reward_mean) / 2, 0.8);
  // A batch older than max_staleness (1) is refused by name.
  auto old = grpo.submit(problems);
  grpo.learn(pending, toy::ShareOf{"a"});
  grpo.learn(old, toy::ShareOf{"a"});  // staleness 1: fine
  auto older = grpo.submit(problems);
  grpo.step(problems, toy::ShareOf{"a"});
  grpo.step(problems, toy::ShareOf{"a"});
  try {
    grpo.learn(older, toy::ShareOf{"a"});
    FAIL();
  } catch (const invalid_argument& e) {
    EXPECT_STREQ(e.what(), "PolicyGradient::learn: the batch was sampled 2 steps ago, more than max_staleness = 1");
  }
}

// Each algorithm on its own uniform fake session (vocab 5), its reference a snapshot of the start.
TEST(Callbacks, TrainDrivesSftDpoAndKto) {
  auto fresh_client = [] {
    return TrainingClient<FakeSession>(std::make_shared<FakeSession>(FakeSessionOptions{.vocab_size = 5}));
  };
  Sft<FakeSession> sft(fresh_client(), {.adam = {.learning_rate = 0.1}});
  const std::vector<Datum> sft_batch{completion_datum({1}, {2})};
  int sft_steps = 0;
  const SftStats sft_last = train(sft, 5, [&] { return sft_batch; }, Counter{&sft_steps});
  EXPECT_EQ(sft_steps, 5);
  EXPECT_EQ(sft_last.step, 4);
  EXPECT_LT(sft_last.loss_per_token, std::log(5.0));  // below the uniform start

  // DPO: both pairs are ranked right after one update (dpo_test), so the second step stops the loop.
  auto dpo_client = fresh_client();
  DPO<FakeSession> dpo(dpo_client, dpo_client.save_weights_and_get_sampling_client("reference"),
                       {.beta = 0.5, .adam = {.learning_rate = 0.05}});
  const std::vector<PreferencePair> pairs{{{1}, {0}, {2}}, {{3}, {4}, {0}}};
  const auto path = std::filesystem::temp_directory_path() / ("rlloop-train-dpo-" + std::to_string(::getpid()) + ".jsonl");
  MetricsLog log(path.string());
  const DpoStats dpo_last = train(dpo, 100, [&] { return pairs; }, JsonlLogger{&log}, StopWhen{"accuracy", 1.0});
  EXPECT_EQ(dpo_last.step, 1);
  EXPECT_EQ(dpo_last.accuracy, 1.0);
  ASSERT_EQ(log.records().size(), 2u);
  EXPECT_EQ(log.records()[0].at("accuracy").get<double>(), 0.0);
  std::filesystem::remove(path);

  auto kto_client = fresh_client();
  KTO<FakeSession> kto(kto_client, kto_client.save_weights_and_get_sampling_client("reference"),
                       {.beta = 0.5, .adam = {.learning_rate = 0.05}});
  const std::vector<KtoExample> examples{{{1}, {0}, true}, {{3}, {0}, false}};
  int kto_steps = 0;
  const KtoStats kto_last =
      train(kto, 100, [&] { return examples; }, StopWhen{"margin", 0.5}, Counter{&kto_steps});
  EXPECT_GE(kto_last.margin, 0.5);
  EXPECT_LT(kto_steps, 100);
  EXPECT_EQ(kto_last.step, kto_steps - 1);
}
