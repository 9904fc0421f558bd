// Full fine-tuning in bf16 (LocalServiceOptions::dtype = "bf16", the arithmetic CUDA runs, here on the CPU): the
// optimizer's fp32 master weights take steps a bf16 weight cannot, and SFT in bf16 follows the fp32 run.
#include <gtest/gtest.h>

#include <rlloop/local.hpp>
#include <rlloop/rlloop.hpp>

#include "io/checkpoint.hpp"
#include "session_util.hpp"

using namespace rlloop;
using namespace test_util;
namespace fs = std::filesystem;

namespace {

LocalServiceOptions bf16_service(const fs::path& dir) {
  LocalServiceOptions s = service_in(dir.string());
  s.dtype = "bf16";
  return s;
}

// Problems of the kind the arithmetic demo trains on, as byte-level SFT data.
std::vector<Datum> sums(int count, int offset) {
  std::vector<Datum> out;
  for (int i = 0; i < count; ++i) {
    const int a = (37 * (i + offset)) % 100, b = (61 * (i + offset) + 13) % 100;
    out.push_back(sft_datum(std::to_string(a) + "+" + std::to_string(b) + "=" + std::to_string(a + b) + "\n"));
  }
  return out;
}

}  // namespace

TEST(MixedPrecision, ABf16StepAtLr1e5MovesTheMasterWeightsByTheStep) {
  const fs::path dir = temp_dir("mp", "step");
  LocalService svc(bf16_service(dir));
  auto tc = ServiceClient<LocalService>(svc).create_full_training_client("rlloop-tiny", 3);
  tc.save_state("before").get();
  tc.forward_backward(sums(8, 0), LossSpec::cross_entropy()).get();
  tc.optim_step(AdamParams{.learning_rate = 1e-5}).get();
  tc.save_state("after").get();
  const auto before = engine::read_state_dir((dir / "before").string(), true);
  const auto after = engine::read_state_dir((dir / "after").string(), true);

  const std::string name = "model.layers.0.self_attn.q_proj.weight";
  const torch::Tensor w0 = before.weights.at(name).to(torch::kFloat32);
  ASSERT_EQ(before.weights.at(name).scalar_type(), torch::kBFloat16);
  ASSERT_TRUE(after.optimizer.count(name + ".master"));
  const torch::Tensor master = after.optimizer.at(name + ".master");
  const torch::Tensor stored = after.weights.at(name);
  // Adam's first step is lr * sign(gradient): every weight of the matrix moved by 1e-5 in its master.
  const torch::Tensor moved = (master - w0).abs();
  EXPECT_GT(moved.gt(0.99e-5).logical_and(moved.lt(1.01e-5)).sum().item<std::int64_t>(), w0.numel() * 99 / 100);
  // The stored bf16 weight is the master's rounding: it moved only where the step exceeds half a bf16 step of
  // the weight (|w| below ~1.3e-3), which an update applied to bf16 directly would also have missed elsewhere.
  EXPECT_TRUE(torch::equal(stored, master.to(torch::kBFloat16)));
  const auto stored_changed = stored.to(torch::kFloat32).ne(w0).sum().item<std::int64_t>();
  EXPECT_GT(stored_changed, 0);
  EXPECT_LT(stored_changed, w0.numel() / 2);

  // Resuming from the state continues from the masters, not from their rounding: one more step from "after" in
  // a new session equals the same step taken in this one.
  tc.forward_backward(sums(8, 8), LossSpec::cross_entropy()).get();
  tc.optim_step(AdamParams{.learning_rate = 1e-5}).get();
  tc.save_state("continued").get();
  auto resumed = ServiceClient<LocalService>(svc).create_full_training_client("rlloop-tiny", 3);
  resumed.load_state((dir / "after").string(), true).get();
  resumed.forward_backward(sums(8, 8), LossSpec::cross_entropy()).get();
  resumed.optim_step(AdamParams{.learning_rate = 1e-5}).get();
  resumed.save_state("resumed").get();
  const auto continued = engine::read_state_dir((dir / "continued").string(), true);
  const auto again = engine::read_state_dir((dir / "resumed").string(), true);
  EXPECT_TRUE(torch::equal(continued.optimizer.at(name + ".master"), again.optimizer.at(name + ".master")));
}

// 100 SFT steps of rlloop-small from the same seed and data in fp32 and in bf16, at a fine-tuning learning rate
// (5e-5). The bf16 run's loss stays within 2% of the fp32 run's at every step. Measured on this CPU: at most 0.33%
// (5.536 -> 3.644 in fp32, 3.642 in bf16); with the update applied to the bf16 weights directly (measured once with
// the masters switched off in optimizer.cpp) the same run falls behind from the first steps and ends 13.5% above
// (4.14): a step of 5e-5 rounds away on every weight above ~0.013 in magnitude.
TEST(MixedPrecision, Bf16SftTracksTheFp32RunFor100Steps) {
  auto run = [](const std::string& dtype) {
    const fs::path dir = temp_dir("mp", "sft-" + dtype);
    LocalServiceOptions s = service_in(dir.string());
    s.dtype = dtype;
    LocalService svc(s);
    auto tc = ServiceClient<LocalService>(svc).create_full_training_client("rlloop-small", 7);
    std::vector<double> losses;
    for (int step = 0; step < 100; ++step) {
      const auto batch = sums(16, 16 * step);
      double tokens = 0;
      for (const auto& d : batch) tokens += static_cast<double>(d.model_input.length());
      auto fb = tc.forward_backward(batch, LossSpec::cross_entropy());
      tc.optim_step(AdamParams{.learning_rate = 5e-5, .beta2 = 0.99});
      losses.push_back(fb.get().metrics.at("loss:sum") / tokens);
    }
    return losses;
  };
  const auto fp32 = run("fp32"), bf16 = run("bf16");
  double worst = 0;
  for (std::size_t i = 0; i < fp32.size(); ++i) worst = std::max(worst, std::abs(bf16[i] - fp32[i]) / fp32[i]);
  std::printf("bf16 vs fp32 SFT losses: first %.4f / %.4f, last %.4f / %.4f, largest relative difference %.4f\n",
              bf16.front(), fp32.front(), bf16.back(), fp32.back(), worst);
  EXPECT_LT(worst, 0.02);
  EXPECT_LT(fp32.back(), 0.75 * fp32.front());  // it learned: ln(260) ~ 5.5 at the start
  EXPECT_LT(bf16.back(), 0.75 * bf16.front());
}
