// DPO end to end on the fake session: the algorithm's state, caching and learning, without LibTorch.
#include <cmath>

#include <gtest/gtest.h>

#include <rlloop/algorithms/dpo.hpp>

#include "fake_session.hpp"

using namespace rlloop;
using namespace rlloop::algorithms;
using rlloop::testing::FakeSession;

TEST(DpoOnFakeSession, LearnsThePreferenceAndCachesTheReference) {
  // Vocab 5, uniform start. Prompt (1) -> prefer token 0, reject token 2; prompt (3) -> prefer 4 over 0.
  auto session = std::make_shared<FakeSession>(rlloop::testing::FakeSessionOptions{.vocab_size = 5});
  TrainingClient<FakeSession> client(session);
  auto reference = client.save_weights_and_get_sampling_client("reference");
  DPO<FakeSession> dpo(client, reference, {.beta = 0.5, .adam = {.learning_rate = 0.05}});
  const std::vector<PreferencePair> pairs{{{1}, {0}, {2}}, {{3}, {4}, {0}}};

  const auto first = dpo.step(pairs);
  // Uniform policy == reference: z = 0, loss = log 2 exactly, no pair is "right" yet (0 > 0 is false).
  EXPECT_NEAR(first.loss, std::log(2.0), 1e-12);
  EXPECT_EQ(first.accuracy, 0.0);
  EXPECT_EQ(first.reference_calls, 4);
  EXPECT_EQ(dpo.state().reference_logprobs.size(), 4u);
  // One Adam step raises every chosen token's logit and lowers every rejected one: both pairs are now right.
  const auto second = dpo.step(pairs);
  EXPECT_EQ(second.reference_calls, 0);
  EXPECT_EQ(second.accuracy, 1.0);
  EXPECT_GT(second.margin, 0.0);
  for (int i = 0; i < 20; ++i) dpo.step(pairs);
  const auto later = dpo.evaluate(pairs);
  EXPECT_LT(later.loss, 0.5 * std::log(2.0));
  EXPECT_GT(later.margin, second.margin);
  // The reference did not move: it is a sampler snapshot.
  EXPECT_NEAR(reference.compute_logprobs(ModelInput::from_tokens({1, 0})).get()[1], std::log(0.2), 1e-12);
  EXPECT_EQ(session->info().step, 22);
}

TEST(DpoOnFakeSession, IpoConvergesToItsTargetMargin) {
  // IPO's loss (z - 1/(2 beta))^2 is minimised at z = 1 / (2 beta) = 1 for beta 0.5, not at infinity.
  auto session = std::make_shared<FakeSession>(rlloop::testing::FakeSessionOptions{.vocab_size = 5});
  TrainingClient<FakeSession> client(session);
  IPO<FakeSession> ipo(client, client.save_weights_and_get_sampling_client("reference"),
                       {.beta = 0.5, .adam = {.learning_rate = 0.02}});
  const std::vector<PreferencePair> pairs{{{1}, {0}, {2}}};
  for (int i = 0; i < 300; ++i) ipo.step(pairs);
  const auto s = ipo.evaluate(pairs);
  EXPECT_NEAR(s.margin, 0.5 * 1.0, 0.05);  // margin = beta * z = 0.5
  EXPECT_LT(s.loss, 0.01);
}

TEST(DpoOnFakeSession, RejectsEmptyInput) {
  auto session = std::make_shared<FakeSession>();
  TrainingClient<FakeSession> client(session);
  DPO<FakeSession> dpo(client, client.live_sampling_client(), {});
  EXPECT_THROW(dpo.step({}), rlloop::invalid_argument);
  EXPECT_THROW(dpo.step({{{1}, {}, {2}}}), rlloop::invalid_argument);
}
