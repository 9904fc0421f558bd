// The built-in losses against hand-computed values and finite differences, in double precision.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>

#include "runtime/loss.hpp"

using namespace rlloop;
using namespace rlloop::engine;

namespace {
torch::Tensor vec(std::vector<double> v) { return torch::tensor(v, torch::kFloat64).unsqueeze(0); }

// Four tokens chosen to hit every branch of ppo / cispo at lo = 0.8, hi = 1.2:
//   t0: r = e^0.2  = 1.2214 > hi, A > 0  -> clipped (ppo takes 1.2 * A)
//   t1: r = e^-0.5 = 0.6065 < lo, A < 0  -> clipped (ppo takes 0.8 * A)
//   t2: r = e^0.05 = 1.0513 inside       -> unclipped
//   t3: r = e^0.5  = 1.6487 > hi, A < 0  -> min picks r * A: unclipped, gradient flows
struct Fixture {
  torch::Tensor lp = vec({-1.0, -2.0, -1.0, -0.5});
  LossTensors in{vec({1, 1, 1, 1}), vec({1.0, 1.0, 1.0, 1.0}), vec({1.0, -2.0, 0.5, -1.0}),
                 vec({-1.2, -1.5, -1.05, -1.0})};
};

double loss_at(const LossSpec& spec, const Fixture& f, const torch::Tensor& lp) {
  return builtin_loss(spec, lp, f.in).loss.item<double>();
}

// Autograd gradient of the loss w.r.t. lp.
std::vector<double> autograd(const LossSpec& spec, const Fixture& f) {
  auto lp = f.lp.clone().set_requires_grad(true);
  builtin_loss(spec, lp, f.in).loss.backward();
  auto g = lp.grad().squeeze(0);
  return std::vector<double>(g.data_ptr<double>(), g.data_ptr<double>() + g.numel());
}

std::vector<double> finite_difference(const LossSpec& spec, const Fixture& f) {
  std::vector<double> out;
  const double h = 1e-6;
  for (int64_t i = 0; i < f.lp.size(1); ++i) {
    auto plus = f.lp.clone(), minus = f.lp.clone();
    plus[0][i] += h;
    minus[0][i] -= h;
    out.push_back((loss_at(spec, f, plus) - loss_at(spec, f, minus)) / (2 * h));
  }
  return out;
}

void expect_near_all(const std::vector<double>& a, const std::vector<double>& b, double tol) {
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], tol) << "token " << i;
}
}  // namespace

TEST(Loss, CrossEntropyGoldenAndGradient) {
  Fixture f;
  f.in.weights = vec({1.0, 0.5, 2.0, 0.0});
  // -(-1*1 + -2*0.5 + -1*2 + -0.5*0) = 4
  EXPECT_NEAR(loss_at(LossSpec::cross_entropy(), f, f.lp), 4.0, 1e-12);
  expect_near_all(autograd(LossSpec::cross_entropy(), f), {-1.0, -0.5, -2.0, 0.0}, 1e-12);
  expect_near_all(autograd(LossSpec::cross_entropy(), f), finite_difference(LossSpec::cross_entropy(), f), 1e-6);
}

TEST(Loss, ImportanceSamplingGoldenAndGradient) {
  Fixture f;
  const double r0 = std::exp(0.2), r1 = std::exp(-0.5), r2 = std::exp(0.05), r3 = std::exp(0.5);
  EXPECT_NEAR(loss_at(LossSpec::importance_sampling(), f, f.lp), -(r0 * 1.0 + r1 * -2.0 + r2 * 0.5 + r3 * -1.0), 1e-12);
  // d/dlp of -(r A) is -(r A).
  expect_near_all(autograd(LossSpec::importance_sampling(), f), {-r0, 2 * r1, -0.5 * r2, r3}, 1e-12);
  expect_near_all(autograd(LossSpec::importance_sampling(), f), finite_difference(LossSpec::importance_sampling(), f),
                  1e-6);
}

TEST(Loss, PpoTakesEveryClipBranch) {
  Fixture f;
  const double r2 = std::exp(0.05), r3 = std::exp(0.5);
  // min terms: 1.2*1, 0.8*(-2), r2*0.5, r3*(-1)
  EXPECT_NEAR(loss_at(LossSpec::ppo(), f, f.lp), -(1.2 - 1.6 + 0.5 * r2 - r3), 1e-12);
  // Clipped tokens (0, 1) pass no gradient; the others pass -(r A).
  expect_near_all(autograd(LossSpec::ppo(), f), {0.0, 0.0, -0.5 * r2, r3}, 1e-12);
  expect_near_all(autograd(LossSpec::ppo(), f), finite_difference(LossSpec::ppo(), f), 1e-6);
  auto value = builtin_loss(LossSpec::ppo(), f.lp, f.in);
  // The clipped branch is taken at tokens 0 and 1; t3's ratio is outside [lo, hi] but min takes r * A there.
  EXPECT_EQ(value.clipped.item<double>(), 2.0);
  EXPECT_EQ(value.bearing.item<double>(), 4.0);
  EXPECT_EQ(value.clip_fraction(), 0.5);
  // The widest clip range, [0, 10]: nothing clipped, ppo equals importance sampling.
  EXPECT_NEAR(loss_at(LossSpec::ppo(1.0, 9.0), f, f.lp), loss_at(LossSpec::importance_sampling(), f, f.lp), 1e-12);
}

TEST(Loss, CispoUsesTheClippedRatioAsAConstantWeight) {
  Fixture f;
  const double r2 = std::exp(0.05);
  // -(clamp(r) * lp * A): 1.2*(-1)*1, 0.8*(-2)*(-2), r2*(-1)*0.5, 1.2*(-0.5)*(-1)
  EXPECT_NEAR(loss_at(LossSpec::cispo(), f, f.lp), -(-1.2 + 3.2 - 0.5 * r2 + 0.6), 1e-12);
  // stopgrad: d/dlp = -clamp(r) * A, including the clipped tokens (unlike ppo).
  expect_near_all(autograd(LossSpec::cispo(), f), {-1.2, 1.6, -0.5 * r2, 1.2}, 1e-12);
}

TEST(Loss, StableReinforceTruncatesTheWeightAndPenalisesKlToTheSampler) {
  Fixture f;
  const double r0 = std::exp(0.2), r1 = std::exp(-0.5), r2 = std::exp(0.05), r3 = std::exp(0.5);
  const LossSpec spec = LossSpec::stable_reinforce(1.5, 0.1);
  // Weights min(r, 1.5): t3's ratio 1.6487 is truncated; the KL term is k3(r) = (r - 1) - log r per token.
  const double w[] = {r0, r1, r2, 1.5}, r[] = {r0, r1, r2, r3}, lp[] = {-1.0, -2.0, -1.0, -0.5},
               a[] = {1.0, -2.0, 0.5, -1.0};
  double expected = 0;
  std::vector<double> grad;
  for (int j = 0; j < 4; ++j) {
    expected -= w[j] * lp[j] * a[j] - 0.1 * ((r[j] - 1) - std::log(r[j]));
    grad.push_back(-w[j] * a[j] + 0.1 * (r[j] - 1));  // the weight is a constant; d k3 / d lp = r - 1
  }
  EXPECT_NEAR(loss_at(spec, f, f.lp), expected, 1e-12);
  expect_near_all(autograd(spec, f), grad, 1e-12);
  auto value = builtin_loss(spec, f.lp, f.in);
  EXPECT_EQ(value.clipped.item<double>(), 1.0);  // t3 only
  EXPECT_EQ(value.clip_fraction(), 0.25);
  // Without the penalty and with a cap no ratio reaches, it is cispo over [0, 10].
  EXPECT_NEAR(loss_at(LossSpec::stable_reinforce(10.0), f, f.lp), loss_at(LossSpec::cispo(1.0, 9.0), f, f.lp), 1e-12);
  // The KL term is 0 where the policy is the sampler (lp = q): the loss is then plain REINFORCE, -(lp A).
  Fixture same;
  same.in.sampler_logprobs = same.lp.clone();
  EXPECT_NEAR(loss_at(spec, same, same.lp), -(-1.0 * 1.0 + -2.0 * -2.0 + -1.0 * 0.5 + -0.5 * -1.0), 1e-12);
}

// clip_fraction is the share of loss-bearing tokens (weight != 0) where the clipped branch is taken, whatever the
// weights' scale: GRPO's aggregation weights (1/(N*L) per token, 0 on the prompt) must not shrink it.
TEST(Loss, ClipFractionCountsLossBearingTokensWhereTheClipBranchIsTaken) {
  Fixture f;
  // Six positions: a prompt token (weight 0) in front, whose ratio would be clipped, then the fixture's four,
  // each with the tiny weight 1/8, then one padding position (mask 0) that would be clipped too.
  f.lp = vec({-0.1, -1.0, -2.0, -1.0, -0.5, -0.1});
  f.in = LossTensors{vec({1, 1, 1, 1, 1, 0}), vec({0.0, 0.125, 0.125, 0.125, 0.125, 0.125}),
                     vec({1.0, 1.0, -2.0, 0.5, -1.0, 1.0}), vec({-1.0, -1.2, -1.5, -1.05, -1.0, -1.0})};
  auto ppo = builtin_loss(LossSpec::ppo(), f.lp, f.in);
  EXPECT_EQ(ppo.bearing.item<double>(), 4.0);
  // t0, t1 of the fixture: a share of the loss-bearing tokens (a weighted count over every position, prompt and
  // padding included, would read 2 * 0.125 / 6 = 0.042).
  EXPECT_EQ(ppo.clip_fraction(), 0.5);
  // cispo's clipped branch is the active clamp: t0, t1 and t3.
  EXPECT_EQ(builtin_loss(LossSpec::cispo(), f.lp, f.in).clip_fraction(), 0.75);
  // Nothing clipped in the widest clip range; no loss-bearing token at all gives 0, not a division by zero.
  EXPECT_EQ(builtin_loss(LossSpec::ppo(1.0, 9.0), f.lp, f.in).clip_fraction(), 0.0);
  f.in.weights = vec({0, 0, 0, 0, 0, 0});
  EXPECT_EQ(builtin_loss(LossSpec::ppo(), f.lp, f.in).clip_fraction(), 0.0);
}

TEST(Loss, DroGoldenAndGradient) {
  Fixture f;
  const LossSpec spec = LossSpec::dro(0.1);
  // -(lp*A - 0.05 (lp - q)^2) per token
  const double expected = -((-1.0 - 0.05 * 0.04) + (4.0 - 0.05 * 0.25) + (-0.5 - 0.05 * 0.0025) + (0.5 - 0.05 * 0.25));
  EXPECT_NEAR(loss_at(spec, f, f.lp), expected, 1e-12);
  // d/dlp = -(A - beta (lp - q))
  expect_near_all(autograd(spec, f),
                  {-(1.0 - 0.1 * 0.2), -(-2.0 + 0.1 * 0.5), -(0.5 - 0.1 * 0.05), -(-1.0 - 0.1 * 0.5)}, 1e-12);
  expect_near_all(autograd(spec, f), finite_difference(spec, f), 1e-6);
}

TEST(Loss, PaddingIsMaskedOut) {
  Fixture f;
  f.in.mask = vec({1, 1, 0, 0});
  for (LossSpec spec : {LossSpec::cross_entropy(), LossSpec::importance_sampling(), LossSpec::ppo(), LossSpec::cispo(),
                        LossSpec::dro()}) {
    auto g = autograd(spec, f);
    EXPECT_EQ(g[2], 0.0) << to_string(spec.fn);
    EXPECT_EQ(g[3], 0.0) << to_string(spec.fn);
  }
  EXPECT_NEAR(loss_at(LossSpec::cross_entropy(), f, f.lp), 3.0, 1e-12);  // -(-1 + -2)
}

TEST(Loss, RlLossesScaleEachTokenByItsWeight) {
  Fixture f;
  Fixture g;
  g.in.weights = vec({0.0, 1.0, 2.0, 1.0});
  for (LossSpec spec : {LossSpec::importance_sampling(), LossSpec::ppo(), LossSpec::cispo(), LossSpec::dro()}) {
    auto gf = autograd(spec, f), gg = autograd(spec, g);
    EXPECT_EQ(gg[0], 0.0) << to_string(spec.fn);
    EXPECT_NEAR(gg[2], 2.0 * gf[2], 1e-12) << to_string(spec.fn);
    EXPECT_NEAR(gg[3], gf[3], 1e-12) << to_string(spec.fn);
  }
}

TEST(Loss, ValueLossGoldenWithAndWithoutClipping) {
  // t0 inside the clip range; t1 clipped (the clipped error is larger, so no gradient); t2 the unclipped error
  // is larger, so the gradient flows.
  auto v = vec({1.0, 2.0, 0.5}).set_requires_grad(true);
  auto returns = vec({1.5, 1.0, -1.0}), old = vec({0.9, 2.5, 0.0}), m = vec({1, 1, 1});
  auto clipped = value_loss(LossSpec::value(0.2), v, returns, old, m);
  // 0.5 * (0.25 + (2.3 - 1)^2 + 2.25) = 0.125 + 0.845 + 1.125
  EXPECT_NEAR(clipped.loss.item<double>(), 2.095, 1e-12);
  EXPECT_EQ(clipped.clipped.item<double>(), 1.0);
  EXPECT_NEAR(clipped.clip_fraction(), 1.0 / 3.0, 1e-12);  // value_clip_fraction: t1 of three
  clipped.loss.backward();
  expect_near_all(std::vector<double>(v.grad().data_ptr<double>(), v.grad().data_ptr<double>() + 3), {-0.5, 0.0, 1.5},
                  1e-12);
  auto v2 = vec({1.0, 2.0, 0.5}).set_requires_grad(true);
  auto plain = value_loss(LossSpec::value(0.2), v2, returns, torch::Tensor(), m);
  EXPECT_NEAR(plain.loss.item<double>(), 1.75, 1e-12);  // 0.5 * (0.25 + 1 + 2.25)
  plain.loss.backward();
  expect_near_all(std::vector<double>(v2.grad().data_ptr<double>(), v2.grad().data_ptr<double>() + 3), {-0.5, 1.0, 1.5},
                  1e-12);
}

namespace {
// Inputs for the value row too: t0 moves away from its return past the clip (the plain error is the larger), t1
// towards it past the clip (the clipped error is the larger: clipped, no gradient), t2 inside the clip range (both
// errors equal), t3 weight 0.
Fixture with_values() {
  Fixture f;
  f.in.weights = vec({1.0, 0.5, 2.0, 0.0});
  f.in.returns = vec({-0.5, -2.5, -1.5, 0.0});
  f.in.old_values = vec({-0.6, -1.5, -1.125, -0.4});
  return f;
}
}  // namespace

// Every row of the table, whatever it computes: autograd agrees with finite differences on the fixture (all the
// clip branches), so a new loss is checked the moment its row exists; its golden values are its own test above.
// cispo is the exception by design: its stop-gradient makes the gradient differ from its value's derivative
// (CispoUsesTheClippedRatioAsAConstantWeight checks it by hand).
TEST(Loss, EveryRowsGradientMatchesFiniteDifferences) {
  for (const LossInfo& row : kLosses) {
    // cispo, gspo and stable_reinforce stop gradients by design (the clamped ratio; the sequence's ratio; the
    // truncated weight): their gradients are not those of their values (FakeMatchesEngine checks them against their
    // analytic terms).
    if (row.fn == LossFn::cispo || row.fn == LossFn::gspo || row.fn == LossFn::stable_reinforce) continue;
    const Fixture f = with_values();
    LossSpec spec;
    spec.fn = row.fn;
    expect_near_all(autograd(spec, f), finite_difference(spec, f), 1e-6);
    if (HasFailure()) FAIL() << row.name;
  }
}

// The value row is value_loss on the values with m = mask * weights.
TEST(Loss, TheValueRowIsTheCriticsLoss) {
  const Fixture f = with_values();
  const auto row = builtin_loss(LossSpec::value(0.2), f.lp, f.in);
  const auto direct = value_loss(LossSpec::value(0.2), f.lp, f.in.returns, f.in.old_values, f.in.mask * f.in.weights);
  EXPECT_EQ(row.loss.item<double>(), direct.loss.item<double>());
  // 0.5 * (1 * 0.25 + 0.5 * (-1.7 + 2.5)^2 + 2 * 0.25): t1's clipped error 0.64 is the larger.
  EXPECT_NEAR(row.loss.item<double>(), 0.5 * (0.25 + 0.5 * 0.64 + 2 * 0.25), 1e-12);
  EXPECT_EQ(row.clipped.item<double>(), 1.0);
  EXPECT_EQ(row.bearing.item<double>(), 3.0);  // the token of weight 0 bears no loss
  expect_near_all(autograd(LossSpec::value(0.2), f), {-0.5, 0.0, 1.0, 0.0}, 1e-12);
}

// The host-side clip test of each row (the service metric actor/pg_clipfrac) agrees with the tensor code's count.
TEST(Loss, EachRowsTokenClipTestAgreesWithItsTensorCount) {
  Fixture f;
  const auto lp = f.lp.squeeze(0), q = f.in.sampler_logprobs.squeeze(0), a = f.in.advantages.squeeze(0);
  for (const LossInfo& row : kLosses) {
    if (row.output != LossOutput::logprobs) continue;
    LossSpec spec;
    spec.fn = row.fn;
    // gspo's ratio is the sequence's, exp(mean(lp - q)) = exp(0.0625): a narrow range makes it clip where A > 0.
    if (row.fn == LossFn::gspo) spec.epsilon_low = spec.epsilon_high = 0.01;
    // stable_reinforce's default cap, 2, is above every ratio here: 1.1 truncates t0 and t3.
    if (row.fn == LossFn::stable_reinforce) spec.truncation = 1.1;
    double clipped = 0;
    const double sequence_log_ratio = (lp - q).mean().item<double>();  // every token bears the loss here
    for (int64_t j = 0; j < lp.size(0); ++j)
      clipped += loss_kernel(row.fn).clips_token(spec, lp[j].item<double>(), q[j].item<double>(),
                                                 a[j].item<double>(), sequence_log_ratio);
    EXPECT_EQ(clipped, builtin_loss(spec, f.lp, f.in).clipped.item<double>()) << row.name;
    // Only the losses that name a clip metric clip anything on this fixture, which takes every clip branch.
    EXPECT_EQ(clipped > 0, !row.clip_metric.empty()) << row.name;
  }
  EXPECT_THROW(loss_kernel(static_cast<LossFn>(kLossCount)), invalid_argument);
}
