// The fake session itself: the Session contract (futures, errors, determinism, checkpoints, usage) and the
// per-token loss terms against hand-computed values.
#include <cmath>

#include <gtest/gtest.h>

#include "fake_session.hpp"
#include "toy_loop.hpp"

using namespace rlloop;
using rlloop::testing::CharTokenizer;
using rlloop::testing::FakeSession;
using rlloop::testing::FakeSessionOptions;

namespace {

Datum next_token_datum(std::vector<token_id> tokens, std::vector<float> weights) {
  Datum d;
  d.model_input = ModelInput::from_tokens({tokens.begin(), tokens.end() - 1});
  d.loss_fn_inputs["target_tokens"] = TensorData::from_tokens(std::vector<token_id>(tokens.begin() + 1, tokens.end()));
  d.loss_fn_inputs["weights"] = TensorData::from_floats(std::move(weights));
  return d;
}

}  // namespace

TEST(FakeSession, UniformTableGivesLogOneOverVocab) {
  FakeSession s({.vocab_size = 4});
  const auto lp = s.compute_logprobs({ModelInput::from_tokens({0, 1, 2})}).get();
  ASSERT_EQ(lp.size(), 3u);
  EXPECT_EQ(lp[0], 0.0);  // the first token has no context
  EXPECT_NEAR(lp[1], std::log(0.25), 1e-12);
  EXPECT_NEAR(lp[2], std::log(0.25), 1e-12);
}

TEST(FakeSession, CrossEntropyLossAndOneAdamStep) {
  // Vocab 4, uniform: lp = log(1/4) = -1.386294. Weights (1, 0.5): loss = 1.5 * 1.386294 = 2.079442.
  FakeSession s({.vocab_size = 4});
  auto d = next_token_datum({0, 1, 2}, {1.0f, 0.5f});
  const auto out = s.forward_backward({d}, LossSpec::cross_entropy()).get();
  EXPECT_NEAR(out.metrics.at("loss:sum"), 2.0794415, 1e-6);
  EXPECT_EQ(out.training_tokens, 2);
  // Gradient of row [0] w.r.t. the logits: -1 * (onehot(1) - 1/4) = (0.25, -0.75, 0.25, 0.25); norm over both
  // rows: row [1] is 0.5 * that. |g|^2 = (0.0625*3 + 0.5625) * (1 + 0.25) = 0.9375; norm = 0.968246.
  const auto step = s.optim_step({.learning_rate = 0.1}).get();
  EXPECT_NEAR(step.metrics.at("grad_norm"), 0.9682458, 1e-6);
  // Adam's first step moves every touched logit by lr * sign(g) (up to eps): the target's logit +0.1, the others
  // -0.1, so p(1 | 0) = e^0.1 / (e^0.1 + 3 e^-0.1) = 1.105171 / (1.105171 + 2.714512) = 0.289336.
  EXPECT_NEAR(std::exp(s.logprob({0}, 1)), 0.289336, 1e-5);
  EXPECT_EQ(s.info().step, 1);
}

TEST(FakeSession, TokenTermsMatchDesignFormulas) {
  using T = FakeSession;
  // lp = -1, q = -1.2: r = exp(0.2) = 1.221403; A = 2, weight 0.5.
  const double lp = -1.0, q = -1.2, a = 2.0, m = 0.5, r = 1.2214028;
  auto is = T::token_term(LossSpec::importance_sampling(), lp, q, a, m);
  EXPECT_NEAR(is.loss, -r * a * m, 1e-6);  // -1.221403
  EXPECT_NEAR(is.grad, -r * a * m, 1e-6);  // d(-r A m)/dlp = -r A m
  // ppo, A > 0, r above 1.2: min picks the clipped term 1.2 * 2 = 2.4, no gradient.
  auto ppo = T::token_term(LossSpec::ppo(), lp, q, a, m);
  EXPECT_NEAR(ppo.loss, -1.2 * a * m, 1e-12);
  EXPECT_EQ(ppo.grad, 0.0);
  EXPECT_TRUE(ppo.clipped);
  // ppo, A < 0, r above 1.2: min picks r A = -2.442806 (unclipped): gradient -r A m = +1.221403.
  auto ppo_neg = T::token_term(LossSpec::ppo(), lp, q, -a, m);
  EXPECT_NEAR(ppo_neg.loss, r * a * m, 1e-6);
  EXPECT_NEAR(ppo_neg.grad, r * a * m, 1e-6);
  EXPECT_FALSE(ppo_neg.clipped);  // the clamp is active, but the unclipped branch is the one taken
  // cispo: clamp(r) = 1.2 held constant: loss -1.2 * lp * A * m = 1.2, gradient -1.2 * A * m = -1.2.
  auto cispo = T::token_term(LossSpec::cispo(), lp, q, a, m);
  EXPECT_NEAR(cispo.loss, 1.2, 1e-12);
  EXPECT_NEAR(cispo.grad, -1.2, 1e-12);
  // dro beta 0.1: loss -(lp A - 0.05 (lp - q)^2) m = -(-2 - 0.05 * 0.04) * 0.5 = 1.001; grad -(A - 0.1*0.2) m = -0.99.
  auto dro = T::token_term(LossSpec::dro(0.1), lp, q, a, m);
  EXPECT_NEAR(dro.loss, 1.001, 1e-12);
  EXPECT_NEAR(dro.grad, -0.99, 1e-12);
}

TEST(FakeSession, RlLossWeightsScaleEachTokenTerm) {
  // importance_sampling on a uniform vocab-4 table with q = lp (r = 1): per-token loss = -A * weight.
  FakeSession s({.vocab_size = 4});
  auto d = next_token_datum({0, 1, 2}, {0.0f, 0.25f});
  const float lp = static_cast<float>(std::log(0.25));
  d.loss_fn_inputs["logprobs"] = TensorData::from_floats({lp, lp});
  d.loss_fn_inputs["advantages"] = TensorData::from_floats({3.0f, 2.0f});
  const auto out = s.forward({d}, LossSpec::importance_sampling()).get();
  EXPECT_NEAR(out.metrics.at("loss:sum"), -0.5, 1e-6);  // -(0 * 3 + 0.25 * 2)
}

TEST(FakeSession, ErrorsComeBackThroughTheFuture) {
  FakeSession s({.vocab_size = 4});
  auto bad = next_token_datum({0, 1, 7}, {1.0f, 1.0f});  // 7 is out of the vocabulary
  auto f = s.forward_backward({bad}, LossSpec::cross_entropy());
  EXPECT_THROW(f.get(), rlloop::invalid_argument);
  auto no_adv = next_token_datum({0, 1, 2}, {1.0f, 1.0f});
  EXPECT_THROW(s.forward({no_adv}, LossSpec::ppo()).get(), rlloop::invalid_argument);
  EXPECT_THROW(s.load_state("fake://state/missing", true).get(), rlloop::not_found);
  EXPECT_THROW(s.optim_step({.learning_rate = 0}).get(), rlloop::invalid_argument);
}

TEST(FakeSession, SamplingIsSeededAndLogprobsAgreeWithComputeLogprobs) {
  FakeSession s({.vocab_size = 6, .init_scale = 2.0, .seed = 3, .eos_token_id = 5});
  SampleRequest req{ModelInput::from_tokens({1, 2}), 4, {.max_tokens = 6, .seed = 42}};
  const auto a = s.sample(req).get(), b = s.sample(req).get();
  ASSERT_EQ(a.sequences.size(), 4u);
  for (std::size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(a.sequences[i].tokens, b.sequences[i].tokens);
    std::vector<token_id> full{1, 2};
    full.insert(full.end(), a.sequences[i].tokens.begin(), a.sequences[i].tokens.end());
    const auto lp = s.compute_logprobs({ModelInput::from_tokens(full)}).get();
    for (std::size_t j = 0; j < a.sequences[i].tokens.size(); ++j)
      EXPECT_NEAR(a.sequences[i].logprobs[j], lp[2 + j], 1e-12);
    const bool ended_on_eos = a.sequences[i].tokens.back() == 5;
    EXPECT_EQ(a.sequences[i].stop_reason == StopReason::stop, ended_on_eos);
  }
  // Billing: the prompt once per call, every generated token.
  EXPECT_EQ(s.usage().prefill, 4);
}

TEST(FakeSession, SaveAndLoadStateRestoreWeightsAndSamplerSnapshotsStayFixed) {
  FakeSession s({.vocab_size = 4});
  auto d = next_token_datum({0, 1}, {1.0f});
  const auto saved = s.save_state("before").get().path;
  const auto frozen = s.save_weights_for_sampler("base").get().path;
  s.forward_backward({d}, LossSpec::cross_entropy()).get();
  s.optim_step({.learning_rate = 0.5}).get();
  const double trained = s.logprob({0}, 1);
  EXPECT_GT(trained, std::log(0.25));
  // The sampler snapshot still scores with the base weights.
  const auto base_lp = s.compute_logprobs({ModelInput::from_tokens({0, 1}), frozen}).get();
  EXPECT_NEAR(base_lp[1], std::log(0.25), 1e-12);
  s.load_state(saved, /*with_optimizer=*/true).get();
  EXPECT_NEAR(s.logprob({0}, 1), std::log(0.25), 1e-12);
  EXPECT_EQ(s.info().step, 0);
}

TEST(FakeSession, CustomLossGradientIsChainedIntoTheTable) {
  // Custom objective -lp (the same as cross_entropy with weight 1) must move the model like cross_entropy does.
  FakeSession a({.vocab_size = 4}), b({.vocab_size = 4});
  auto d = next_token_datum({0, 1, 2}, {1.0f, 1.0f});
  a.forward_backward({d}, LossSpec::cross_entropy()).get();
  const auto out =
      b.forward_backward_custom({d}, [](const std::vector<Datum>&, const std::vector<std::vector<double>>& lp) {
         CustomLossResult r;
         r.loss = -(lp[0][0] + lp[0][1]);
         r.grad_logprobs = {{-1.0, -1.0}};
         return r;
       }).get();
  EXPECT_NEAR(out.metrics.at("loss:sum"), 2 * std::log(4.0), 1e-12);
  a.optim_step({.learning_rate = 0.1}).get();
  b.optim_step({.learning_rate = 0.1}).get();
  EXPECT_EQ(a.logprob({0}, 1), b.logprob({0}, 1));
  EXPECT_EQ(a.logprob({1}, 2), b.logprob({1}, 2));
  // A wrong-shaped gradient is the caller's error.
  auto bad = b.forward_backward_custom({d}, [](const std::vector<Datum>&, const std::vector<std::vector<double>>&) {
    return CustomLossResult{0.0, {{1.0}}, {}};
  });
  EXPECT_THROW(bad.get(), rlloop::invalid_argument);
}

TEST(FakeSession, GrpoOnAToyRewardRaisesTheReward) {
  // Alphabet "abcd" + EOS; reward = share of 'a' in the completion. Uniform start: expected reward ~0.25 per
  // character; with this seed it climbs from ~0.26 to ~0.93 over 30 steps. The same template runs on rlloop-tiny in
  // algorithms_engine_test.
  auto tokenizer = std::make_shared<CharTokenizer>("abcd");
  auto session = std::make_shared<FakeSession>(FakeSessionOptions{.vocab_size = 5, .seed = 1, .eos_token_id = 4});
  const std::vector<toy::LetterProblem> problems{{"b"}, {"cd"}, {"dc"}, {"bb"}};
  const auto stats =
      toy::run_toy_grpo(TrainingClient<FakeSession>(session), tokenizer, problems, toy::ShareOf{"a"}, 30,
                        {.group_size = 8, .sampling = {.max_tokens = 4, .seed = 7}, .adam = {.learning_rate = 0.1}});
  const double first = (stats[0].reward_mean + stats[1].reward_mean) / 2;
  const double last = (stats[28].reward_mean + stats[29].reward_mean) / 2;
  EXPECT_LT(first, 0.4);
  EXPECT_GT(last, 0.8);
  EXPECT_EQ(session->info().step, 30);
}
