// The LibTorch side of the fake-session story: the same GRPO template (toy_loop.hpp), DPO and KTO run on rlloop-tiny,
// and the fake session's per-token loss terms equal the engine's own loss code, value and gradient.
#include <cmath>
#include <filesystem>

#include <gtest/gtest.h>

#include "fake_session.hpp"
#include "runtime/loss.hpp"  // src/engine: the engine's built-in losses on tensors
#include "toy_loop.hpp"

#include <rlloop/algorithms/dpo.hpp>
#include <rlloop/algorithms/kto.hpp>
#include <rlloop/local.hpp>
#include <rlloop/rlloop.hpp>

using namespace rlloop;

namespace {
LocalServiceOptions cpu_service() {
  LocalServiceOptions s;
  s.checkpoint_dir = (std::filesystem::temp_directory_path() / "rlloop-algorithms-engine-test").string();
  s.device = "cpu";
  configure_engine_process({.num_threads = 1});
  return s;
}
std::vector<token_id> bytes(const std::string& s) { return {s.begin(), s.end()}; }
}  // namespace

TEST(SameLoop, GrpoTemplateRunsOnTheLibTorchSession) {
  ServiceClient<LocalService> service{LocalService(cpu_service())};
  auto client = service.create_full_training_client("rlloop-tiny", /*seed=*/3);
  const std::vector<toy::LetterProblem> problems{{"ab"}, {"ba"}};
  const auto stats =
      toy::run_toy_grpo(client, load_tokenizer(client), problems, toy::ShareOf{"abcdefghijklmnopqrstuvwxyz"}, 2,
                        {.group_size = 4,
                         .sampling = {.max_tokens = 4, .seed = 5},
                         .drop_uniform_groups = false,
                         .adam = {.learning_rate = 1e-3}});
  ASSERT_EQ(stats.size(), 2u);
  for (const auto& s : stats) {
    EXPECT_GT(s.sampled_tokens, 0);
    EXPECT_LE(s.sampled_tokens, 2 * 4 * 4);
    EXPECT_EQ(s.groups_used, 2);
    EXPECT_TRUE(std::isfinite(s.loss));
    EXPECT_GE(s.reward_mean, 0.0);
    EXPECT_LE(s.reward_mean, 1.0);
  }
  EXPECT_EQ(client.get_info().step, 2);  // one optimizer step per GRPO step (substeps = 1)
}

TEST(SameLoop, DpoStartsAtLogTwoAndCachesTheReference) {
  ServiceClient<LocalService> service{LocalService(cpu_service())};
  auto client = service.create_full_training_client("rlloop-tiny", /*seed=*/4);
  auto reference = client.save_weights_and_get_sampling_client("dpo-reference");
  algorithms::DPO<LocalSession> dpo(client, reference, {.beta = 0.5, .adam = {.learning_rate = 1e-3}});
  const std::vector<algorithms::PreferencePair> pairs{{bytes("1+1="), bytes("2!"), bytes("3.")},
                                                      {bytes("2+2="), bytes("4!"), bytes("5.")}};
  const auto first = dpo.step(pairs);
  // Policy == reference before the first update: z = 0 for every pair, loss = -log sigmoid(0) = log 2. The
  // sampler's and the trainer's logprobs agree to float precision, not bit for bit.
  EXPECT_NEAR(first.loss, std::log(2.0), 1e-4);
  EXPECT_NEAR(first.margin, 0.0, 1e-4);
  EXPECT_EQ(first.reference_calls, 4);
  for (int i = 0; i < 5; ++i) dpo.step(pairs);
  const auto later = dpo.evaluate(pairs);
  EXPECT_EQ(later.reference_calls, 0);  // every pair's reference sums were cached
  EXPECT_LT(later.loss, first.loss);
  EXPECT_GT(later.margin, 0.0);
}

TEST(SameLoop, KtoStartsAtHalfAndSeparatesTheLabels) {
  ServiceClient<LocalService> service{LocalService(cpu_service())};
  auto client = service.create_full_training_client("rlloop-tiny", /*seed=*/4);
  auto reference = client.save_weights_and_get_sampling_client("kto-reference");
  algorithms::KTO<LocalSession> kto(client, reference, {.beta = 0.5, .adam = {.learning_rate = 1e-3}});
  // Unpaired: no prompt has both a desirable and an undesirable completion.
  const std::vector<algorithms::KtoExample> batch{{bytes("1+1="), bytes("2!"), true},
                                                  {bytes("2+2="), bytes("4."), false},
                                                  {bytes("3+3="), bytes("6!"), true},
                                                  {bytes("4+4="), bytes("8."), false}};
  const auto first = kto.step(batch);
  // Policy == reference to float precision: r = z = 0, each term 1 - sigmoid(0) = 0.5.
  EXPECT_NEAR(first.loss, 0.5, 1e-4);
  EXPECT_NEAR(first.margin, 0.0, 1e-4);
  EXPECT_EQ(first.reference_calls, 4);
  for (int i = 0; i < 5; ++i) kto.step(batch);
  const auto later = kto.evaluate(batch);
  EXPECT_EQ(later.reference_calls, 0);
  EXPECT_LT(later.loss, first.loss);
  EXPECT_GT(later.reward_desirable, 0.0);
  EXPECT_LT(later.reward_undesirable, 0.0);
  EXPECT_EQ(client.get_info().step, 6);
}

// lp, q, A, w per token; the engine's builtin_loss (autograd) against FakeSession::token_term, for every loss.
TEST(FakeMatchesEngine, BuiltinLossValuesAndGradients) {
  const std::vector<double> lp{-1.0, -0.5, -2.0, -0.1, -0.7}, q{-1.2, -0.5, -1.5, -0.3, -0.2},
      a{2.0, -1.0, 0.5, -3.0, 1.5}, w{0.5, 1.0, 0.0, 2.0, 1.0};
  auto t = [](const std::vector<double>& v) { return torch::tensor(v, torch::kFloat64).reshape({1, -1}); };
  for (const LossSpec& spec : {LossSpec::cross_entropy(), LossSpec::importance_sampling(), LossSpec::ppo(0.2, 0.2),
                               LossSpec::ppo(0.1, 0.1), LossSpec::cispo(), LossSpec::dro(0.3),
                               LossSpec::stable_reinforce(), LossSpec::stable_reinforce(1.2, 0.05)}) {
    auto lpt = t(lp).requires_grad_(true);
    engine::LossTensors in{torch::ones({1, 5}, torch::kFloat64), t(w), t(a), t(q)};
    auto value = engine::builtin_loss(spec, lpt, in);
    value.loss.backward();
    double loss = 0, clipped = 0, bearing = 0;
    for (std::size_t j = 0; j < lp.size(); ++j) {
      const auto term = rlloop::testing::FakeSession::token_term(spec, lp[j], q[j], a[j], w[j]);
      loss += term.loss;
      const bool loss_bearing = spec.fn == LossFn::cross_entropy || w[j] != 0.0;
      bearing += loss_bearing;
      clipped += term.clipped && loss_bearing;
      EXPECT_NEAR(term.grad, lpt.grad()[0][static_cast<long>(j)].item<double>(), 1e-12)
          << to_string(spec.fn) << " token " << j;
    }
    EXPECT_NEAR(loss, value.loss.item<double>(), 1e-12) << to_string(spec.fn);
    EXPECT_NEAR(clipped, value.clipped.item<double>(), 1e-12) << to_string(spec.fn);
    EXPECT_NEAR(bearing, value.bearing.item<double>(), 1e-12) << to_string(spec.fn);
  }
}

// GSPO-token on two sequences (rows) of one batch: each token's value and gradient are PPO's with its sequence's
// ratio s = exp(mean(lp - q)) over the row's loss-bearing tokens; the second row's clip range is narrow enough
// (its s is exp(0.3)) that its clipped branch is taken where A > 0, and padding (mask 0) stays out of s.
TEST(FakeMatchesEngine, GspoUsesEachSequencesRatio) {
  const std::vector<std::vector<double>> lp{{-1.0, -0.5, -2.0, -0.1}, {-0.7, -0.2, -1.1, -3.0}},
      q{{-1.2, -0.5, -1.5, -0.3}, {-1.0, -0.5, -1.4, 0.0}}, a{{2.0, -1.0, 0.5, -3.0}, {1.5, -2.0, 1.0, 4.0}},
      w{{0.5, 1.0, 0.0, 2.0}, {1.0, 1.0, 1.0, 0.0}};
  auto t = [](const std::vector<std::vector<double>>& v) {
    return torch::stack({torch::tensor(v[0], torch::kFloat64), torch::tensor(v[1], torch::kFloat64)});
  };
  const LossSpec spec = LossSpec::gspo(0.1, 0.1);
  auto lpt = t(lp).requires_grad_(true);
  // Row 1's last token is padding: its q (0.0) would move the ratio if it counted.
  auto mask = torch::tensor({1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0}, torch::kFloat64).reshape({2, 4});
  engine::LossTensors in{mask, t(w), t(a), t(q)};
  auto value = engine::builtin_loss(spec, lpt, in);
  value.loss.backward();
  double loss = 0, clipped = 0;
  for (std::size_t row = 0; row < 2; ++row) {
    const auto real = row == 0 ? 4u : 3u;
    auto cut = [&](const std::vector<double>& v) { return std::vector<double>(v.begin(), v.begin() + real); };
    const auto terms = rlloop::testing::FakeSession::gspo_terms(spec, cut(lp[row]), cut(q[row]), cut(a[row]),
                                                                cut(w[row]));
    for (std::size_t j = 0; j < real; ++j) {
      loss += terms[j].loss;
      clipped += terms[j].clipped && w[row][j] != 0.0;
      EXPECT_NEAR(terms[j].grad, lpt.grad()[static_cast<long>(row)][static_cast<long>(j)].item<double>(), 1e-12)
          << "row " << row << " token " << j;
    }
  }
  EXPECT_NEAR(loss, value.loss.item<double>(), 1e-12);
  EXPECT_NEAR(clipped, value.clipped.item<double>(), 1e-12);
  EXPECT_GT(clipped, 0.0);  // the clip bites
  // s of row 1 by hand: exp(mean(0.3, 0.3, 0.3)) over its three real tokens.
  const auto row1 = rlloop::testing::FakeSession::gspo_terms(spec, {-0.7}, {-1.0}, {-1.0}, {1.0});
  EXPECT_NEAR(row1[0].loss, std::exp(0.3) * 1.0, 1e-12);  // A < 0: min(sA, clamp(s)A) = sA
}
