// Checkpoints across processes: resume is bit-identical; kill -9 during saves never leaves a torn checkpoint.
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

#include "checkpoint.hpp"
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
  EXPECT_EQ(straight.meta.at("step"), 6);
  EXPECT_EQ(resumed.meta.at("step"), 6);
  EXPECT_EQ(straight.meta.at("rng_state"), resumed.meta.at("rng_state"));
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
    EXPECT_GE(state.meta.at("step").get<int>(), 1);
    LocalService svc(test_util::service_in((dir / "scratch").string()));
    auto tc = ServiceClient<LocalService>(svc).create_lora_training_client("rlloop-tiny",
                                                                           {.rank = 4, .alpha = 8, .seed = 11});
    EXPECT_NO_THROW(tc.load_state(latest.string(), true).get());
    EXPECT_EQ(tc.get_info().step, state.meta.at("step").get<int>());
  }
}
