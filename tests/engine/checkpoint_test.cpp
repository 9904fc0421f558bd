// Checkpoints across processes: resume is bit-identical; kill -9 during saves never leaves a torn checkpoint; the
// state.json codec reads what sessions write.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <optional>
#include <random>
#include <thread>

#include "io/checkpoint.hpp"
#include "session_util.hpp"

using namespace rlloop;
namespace fs = std::filesystem;

namespace {
fs::path temp_dir(const std::string& name) {
  auto d = fs::temp_directory_path() / ("rlloop-ckpt-test-" + name + "-" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

pid_t spawn(std::vector<std::string> args) {
  pid_t pid = ::fork();
  if (pid == 0) {
    std::vector<char*> argv;
    std::string exe = RLLOOP_CHECKPOINT_CHILD;
    argv.push_back(exe.data());
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(exe.c_str(), argv.data());
    ::_exit(127);
  }
  return pid;
}

int run_child(std::vector<std::string> args) {
  int status = 0;
  ::waitpid(spawn(std::move(args)), &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

void expect_same_tensors(const engine::TensorMap& a, const engine::TensorMap& b) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, t] : a) {
    ASSERT_TRUE(b.count(name)) << name;
    EXPECT_TRUE(torch::equal(t, b.at(name))) << name << " differs";
  }
}
}  // namespace

TEST(Checkpoint, ResumeInANewProcessIsBitIdentical) {
  auto dir = temp_dir("resume");
  ASSERT_EQ(run_child({"run", dir.string(), "6", "3"}), 0);
  ASSERT_EQ(run_child({"resume", dir.string(), "6", "3"}), 0);
  auto straight = engine::read_state_dir((dir / "final").string(), true);
  auto resumed = engine::read_state_dir((dir / "resumed").string(), true);
  expect_same_tensors(straight.weights, resumed.weights);
  expect_same_tensors(straight.optimizer, resumed.optimizer);
  EXPECT_EQ(straight.meta.step, 6);
  EXPECT_EQ(resumed.meta.step, 6);
  EXPECT_EQ(straight.meta.rng_state, resumed.meta.rng_state);
  // And the run really trained: the weights moved away from the step-3 checkpoint.
  auto mid = engine::read_state_dir((dir / "at-3").string(), true);
  bool any_changed = false;
  for (const auto& [name, t] : mid.weights) any_changed = any_changed || !torch::equal(t, straight.weights.at(name));
  EXPECT_TRUE(any_changed);
}

TEST(Checkpoint, KillDuringSavesNeverLeavesATornCheckpoint) {
  auto dir = temp_dir("kill");
  const fs::path latest = dir / "latest";  // the child saves every step under this one name
  // Every save swaps a new directory in, so a new inode at `latest` is the event "a save completed".
  auto inode_of = [](const fs::path& p) -> std::optional<ino_t> {
    struct stat st {};
    if (::stat(p.c_str(), &st) != 0) return std::nullopt;
    return st.st_ino;
  };
  std::mt19937 rng(1234);
  std::uniform_int_distribution<int> delay_ms(0, 400);
  for (int round = 0; round < 6; ++round) {
    const auto before = inode_of(latest);  // the previous round's checkpoint, replaced by this child's saves
    pid_t pid = spawn({"forever", dir.string()});
    // Wait for this child's first completed save (polling, bounded only so that a hang fails), then kill it at
    // a random point of the steps and saves after it.
    bool saved = false;
    for (int i = 0; i < 12000 && !saved; ++i) {
      const auto now = inode_of(latest);
      saved = now && now != before;
      if (!saved) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (saved) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms(rng)));
    ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);
    ASSERT_TRUE(saved) << "round " << round << ": the child never completed a save";
    ASSERT_TRUE(WIFSIGNALED(status));
    // Killed at any point, the name holds a complete checkpoint (the last one saved), which a fresh session loads.
    auto state = engine::read_state_dir(latest.string(), true);
    EXPECT_GE(state.meta.step, 1);
    LocalService svc(test_util::service_in((dir / "scratch").string()));
    auto tc = ServiceClient<LocalService>(svc).create_lora_training_client("rlloop-tiny",
                                                                           {.rank = 4, .alpha = 8, .seed = 11});
    EXPECT_NO_THROW(tc.load_state(latest.string(), true).get());
    EXPECT_EQ(tc.get_info().step, state.meta.step);
  }
}

// state.json as sessions have written it since the format's first version, key for key: the codec reads it (and
// writes the LoRA target modules under the wire's key, targetModules).
TEST(Checkpoint, SaveStateKeepsTheGradientsAccumulatedSinceTheLastStep) {
  // Two passes, a save, a third pass and a step; a session resumed from the save runs the third pass and the step:
  // the same sums in the same order, so the same weights bit for bit.
  auto dir = temp_dir("gradients");
  LocalService svc(test_util::service_in(dir.string()));
  const SessionOptions opts = test_util::tiny(LoraOptions{4, 8, {"all-linear"}}, 3);
  const std::vector<Datum> a{test_util::sft_datum("the cat sat")}, b{test_util::sft_datum("on the mat")},
      c{test_util::sft_datum("and slept")};
  AdamParams adam;
  adam.learning_rate = 1e-2;
  auto s = svc.create_session(opts);
  EXPECT_FALSE(fs::exists(fs::path(s->save_state("fresh").get().path) / "gradients.safetensors"));
  s->forward_backward(a, LossSpec{}).get();
  s->forward_backward(b, LossSpec{}).get();
  const std::string mid = s->save_state("mid").get().path;
  s->forward_backward(c, LossSpec{}).get();
  s->optim_step(adam).get();
  const auto straight = engine::read_state_dir(s->save_state("straight").get().path, true);
  EXPECT_TRUE(straight.gradients.empty()) << "the step consumed them";

  const auto saved = engine::read_state_dir(mid, true);
  EXPECT_TRUE(saved.meta.has_gradients);
  ASSERT_EQ(saved.gradients.size(), saved.weights.size());  // every adapter matrix had a gradient
  auto resumed = svc.create_session_from_state(mid, opts);
  resumed->forward_backward(c, LossSpec{}).get();
  resumed->optim_step(adam).get();
  expect_same_tensors(engine::read_state_dir(resumed->save_state("resumed").get().path, true).weights,
                      straight.weights);
  // Loaded into a session with other gradients pending: the saved ones replace them.
  resumed->forward_backward(a, LossSpec{}).get();
  resumed->load_state(mid, true).get();
  resumed->forward_backward(c, LossSpec{}).get();
  resumed->optim_step(adam).get();
  expect_same_tensors(engine::read_state_dir(resumed->save_state("again").get().path, true).weights,
                      straight.weights);
  // Weights only: no gradients carried.
  resumed->load_state(mid, false).get();
  EXPECT_FALSE(fs::exists(fs::path(resumed->save_state("weights-only").get().path) / "gradients.safetensors"));
}

TEST(CheckpointMeta, ReadsTheStateJsonSessionsWrite) {
  const auto lora = nlohmann::json::parse(R"({
    "format": "rlloop-state-v1", "base_model": "rlloop-tiny",
    "lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "lm_head"]},
    "value_head": true, "seed": 11, "step": 3, "for_sampler": false, "rng_state": [1, 2, 255],
    "has_optimizer": true, "has_gradients": true})");
  const engine::CheckpointMeta m = engine::checkpoint_meta_from_json(lora, "ckpt");
  EXPECT_EQ(m.base_model, "rlloop-tiny");
  EXPECT_EQ(m.lora, (LoraOptions{4, 8, {"q_proj", "lm_head"}}));
  EXPECT_TRUE(m.value_head);
  EXPECT_EQ(m.seed, 11);
  EXPECT_EQ(m.step, 3);
  EXPECT_EQ(m.rng_state, (std::vector<std::uint8_t>{1, 2, 255}));
  EXPECT_TRUE(m.has_optimizer);
  EXPECT_TRUE(m.has_gradients);
  // Full fine-tuning, saved for sampling, without the value_head key.
  const auto full = nlohmann::json::parse(R"({
    "format": "rlloop-state-v1", "base_model": "/models/x", "lora": null, "seed": 0, "step": 0,
    "for_sampler": true, "rng_state": [], "has_optimizer": false})");
  const engine::CheckpointMeta f = engine::checkpoint_meta_from_json(full, "ckpt");
  EXPECT_EQ(f.lora, std::nullopt);
  EXPECT_FALSE(f.value_head);
  EXPECT_FALSE(f.has_optimizer);
  EXPECT_FALSE(f.has_gradients);  // saved before checkpoints kept gradients
  // What the writer produces is what the reader returns, and keeps every key above.
  EXPECT_EQ(engine::checkpoint_meta_from_json(engine::checkpoint_meta_to_json(m), "ckpt"), m);
  auto written = lora;
  written["lora"].erase("target_modules");
  written["lora"]["targetModules"] = {"q_proj", "lm_head"};
  EXPECT_EQ(engine::checkpoint_meta_to_json(m), written);
}

TEST(CheckpointMeta, NamesTheCheckpointAndTheKeyItCannotRead) {
  auto message_of = [](const nlohmann::json& j) {
    return test_util::error_of([&] { engine::checkpoint_meta_from_json(j, "/runs/a"); });
  };
  EXPECT_NE(message_of({{"format", "other"}}).find("'/runs/a' is not an rlloop checkpoint"), std::string::npos);
  auto j = engine::checkpoint_meta_to_json({.base_model = "rlloop-tiny"});
  j.erase("step");
  EXPECT_NE(message_of(j).find("checkpoint '/runs/a': state.json lacks \"step\""), std::string::npos) << message_of(j);
  j = engine::checkpoint_meta_to_json({.base_model = "rlloop-tiny"});
  j["lora"] = {{"rank", "four"}};
  EXPECT_NE(message_of(j).find("state.json's \"lora\" is malformed"), std::string::npos) << message_of(j);
}
