// KTO: the loss and its gradient against hand-worked values and finite differences, then the algorithm end to
// end on the fake session (learning, the reference cache, its state through JSON).
#include <cmath>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <rlloop/algorithms/kto.hpp>

#include "fake_session.hpp"

using namespace rlloop;
using namespace rlloop::algorithms;
using rlloop::testing::FakeSession;

namespace {
Datum weighted(std::vector<float> w) {
  Datum d;
  d.model_input = ModelInput::from_tokens(std::vector<token_id>(w.size(), 1));
  d.loss_fn_inputs["weights"] = TensorData::from_floats(std::move(w));
  return d;
}

// Four examples, beta 0.5, lambda_D 1, lambda_U 2. Position 0 is prompt (weight 0):
//   e0 desirable    lp (-9, -1, -2) w (0, 1, 1) -> -3, ref -4.5 -> r =  1.5
//   e1 undesirable  lp (-9, -3)     w (0, 1)    -> -3, ref -2   -> r = -1
//   e2 desirable    lp (-5, -2)     w (0, 1)    -> -2, ref -2.5 -> r =  0.5
//   e3 undesirable  lp (-7, -1, -1) w (0, 1, 1) -> -2, ref -2   -> r =  0
// z_ref = max(0, (1.5 - 1 + 0.5 + 0) / 4) = 0.25.
struct Batch {
  std::vector<Datum> data{weighted({0, 1, 1}), weighted({0, 1}), weighted({0, 1}), weighted({0, 1, 1})};
  std::vector<std::vector<double>> logprobs{{-9, -1, -2}, {-9, -3}, {-5, -2}, {-7, -1, -1}};
  std::vector<double> reference{-4.5, -2, -2.5, -2};
  std::vector<bool> desirable{true, false, true, false};
  KtoOptions options{.beta = 0.5, .desirable_weight = 1, .undesirable_weight = 2};
};

void expect_all_near(const std::vector<double>& got, const std::vector<double>& want, double tol) {
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], tol) << "at index " << i;
}
}  // namespace

TEST(KtoMath, ReferencePointIsTheClampedMeanLogRatio) {
  const Batch b;
  const auto r = kto_log_ratios(b.data, b.logprobs, b.reference);
  expect_all_near(r, {1.5, -1, 0.5, 0}, 1e-12);
  EXPECT_DOUBLE_EQ(kto_reference_point(r), 0.25);
  // A batch whose policy fell below the reference on average: a KL is never negative, so 0.
  EXPECT_EQ(kto_reference_point(std::vector<double>{-1, -0.5}), 0.0);
  EXPECT_EQ(kto_reference_point(std::vector<double>{}), 0.0);
}

// x = beta (r - z) for desirable, beta (z - r) for undesirable:
//   e0 0.5 * 1.25 = 0.625, e1 0.5 * 1.25 = 0.625, e2 0.5 * 0.25 = 0.125, e3 0.5 * 0.25 = 0.125
//   sigmoid(0.625) = 0.65135486, sigmoid(0.125) = 0.53120937
//   l = 1 * 0.34864514, 2 * 0.34864514 = 0.69729027, 1 * 0.46879063, 2 * 0.46879063 = 0.93758125
//   loss = 2.45230729 / 4 = 0.61307682
// d l / d r = -+lambda beta s (1 - s): s (1 - s) = 0.22709170 (x 0.625), 0.24902598 (x 0.125)
//   e0 -0.11354585, e1 +0.22709170, e2 -0.12451299, e3 +0.24902598; / N = 4 per completion token:
//   e0 -0.02838646, e1 +0.05677293, e2 -0.03112825, e3 +0.06225649
// rewards beta r: desirable (0.75 + 0.25) / 2 = 0.5, undesirable (-0.5 + 0) / 2 = -0.25, margin 0.75
TEST(KtoMath, LossAndGradientOnABatch) {
  const Batch b;
  const auto out = kto_objective(b.data, b.logprobs, b.reference, b.desirable, b.options);
  EXPECT_NEAR(out.loss, 0.61307682, 1e-8);
  ASSERT_EQ(out.grad_logprobs.size(), 4u);
  expect_all_near(out.grad_logprobs[0], {0, -0.02838646, -0.02838646}, 1e-8);
  expect_all_near(out.grad_logprobs[1], {0, 0.05677293}, 1e-8);
  expect_all_near(out.grad_logprobs[2], {0, -0.03112825}, 1e-8);
  expect_all_near(out.grad_logprobs[3], {0, 0.06225649, 0.06225649}, 1e-8);
  EXPECT_DOUBLE_EQ(out.metrics.at("kto:kl"), 0.25);
  EXPECT_NEAR(out.metrics.at("kto:reward_desirable"), 0.5, 1e-12);
  EXPECT_NEAR(out.metrics.at("kto:reward_undesirable"), -0.25, 1e-12);
  EXPECT_NEAR(out.metrics.at("kto:margin"), 0.75, 1e-12);
}

// Policy = reference: r = 0 and z = 0 everywhere, each term is lambda * (1 - sigmoid(0)) = lambda / 2.
TEST(KtoMath, StartsAtHalfTheWeights) {
  Batch b;
  b.reference = {-3, -3, -2, -2};
  const auto out = kto_objective(b.data, b.logprobs, b.reference, b.desirable, b.options);
  EXPECT_NEAR(out.loss, (0.5 + 1 + 0.5 + 1) / 4, 1e-15);
  // d l / d r = -+lambda * beta / 4 -> / N: -1 * 0.5 / 4 / 4 = -0.03125 (desirable), +0.0625 (undesirable).
  expect_all_near(out.grad_logprobs[0], {0, -0.03125, -0.03125}, 1e-15);
  expect_all_near(out.grad_logprobs[1], {0, 0.0625}, 1e-15);
}

// Central differences of the loss at a fixed reference point equal the gradient handed to the engine.
TEST(KtoMath, GradientMatchesFiniteDifferencesWithTheReferencePointHeld) {
  const Batch b;
  const double z = 0.25, h = 1e-6;
  const auto analytic = kto_objective_at(b.data, b.logprobs, b.reference, b.desirable, z, b.options);
  for (std::size_t i = 0; i < b.logprobs.size(); ++i)
    for (std::size_t t = 0; t < b.logprobs[i].size(); ++t) {
      auto up = b.logprobs, down = b.logprobs;
      up[i][t] += h;
      down[i][t] -= h;
      const double fd = (kto_objective_at(b.data, up, b.reference, b.desirable, z, b.options).loss -
                         kto_objective_at(b.data, down, b.reference, b.desirable, z, b.options).loss) /
                        (2 * h);
      EXPECT_NEAR(analytic.grad_logprobs[i][t], fd, 1e-9) << "example " << i << " token " << t;
    }
}

// z_ref is detached: the gradient ignores how z moves with the logprobs. Where z > 0 the full function's
// finite difference therefore differs from it by (d loss / d z) (d z / d lp) = (d loss / d z) / N per completion
// token; where the clamp holds z at 0 the two agree.
TEST(KtoMath, ReferencePointIsDetached) {
  Batch b;
  const double h = 1e-6;
  auto full_fd = [&](const Batch& batch, std::size_t i, std::size_t t) {
    auto up = batch.logprobs, down = batch.logprobs;
    up[i][t] += h;
    down[i][t] -= h;
    return (kto_objective(batch.data, up, batch.reference, batch.desirable, batch.options).loss -
            kto_objective(batch.data, down, batch.reference, batch.desirable, batch.options).loss) /
           (2 * h);
  };
  const auto out = kto_objective(b.data, b.logprobs, b.reference, b.desirable, b.options);
  // d loss / d z = -(sum of the per-example d l / d r) / N = -(-0.11354585 + 0.22709170 - 0.12451299 +
  // 0.24902598) / 4 = -0.05951471; d z / d lp_t = 1 / 4 on a completion token.
  EXPECT_NEAR(full_fd(b, 0, 1) - out.grad_logprobs[0][1], -0.05951471 / 4, 1e-8);
  EXPECT_NEAR(full_fd(b, 1, 1) - out.grad_logprobs[1][1], -0.05951471 / 4, 1e-8);

  b.reference = {0, 0, 0, 0};  // every r < 0: mean -2.5, z clamped at 0
  const auto clamped = kto_objective(b.data, b.logprobs, b.reference, b.desirable, b.options);
  EXPECT_EQ(clamped.metrics.at("kto:kl"), 0.0);
  for (std::size_t i = 0; i < b.logprobs.size(); ++i)
    for (std::size_t t = 0; t < b.logprobs[i].size(); ++t)
      EXPECT_NEAR(clamped.grad_logprobs[i][t], full_fd(b, i, t), 1e-9) << "example " << i << " token " << t;
}

TEST(KtoMath, BadInputNamesTheProblem) {
  const Batch b;
  EXPECT_THROW(kto_objective(b.data, b.logprobs, b.reference, {true, false}, b.options), invalid_argument);
  EXPECT_THROW(kto_objective(b.data, b.logprobs, std::vector<double>{-1}, b.desirable, b.options), invalid_argument);
  try {
    KtoOptions{.beta = -1}.validate();
    FAIL() << "beta = -1 accepted";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("KtoOptions::beta"), std::string::npos);
  }
  EXPECT_THROW((KtoOptions{.desirable_weight = 0, .undesirable_weight = 0}.validate()), invalid_argument);
}

TEST(KtoOnFakeSession, RaisesTheMarginAndCachesTheReference) {
  // Vocab 5, uniform start. Unpaired: after prompt 1 token 0 is desirable, after prompt 3 token 0 is not;
  // token 4 after prompt 2 is desirable and token 2 after prompt 4 is not.
  auto session = std::make_shared<FakeSession>(rlloop::testing::FakeSessionOptions{.vocab_size = 5});
  TrainingClient<FakeSession> client(session);
  auto reference = client.save_weights_and_get_sampling_client("reference");
  KTO<FakeSession> kto(client, reference, {.beta = 0.5, .adam = {.learning_rate = 0.05}});
  const std::vector<KtoExample> batch{{{1}, {0}, true}, {{3}, {0}, false}, {{2}, {4}, true}, {{4}, {2}, false}};

  const auto first = kto.step(batch);
  // Policy == reference: r = z = 0, loss = 1 - sigmoid(0) = 0.5 exactly, no margin yet.
  EXPECT_NEAR(first.loss, 0.5, 1e-12);
  EXPECT_NEAR(first.margin, 0.0, 1e-12);
  EXPECT_EQ(first.reference_calls, 4);
  EXPECT_EQ(first.desirable, 2);
  EXPECT_EQ(first.undesirable, 2);
  const auto second = kto.step(batch);
  EXPECT_EQ(second.reference_calls, 0);
  EXPECT_GT(second.reward_desirable, 0.0);
  EXPECT_LT(second.reward_undesirable, 0.0);
  for (int i = 0; i < 30; ++i) kto.step(batch);
  const auto later = kto.evaluate(batch);
  EXPECT_GT(later.margin, 2 * second.margin);
  EXPECT_LT(later.loss, 0.4);
  EXPECT_EQ(session->info().step, 32);

  // The state survives JSON: a restored KTO needs no reference call for the cached completions.
  KTO<FakeSession> restored(client, reference, kto.options());
  restored.state() = nlohmann::json(kto.state()).get<KtoState>();
  EXPECT_EQ(restored.state(), kto.state());
  EXPECT_EQ(restored.evaluate(batch).reference_calls, 0);
  EXPECT_THROW(kto.step({}), invalid_argument);
  EXPECT_THROW(kto.step({{{1}, {}, true}}), invalid_argument);
}
