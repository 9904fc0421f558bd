// AdamW against values worked out by hand from the update rule (torch.optim.AdamW's formulation).
#include <gtest/gtest.h>

#include <cmath>

#include <rlloop/error.hpp>

#include "optimizer.hpp"

using namespace rlloop;
using namespace rlloop::engine;

namespace {
torch::Tensor param(std::vector<float> v) { return torch::tensor(v).set_requires_grad(true); }
void set_grad(torch::Tensor& p, std::vector<float> g) { p.mutable_grad() = torch::tensor(g); }
}  // namespace

TEST(AdamW, FirstTwoStepsMatchTheUpdateRule) {
  auto w = param({1.0f, -2.0f});
  AdamW opt({{"w", w, false}});
  AdamParams hp{.learning_rate = 0.1, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01};
  set_grad(w, {0.5f, -1.0f});
  auto m = opt.step(hp);
  EXPECT_NEAR(m.at("grad_norm"), std::sqrt(1.25), 1e-6);
  // Step 1: m_hat = g, v_hat = g^2 -> update = sign(g) (up to eps); decay first: w *= 1 - lr * wd.
  EXPECT_NEAR(w[0].item<double>(), 1.0 * (1 - 0.001) - 0.1, 1e-6);
  EXPECT_NEAR(w[1].item<double>(), -2.0 * (1 - 0.001) + 0.1, 1e-6);
  EXPECT_FALSE(w.grad().abs().sum().item<double>() > 0);  // step zeroes gradients

  set_grad(w, {0.25f, 0.0f});
  opt.step(hp);
  // Step 2 for w[0]: m = 0.9*0.05 + 0.1*0.25 = 0.07 -> m_hat = 0.07/0.19; v = 0.999*0.00025 + 0.001*0.0625
  const double m_hat = 0.07 / 0.19, v_hat = (0.999 * 0.00025 + 0.001 * 0.0625) / (1 - 0.999 * 0.999);
  const double w0_after1 = 1.0 * (1 - 0.001) - 0.1;
  EXPECT_NEAR(w[0].item<double>(), w0_after1 * (1 - 0.001) - 0.1 * m_hat / (std::sqrt(v_hat) + 1e-8), 1e-6);
  EXPECT_EQ(opt.step_count(), 2);
}

TEST(AdamW, ClipsTheGlobalNormAndScalesLoraB) {
  auto a = param({0.0f});
  auto b = param({0.0f});
  AdamW opt({{"a", a, false}, {"b", b, true}});
  set_grad(a, {3.0f});
  set_grad(b, {4.0f});
  AdamParams hp{
      .learning_rate = 0.01, .beta1 = 0.0, .beta2 = 0.0, .eps = 1e-8, .grad_clip_norm = 1.0, .lora_plus_lr_ratio = 4.0};
  auto m = opt.step(hp);
  EXPECT_NEAR(m.at("grad_norm"), 5.0, 1e-6);  // reported before clipping
  // beta = 0: the update is g / |g| whatever the scale, so clipping leaves the sign; LoRA+ quadruples B's step.
  EXPECT_NEAR(a.item<double>(), -0.01, 1e-6);
  EXPECT_NEAR(b.item<double>(), -0.04, 1e-6);
}

TEST(AdamW, RejectsBadHyperparametersByName) {
  auto w = param({1.0f});
  AdamW opt({{"w", w, false}});
  set_grad(w, {1.0f});
  try {
    opt.step(AdamParams{.learning_rate = -1.0});
    FAIL();
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("AdamParams.learning_rate"), std::string::npos);
  }
  EXPECT_THROW(opt.step(AdamParams{.learning_rate = 1e-3, .beta2 = 1.5}), invalid_argument);
  EXPECT_EQ(w.item<double>(), 1.0);  // nothing changed
}

TEST(AdamW, NonFiniteGradientIsRefusedAndCleared) {
  auto w = param({1.0f});
  AdamW opt({{"w", w, false}});
  set_grad(w, {std::nanf("")});
  EXPECT_THROW(opt.step(AdamParams{}), invalid_argument);
  EXPECT_EQ(w.item<double>(), 1.0);
  set_grad(w, {1.0f});
  EXPECT_NO_THROW(opt.step(AdamParams{}));
  EXPECT_LT(w.item<double>(), 1.0);
}

TEST(AdamW, StateRoundTrip) {
  auto w = param({1.0f, 2.0f});
  AdamW opt({{"w", w, false}});
  set_grad(w, {0.5f, 0.5f});
  opt.step(AdamParams{});
  std::map<std::string, torch::Tensor> saved;
  for (auto& [k, v] : opt.state_tensors()) saved[k] = v;
  auto w2 = param({1.0f, 2.0f});
  AdamW opt2({{"w", w2, false}});
  opt2.load_state_tensors(saved, opt.step_count());
  EXPECT_EQ(opt2.step_count(), 1);
  EXPECT_TRUE(torch::equal(opt2.state_tensors()[0].second, saved.at("w.exp_avg")));
  saved.erase("w.exp_avg_sq");
  EXPECT_THROW(opt2.load_state_tensors(saved, 1), io_error);
}
