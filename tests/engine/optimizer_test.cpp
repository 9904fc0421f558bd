// AdamW against values worked out by hand from the update rule (torch.optim.AdamW's formulation).
#include <gtest/gtest.h>

#include <cmath>

#include <rlloop/error.hpp>

#include "runtime/optimizer.hpp"

using namespace rlloop;
using namespace rlloop::engine;

namespace {
torch::Tensor param(std::vector<float> v) { return torch::tensor(v).set_requires_grad(true); }
void set_grad(torch::Tensor& p, std::vector<float> g) { p.mutable_grad() = torch::tensor(g); }
std::string test_error(AdamW& opt, const std::map<std::string, torch::Tensor>& state) {
  try {
    opt.load_state_tensors(state, 1);
  } catch (const rlloop::error& e) {
    return e.what();
  }
  return "(no error)";
}
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

// Mixed precision: a bf16 parameter steps through an fp32 master, which follows the fp32 run of the same
// gradients bit for bit; the parameter is the master's rounding.
TEST(AdamW, Bf16ParameterStepsThroughAnFp32MasterAsTheFp32RunDoes) {
  const std::vector<float> init{0.02f, -0.0203125f, 1.0f, 3e-4f};
  auto w32 = param(init);
  auto w16 = torch::tensor(init).to(torch::kBFloat16).set_requires_grad(true);
  // The fp32 run starts from the same (bf16-representable) values.
  { torch::NoGradGuard g; w32.copy_(w16); }
  AdamW opt32({{"w", w32, false}}), opt16({{"w", w16, false}});
  const AdamParams hp{.learning_rate = 1e-5, .weight_decay = 0.01};
  for (int s = 0; s < 30; ++s) {
    const std::vector<float> g{0.5f, -0.25f, 1.0f, (s % 2) ? 0.125f : -0.125f};
    set_grad(w32, g);
    w16.mutable_grad() = torch::tensor(g).to(torch::kBFloat16);  // exact in bf16
    opt32.step(hp);
    opt16.step(hp);
    ASSERT_TRUE(torch::equal(opt16.master(0), w32.detach())) << "step " << s;
    ASSERT_TRUE(torch::equal(w16.detach(), w32.detach().to(torch::kBFloat16))) << "step " << s;
  }
  // 30 steps of ~1e-5 moved 0.02 by ~3e-4, more than half its bf16 step (6.1e-5): the stored weight changed too.
  // Updated in place without a master, each single step (< half a step) would have rounded away.
  const double w0 = 0.02001953125;  // 0.02 in bf16; a constant gradient gives Adam updates of 1 (up to eps)
  EXPECT_NEAR(w32[0].item<double>(), w0 * std::pow(1 - 1e-7, 30) - 30e-5, 1e-7);  // fp32 rounding of 30 adds
  EXPECT_NE(w16[0].item<float>(), init[0]);
  const auto one_step_in_bf16 =
      (torch::tensor(std::vector<float>{0.02f}).to(torch::kBFloat16) - 1e-5).to(torch::kBFloat16);
  EXPECT_EQ(one_step_in_bf16.item<float>(), torch::tensor(0.02f).to(torch::kBFloat16).item<float>());
  EXPECT_EQ(opt16.master(0).scalar_type(), torch::kFloat32);
  EXPECT_FALSE(opt32.master(0).defined());  // an fp32 parameter is its own master
}

TEST(AdamW, Bf16GradientsAccumulateInFp32) {
  auto w = torch::zeros({1}, torch::kBFloat16).set_requires_grad(true);
  AdamW opt({{"w", w, false}});
  // 1 + 2^-9 is not a bf16 value (8 significant bits): summed in bf16 the second gradient would vanish.
  w.mutable_grad() = torch::ones({1}, torch::kBFloat16);
  opt.absorb_gradients();
  EXPECT_FALSE(w.grad().defined());
  w.mutable_grad() = torch::full({1}, 1.0f / 512, torch::kBFloat16);
  EXPECT_EQ(opt.gradient(0).item<double>(), 1.0 + 1.0 / 512);  // gradient() absorbs what is pending
  EXPECT_EQ(opt.gradient(0).scalar_type(), torch::kFloat32);
  EXPECT_NEAR(opt.grad_norm(), 1.0 + 1.0 / 512, 1e-12);
  opt.set_gradient(0, torch::full({1}, 3.0));
  EXPECT_EQ(opt.gradient(0).item<double>(), 3.0);
  opt.zero_grad();
  EXPECT_FALSE(opt.gradient(0).defined());
  EXPECT_EQ(opt.grad_norm(), 0.0);
}

TEST(AdamW, MasterWeightsRoundTripAndAnOldStateTakesTheParameter) {
  auto w = torch::tensor(std::vector<float>{0.5f, -0.25f}).to(torch::kBFloat16).set_requires_grad(true);
  AdamW opt({{"w", w, false}});
  w.mutable_grad() = torch::ones({2}, torch::kBFloat16);
  opt.step(AdamParams{.learning_rate = 1e-4});
  std::map<std::string, torch::Tensor> saved;
  for (auto& [k, v] : opt.state_tensors()) saved[k] = v;
  ASSERT_TRUE(saved.count("w.master"));
  EXPECT_NEAR(saved.at("w.master")[0].item<double>(), 0.5 - 1e-4, 1e-7);

  auto w2 = torch::zeros({2}, torch::kBFloat16).set_requires_grad(true);
  AdamW opt2({{"w", w2, false}});
  opt2.load_state_tensors(saved, 1);
  EXPECT_TRUE(torch::equal(opt2.master(0), saved.at("w.master")));
  EXPECT_TRUE(torch::equal(w2.detach(), saved.at("w.master").to(torch::kBFloat16)));  // the master's rounding
  saved.erase("w.master");  // a state saved before masters existed: the parameter's value
  { torch::NoGradGuard g; w2.fill_(2.0); }
  opt2.load_state_tensors(saved, 1);
  EXPECT_EQ(opt2.master(0)[0].item<double>(), 2.0);
  saved.at("w.exp_avg") = torch::zeros({3});
  EXPECT_NE(test_error(opt2, saved).find("optimizer state tensor 'w.exp_avg' has the wrong shape"), std::string::npos);
}
