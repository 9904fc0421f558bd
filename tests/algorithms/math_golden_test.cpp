// Golden values for the algorithm math, each worked out by hand in the comment beside it (and re-checked with
// a few lines of Python's math module).
#include <cmath>
#include <vector>

#include <gtest/gtest.h>

#include <rlloop/algorithms/advantages.hpp>
#include <rlloop/algorithms/aggregation.hpp>
#include <rlloop/algorithms/dpo.hpp>
#include <rlloop/algorithms/gae.hpp>
#include <rlloop/algorithms/kl.hpp>
#include <rlloop/algorithms/policy_gradient.hpp>
#include <rlloop/algorithms/sft.hpp>

using namespace rlloop;
using namespace rlloop::algorithms;

namespace {
void expect_all_near(const std::vector<double>& got, const std::vector<double>& want, double tol = 1e-6) {
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], tol) << "at index " << i;
}
std::vector<double> floats(const Datum& d, const char* key) { return d.loss_fn_inputs.at(key).as_doubles(); }
}  // namespace

// Rewards {1, 2, 3, 6}: mean 3, deviations (-2, -1, 0, 3), population variance 14 / 4 = 3.5, std 1.8708287.
TEST(Advantages, GroupNormalizedDividesByPopulationStd) {
  const std::vector<double> r{1, 2, 3, 6};
  expect_all_near(GroupNormalized{}(r), {-2 / 1.8708297, -1 / 1.8708297, 0.0, 3 / 1.8708297});  // std + 1e-6
  // -1.0690444, -0.5345222, 0, 1.6035666
  expect_all_near(GroupNormalized{}(r), {-1.0690444, -0.5345222, 0.0, 1.6035666});
  // A uniform group has no signal: 0 / (0 + eps) = 0, not NaN.
  expect_all_near(GroupNormalized{}(std::vector<double>{0.5, 0.5, 0.5}), {0, 0, 0}, 0.0);
}

TEST(Advantages, GroupCenteredSubtractsTheMeanOnly) {
  expect_all_near(GroupCentered{}(std::vector<double>{1, 2, 3, 6}), {-2, -1, 0, 3}, 0.0);
}

// r_i - (12 - r_i) / 3: 1 - 11/3, 2 - 10/3, 3 - 9/3, 6 - 6/3; equal to N/(N-1) * (r - mean) = 4/3 * (-2, -1, 0, 3).
TEST(Advantages, LeaveOneOutUsesTheOtherSamplesMean) {
  expect_all_near(LeaveOneOut{}(std::vector<double>{1, 2, 3, 6}), {-2.6666667, -1.3333333, 0.0, 4.0});
  EXPECT_THROW(LeaveOneOut{}(std::vector<double>{1.0}), rlloop::invalid_argument);
}

// Completion lengths {2, 4}, max_tokens 8.
TEST(Aggregation, PerTokenWeights) {
  const std::vector<std::size_t> len{2, 4};
  // GRPO: 1 / (len_i * N) = 1/4, 1/8 -> each sequence's weights sum to 1/N.
  expect_all_near(SequenceMean{}(len, 8), {0.25, 0.125}, 1e-15);
  // Dr. GRPO: 1 / (N * max_tokens) = 1/16 for every token, whatever the length.
  expect_all_near(ConstantNormalizer{}(len, 8), {0.0625, 0.0625}, 1e-15);
  // DAPO: 1 / total tokens = 1/6.
  expect_all_near(TokenMean{}(len, 8), {1.0 / 6, 1.0 / 6}, 1e-15);
}

// log_ratio = log pi - log ref.
TEST(Kl, SchulmanEstimators) {
  EXPECT_DOUBLE_EQ(kl_k1(0.5), 0.5);
  EXPECT_NEAR(kl_k3(0.5), 0.10653066, 1e-8);   // e^-0.5 - 1 + 0.5 = 0.60653066 - 0.5
  EXPECT_NEAR(kl_k3(-0.5), 0.14872127, 1e-8);  // e^0.5 - 1 - 0.5 = 1.64872127 - 1.5
  EXPECT_EQ(kl_k3(0.0), 0.0);
  EXPECT_NEAR(kl_k1(-0.5), -0.5, 0);  // k1 can be negative; k3 cannot
}

// rewards (0, 0, 1), values (0.5, 0.6, 0.7), episode ends after t = 2, gamma 0.9, lambda 0.8 (gamma*lambda 0.72):
//   t=2: delta = 1 - 0.7 = 0.3;                 A = 0.3;                       R = 1.0
//   t=1: delta = 0.9 * 0.7 - 0.6 = 0.03;        A = 0.03 + 0.72 * 0.3 = 0.246;  R = 0.846
//   t=0: delta = 0.9 * 0.6 - 0.5 = 0.04;        A = 0.04 + 0.72 * 0.246 = 0.21712; R = 0.71712
TEST(Gae, HandWorkedTrajectory) {
  const auto g = gae(std::vector<double>{0, 0, 1}, std::vector<double>{0.5, 0.6, 0.7}, std::vector<double>{0, 0, 1},
                     {.gamma = 0.9, .lambda = 0.8});
  expect_all_near(g.advantages, {0.21712, 0.246, 0.3}, 1e-12);
  expect_all_near(g.returns, {0.71712, 0.846, 1.0}, 1e-12);
}

TEST(Gae, LambdaOneIsReturnMinusValueAndLambdaZeroIsTdError) {
  const std::vector<double> r{0, 0, 1}, v{0.5, 0.6, 0.7}, done{0, 0, 1};
  expect_all_near(gae(r, v, done, {.gamma = 1, .lambda = 1}).advantages, {0.5, 0.4, 0.3}, 1e-12);  // 1 - V_t
  expect_all_near(gae(r, v, done, {.gamma = 1, .lambda = 0}).advantages, {0.1, 0.1, 0.3}, 1e-12);  // V_{t+1} - V_t
}

// Two episodes back to back: step 0 ends the first (nothing flows back across it); step 1 is truncated and
// bootstraps from V = 2. gamma = lambda = 1, rewards (1, 1), values (0.5, 0.5):
//   t=1: delta = 1 + 2 - 0.5 = 2.5, A = 2.5, R = 3;   t=0: delta = 1 - 0.5 = 0.5, A = 0.5, R = 1
TEST(Gae, DoneStopsBootstrappingAndCredit) {
  const auto g = gae(std::vector<double>{1, 1}, std::vector<double>{0.5, 0.5}, std::vector<double>{1, 0},
                     {.gamma = 1, .lambda = 1}, /*bootstrap_value=*/2.0);
  expect_all_near(g.advantages, {0.5, 2.5}, 1e-12);
  expect_all_near(g.returns, {1.0, 3.0}, 1e-12);
}

TEST(Gae, BadInputNamesTheProblem) {
  const std::vector<double> two{0, 0}, three{0, 0, 0};
  EXPECT_THROW(gae(two, three, two, {}), rlloop::invalid_argument);
  EXPECT_THROW(gae(two, two, std::vector<double>{0, 0.5}, {}), rlloop::invalid_argument);
  EXPECT_THROW(gae(two, two, two, {.lambda = 1.5}), rlloop::invalid_argument);
  expect_all_near(terminal_rewards(3, 0.7), {0, 0, 0.7}, 0);
  expect_all_near(whiten(std::vector<double>{1, 3}), {-1, 1}, 1e-7);  // mean 2, std 1
}

// beta 0.1, z = 2: -log sigmoid(0.2) = log(1 + e^-0.2) = 0.59813887; dL/dz = -0.1 * sigmoid(-0.2) = -0.04501660.
TEST(Dpo, SigmoidLossAndGradient) {
  auto t = SigmoidPreference{}(2.0, 0.1);
  EXPECT_NEAR(t.loss, 0.59813887, 1e-8);
  EXPECT_NEAR(t.dloss_dz, -0.04501660, 1e-8);
  auto zero = SigmoidPreference{}(0.0, 0.1);
  EXPECT_NEAR(zero.loss, std::log(2.0), 1e-12);
  EXPECT_NEAR(zero.dloss_dz, -0.05, 1e-12);
  // Label smoothing 0.1: 0.9 * 0.59813887 + 0.1 * 0.79813887 = 0.61813887;
  // dL/dz = -0.1 * 0.9 * sigmoid(-0.2) + 0.1 * 0.1 * sigmoid(0.2) = -0.03501660.
  auto ls = SigmoidPreference{.label_smoothing = 0.1}(2.0, 0.1);
  EXPECT_NEAR(ls.loss, 0.61813887, 1e-8);
  EXPECT_NEAR(ls.dloss_dz, -0.03501660, 1e-8);
  // Far in the tails the loss stays finite: -log sigmoid(-100) ~= 100.
  EXPECT_NEAR(SigmoidPreference{}(-1000.0, 0.1).loss, 100.0, 1e-9);
}

// beta 0.5: target margin 1 / (2 * 0.5) = 1. z = 2: (2 - 1)^2 = 1, grad 2; z = 0.5: 0.25, grad -1.
TEST(Dpo, IpoLossAndGradient) {
  auto a = IpoPreference{}(2.0, 0.5);
  EXPECT_DOUBLE_EQ(a.loss, 1.0);
  EXPECT_DOUBLE_EQ(a.dloss_dz, 2.0);
  auto b = IpoPreference{}(0.5, 0.5);
  EXPECT_DOUBLE_EQ(b.loss, 0.25);
  EXPECT_DOUBLE_EQ(b.dloss_dz, -1.0);
}

// Two pairs, beta 0.1. Weights mark completion tokens (position 0 is prompt, weight 0):
//   pair 0: chosen lp (-9, -1, -2) w (0,1,1) -> -3, ref -4 -> +1;  rejected lp (-9, -3) w (0,1) -> -3, ref -2 -> -1;  z
//   = 2 pair 1: chosen lp (-5, -2)  w (0,1)   -> -2, ref -2 ->  0;  rejected lp (-5, -1) w (0,1) -> -1, ref -1.5 ->
//   0.5; z = -0.5
// loss = (0.59813887 + log(1 + e^0.05) = 0.71845965) / 2 = 0.65829926
// dL/dz / N: pair 0 -0.1 * sigmoid(-0.2) / 2 = -0.02250830; pair 1 -0.1 * sigmoid(0.05) / 2 = -0.02562487
// accuracy 1/2; rewards chosen 0.1 * (1 + 0) / 2 = 0.05, rejected 0.1 * (-1 + 0.5) / 2 = -0.025, margin 0.075
TEST(Dpo, PreferenceObjectiveOnABatch) {
  auto datum = [](std::vector<float> w) {
    Datum d;
    d.model_input = ModelInput::from_tokens(std::vector<token_id>(w.size(), 1));
    d.loss_fn_inputs["weights"] = TensorData::from_floats(std::move(w));
    return d;
  };
  const std::vector<Datum> data{datum({0, 1, 1}), datum({0, 1}), datum({0, 1}), datum({0, 1})};
  const std::vector<std::vector<double>> lp{{-9, -1, -2}, {-9, -3}, {-5, -2}, {-5, -1}};
  const std::vector<double> ref_c{-4, -2}, ref_r{-2, -1.5};
  const auto r = preference_objective(data, lp, ref_c, ref_r, 0.1, SigmoidPreference{});
  EXPECT_NEAR(r.loss, 0.65829926, 1e-8);
  ASSERT_EQ(r.grad_logprobs.size(), 4u);
  expect_all_near(r.grad_logprobs[0], {0, -0.02250830, -0.02250830}, 1e-8);
  expect_all_near(r.grad_logprobs[1], {0, 0.02250830}, 1e-8);
  expect_all_near(r.grad_logprobs[2], {0, -0.02562487}, 1e-8);
  expect_all_near(r.grad_logprobs[3], {0, 0.02562487}, 1e-8);
  EXPECT_DOUBLE_EQ(r.metrics.at("dpo:accuracy"), 0.5);
  EXPECT_NEAR(r.metrics.at("dpo:reward_chosen"), 0.05, 1e-12);
  EXPECT_NEAR(r.metrics.at("dpo:reward_rejected"), -0.025, 1e-12);
  EXPECT_NEAR(r.metrics.at("dpo:margin"), 0.075, 1e-12);
  EXPECT_THROW(
      preference_objective(data, lp, std::vector<double>{-4}, std::vector<double>{-2}, 0.1, SigmoidPreference{}),
      rlloop::invalid_argument);
}

TEST(Dpo, OptionsAreValidatedWithTheFieldName) {
  try {
    DpoOptions{.beta = 0}.validate();
    FAIL() << "beta = 0 accepted";
  } catch (const rlloop::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("DpoOptions::beta"), std::string::npos);
  }
}

// prompt (10, 11, 12) + completion (20, 21): input (10, 11, 12, 20), targets (11, 12, 20, 21); positions 2 and 3
// predict the completion tokens and are the only ones with weight, advantage and sampler logprob.
TEST(Layout, RolloutDatum) {
  const Rollout r{{10, 11, 12}, {20, 21}, {-0.5, -0.25}, {2.0, 3.0}};
  const Datum d = rollout_datum(r, 0.5);
  EXPECT_EQ(d.model_input.tokens(), (std::vector<token_id>{10, 11, 12, 20}));
  expect_all_near(floats(d, "target_tokens"), {11, 12, 20, 21}, 0);
  expect_all_near(floats(d, "weights"), {0, 0, 0.5, 0.5}, 0);
  expect_all_near(floats(d, "advantages"), {0, 0, 2, 3}, 0);
  expect_all_near(floats(d, "logprobs"), {0, 0, -0.5, -0.25}, 0);
  EXPECT_FALSE(d.loss_fn_inputs.count("routed_experts"));

  // Sampled with routes (routing replay): the sampler's [prompt + completion - 1 = 4, layers, k] go along as they
  // are, one row per input token, to the policy's datum and the critic's alike.
  Rollout routed = r;
  routed.routed_experts = TensorData::from_ints({0, 1, 2, 3, 4, 5, 6, 7});
  routed.routed_experts->shape = {4, 1, 2};
  EXPECT_EQ(rollout_datum(routed, 0.5).loss_fn_inputs.at("routed_experts"), *routed.routed_experts);
  routed.values = {0.25, 0.5};
  routed.returns = {1.0, 1.5};
  EXPECT_EQ(value_datum(routed, 0.5).loss_fn_inputs.at("routed_experts"), *routed.routed_experts);
}

// The critic's datum of the same rollout: the value before completion token j is read at position 2 + j, so the
// input stops before the last completion token; returns and rollout-time values sit where the weights are.
TEST(Layout, ValueDatum) {
  const Rollout r{{10, 11, 12}, {20, 21}, {-0.5, -0.25}, {2.0, 3.0}, {0.25, 0.5}, {1.0, 1.5}};
  const Datum d = value_datum(r, 0.5);
  EXPECT_EQ(d.model_input.tokens(), (std::vector<token_id>{10, 11, 12, 20}));
  expect_all_near(floats(d, "weights"), {0, 0, 0.5, 0.5}, 0);
  expect_all_near(floats(d, "returns"), {0, 0, 1.0, 1.5}, 0);
  expect_all_near(floats(d, "old_values"), {0, 0, 0.25, 0.5}, 0);
}

// targets (1, 2, 4): mean 7/3, population variance 42/27; residuals of predictions (1, 2, 3) are (0, 0, 1):
// variance 6/27; explained 1 - 6/42 = 6/7.
TEST(Critic, ExplainedVariance) {
  EXPECT_NEAR(explained_variance(std::vector<double>{1, 2, 3}, std::vector<double>{1, 2, 4}), 6.0 / 7.0, 1e-12);
  EXPECT_NEAR(explained_variance(std::vector<double>{1, 2, 4}, std::vector<double>{1, 2, 4}), 1.0, 1e-12);
  // Predicting the mean explains nothing.
  EXPECT_NEAR(explained_variance(std::vector<double>(3, 7.0 / 3), std::vector<double>{1, 2, 4}), 0.0, 1e-12);
  EXPECT_THROW(explained_variance(std::vector<double>{1}, std::vector<double>{1, 2}), rlloop::invalid_argument);
}

// prompt (1, 2) + completion (3, 4): input (1, 2, 3), targets (2, 3, 4), weight on the last two (3 and 4).
TEST(Layout, CompletionDatum) {
  const Datum d = completion_datum({1, 2}, {3, 4});
  EXPECT_EQ(d.model_input.tokens(), (std::vector<token_id>{1, 2, 3}));
  expect_all_near(floats(d, "target_tokens"), {2, 3, 4}, 0);
  expect_all_near(floats(d, "weights"), {0, 1, 1}, 0);
  EXPECT_EQ(d.loss_fn_inputs.count("advantages"), 0u);
  EXPECT_THROW(completion_datum({}, {3}), rlloop::invalid_argument);
}
