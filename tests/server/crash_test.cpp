// Durability: train through `rlloop serve`, kill -9 it at random points five times and restart it on the same
// --data-dir while the client keeps going (retrying with the same clientTokens). The final adapter weights must
// equal those of an uninterrupted run bit for bit, and every step must have run exactly once. The journal is
// compacted every few records, so kills also land in and between compactions.
#include <gtest/gtest.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <sstream>

#include <nlohmann/json.hpp>
#include <rlloop/remote.hpp>

#include "child_processes.hpp"
#include "server_process.hpp"

using namespace rlloop;
namespace fs = std::filesystem;

namespace {

constexpr int kSteps = 30;

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

Datum sft_datum(const std::string& text) {
  std::vector<token_id> t(text.begin(), text.end());
  Datum d;
  d.model_input = ModelInput::from_tokens({t.begin(), t.end() - 1});
  d.loss_fn_inputs["target_tokens"] = TensorData::from_tokens(std::vector<token_id>(t.begin() + 1, t.end()));
  d.loss_fn_inputs["weights"] = TensorData::from_floats(std::vector<float>(t.size() - 1, 1.0f));
  return d;
}

// The checkpoint directory the server recorded for a model-package ARN: in its snapshot or a log since.
fs::path checkpoint_path(const fs::path& data_dir, const std::string& arn) {
  for (const auto& entry : fs::directory_iterator(data_dir)) {
    const std::string name = entry.path().filename().string();
    if (name != "snapshot.jsonl" && !(name.starts_with("journal-") && name.ends_with(".jsonl"))) continue;
    std::ifstream in(entry.path());
    for (std::string line; std::getline(in, line);) {
      auto j = nlohmann::json::parse(line, nullptr, false);
      if (j.is_object() && j.value("t", "") == "checkpoint" && j.value("arn", "") == arn)
        return j["path"].get<std::string>();
    }
  }
  return {};
}

// How many compactions a server's log reports.
int compactions(const std::string& log) {
  int n = 0;
  for (std::size_t at = log.find("\"event\":\"compacted\""); at != std::string::npos;
       at = log.find("\"event\":\"compacted\"", at + 1))
    ++n;
  return n;
}

struct RunResult {
  std::string arn;
  std::vector<double> losses;
  std::int64_t steps = 0;
};

// The training loop of both runs: kSteps of forward_backward + optim_step, then save the adapter for sampling.
// on_step(i) runs after step i was reported (the crash run's killer uses it to pick its moments).
// A client of the test's server that keeps retrying through its restarts (a restart takes a second or two).
RemoteOptions client_of(std::uint16_t port, int max_retries) {
  RemoteOptions o;
  o.endpoint = "http://127.0.0.1:" + std::to_string(port);
  o.bearer_key = "crash-key";
  o.max_retries = max_retries;
  o.backoff_base = std::chrono::milliseconds(5);
  o.poll_max = std::chrono::milliseconds(20);
  return o;
}

RunResult train(std::uint16_t port, const std::function<void(int)>& on_step) {
  RemoteService service(client_of(port, 200));
  SessionOptions opts;
  opts.base_model = "rlloop-tiny";
  opts.lora = LoraOptions{4, 8, {"all-linear"}};
  opts.name = "crash";
  auto s = service.create_session(opts);
  const std::vector<std::string> texts = {"the cat sat on the mat", "hello world, hello", "2+2=4 and 3+3=6",
                                          "abcabcabcabc"};
  AdamParams adam;
  adam.learning_rate = 5e-3;
  RunResult run;
  for (int i = 0; i < kSteps; ++i) {
    auto fb = s->forward_backward({sft_datum(texts[i % texts.size()]), sft_datum(texts[(i + 1) % texts.size()])},
                                  LossSpec::cross_entropy());
    auto step = s->optim_step(adam);
    run.losses.push_back(fb.get().metrics.at("loss:sum"));
    run.steps = static_cast<std::int64_t>(step.get().metrics.at("step"));
    on_step(i);
  }
  run.arn = s->save_weights_for_sampler("final").get().path;
  return run;
}

struct Dirs {
  fs::path root;
  Dirs() : root(fs::temp_directory_path() / ("rlloop-crash-" + std::to_string(::getpid()))) {
    fs::remove_all(root);
    fs::create_directories(root);
    std::ofstream(root / "tenants.json") << R"({"tenants": [{"id": "crash", "bearerKeys": ["crash-key"]}]})";
  }
  ~Dirs() {
    if (!::testing::Test::HasFailure()) fs::remove_all(root);
  }
  std::vector<std::string> args(const std::string& data) const {
    return {"--tenants",
            (root / "tenants.json").string(),
            "--port",
            "0",
            "--data-dir",
            (root / data).string(),
            "--device",
            "cpu",
            "--threads",
            "1",
            "--compact-records",
            "6"};
  }
};

}  // namespace

// The "replayed" count of the last {"event":"recovered"} line of a server's log; -1 when there is none.
long long last_replayed(const std::string& log) {
  const auto line = log.rfind("\"event\":\"recovered\"");
  if (line == std::string::npos) return -1;
  const auto key = log.find("\"replayed\":", line);
  return key == std::string::npos ? -1 : std::stoll(log.substr(key + 11));
}

// Gradients accumulated over many forwardBackward operations without a step: a restart loads the last autosave
// (which holds them) and runs again only what completed after it, fewer than --autosave-operations, whatever the
// history; the next optimizerStep then gives the uninterrupted run's weights, bit for bit.
TEST(CrashRecovery, ARestartAfterAThousandForwardBackwardsRunsAtMostTheAutosaveIntervalAgain) {
  constexpr int kPasses = 1000, kInterval = 16;
  Dirs dirs;
  auto args = [&](const std::string& data) {
    auto a = dirs.args(data);
    a.insert(a.end(), {"--autosave-operations", std::to_string(kInterval)});
    return a;
  };
  SessionOptions opts;
  opts.base_model = "rlloop-tiny";
  opts.lora = LoraOptions{4, 8, {"all-linear"}};
  opts.name = "accumulate";
  const std::vector<std::string> texts = {"the cat sat on the mat", "hello world, hello", "2+2=4 and 3+3=6"};
  auto accumulate = [&](RemoteSession& s) {
    for (int i = 0; i < kPasses; ++i)
      s.forward_backward({sft_datum(texts[i % texts.size()])}, LossSpec::cross_entropy()).get();
  };
  auto step_and_save = [&](RemoteSession& s) {
    AdamParams adam;
    adam.learning_rate = 1e-3;
    s.optim_step(adam).get();
    return s.save_weights_for_sampler("after").get().path;
  };

  test_server::ServeProcess ref(RLLOOP_BIN, args("ref"), (dirs.root / "ref.log").string());
  ref.start();
  const auto ref_port = ref.wait_listening();
  ASSERT_TRUE(ref_port) << read_file(dirs.root / "ref.log");
  std::string expected;
  {
    RemoteService service(client_of(*ref_port, 20));
    auto s = service.create_session(opts);
    accumulate(*s);
    expected = step_and_save(*s);
  }
  ref.kill(SIGTERM);

  test_server::ServeProcess server(RLLOOP_BIN, args("crash"), (dirs.root / "crash.log").string());
  server.start();
  const auto port = server.wait_listening();
  ASSERT_TRUE(port) << read_file(dirs.root / "crash.log");
  server.reuse_port(*port);
  RemoteService service(client_of(*port, 200));
  auto s = service.create_session(opts);
  accumulate(*s);
  server.kill(SIGKILL);  // every pass acknowledged, no step taken
  server.start();
  ASSERT_TRUE(server.wait_listening()) << read_file(dirs.root / "crash.log");
  // Autosaves after passes 16, 32, ..., 992: the restart ran the last 8 again.
  EXPECT_EQ(last_replayed(read_file(dirs.root / "crash.log")), kPasses % kInterval);
  const std::string got = step_and_save(*s);

  const fs::path a = checkpoint_path(dirs.root / "ref", expected), b = checkpoint_path(dirs.root / "crash", got);
  ASSERT_FALSE(a.empty());
  ASSERT_FALSE(b.empty());
  const std::string wa = read_file(a / "weights.safetensors"), wb = read_file(b / "weights.safetensors");
  ASSERT_GT(wa.size(), 1000u);
  EXPECT_TRUE(wa == wb) << "the adapter after the step differs from the uninterrupted run's";
  server.kill(SIGTERM);
}

TEST(CrashRecovery, KillNineFiveTimesGivesTheUninterruptedWeights) {
  Dirs dirs;
  // Uninterrupted reference.
  test_server::ServeProcess ref(RLLOOP_BIN, dirs.args("ref"), (dirs.root / "ref.log").string());
  ref.start();
  const std::optional<std::uint16_t> ref_port = ref.wait_listening();
  ASSERT_TRUE(ref_port) << read_file(dirs.root / "ref.log");
  const RunResult expected = train(*ref_port, [](int) {});
  ref.kill(SIGTERM);

  // The same loop, with the server killed at five random moments.
  auto server =
      std::make_unique<test_server::ServeProcess>(RLLOOP_BIN, dirs.args("crash"), (dirs.root / "crash.log").string());
  server->start();
  const std::optional<std::uint16_t> port = server->wait_listening();
  ASSERT_TRUE(port) << read_file(dirs.root / "crash.log");
  // Restarts reuse this port: the client keeps its endpoint. A test beside this one could bind it between a kill
  // and the restart's bind (the restart's startup); with kernel-picked ports that is rare enough to accept, and
  // crash.log would show the failed bind.
  server->reuse_port(*port);
  std::mt19937 rng(std::random_device{}());
  std::vector<int> kill_after;  // steps after which a kill is armed, spread over the run
  for (int k = 0; k < 5; ++k) kill_after.push_back(2 + k * (kSteps - 4) / 5 + static_cast<int>(rng() % 3));
  std::atomic<int> reported{-1};
  std::atomic<int> kills{0};
  std::atomic<bool> done{false};
  std::thread killer([&] {
    for (int at : kill_after) {
      while (reported.load() < at && !done) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      if (done) return;
      // Somewhere inside the next operations: between accept and run, mid-step, mid-autosave, before the reply.
      std::this_thread::sleep_for(std::chrono::microseconds(rng() % 30000));
      server->kill(SIGKILL);
      ++kills;
      server->start();  // not waiting: the client retries until the recovered server listens
    }
  });
  RunResult got;
  try {
    got = train(*port, [&](int i) { reported = i; });
  } catch (const std::exception& e) {
    done = true;
    killer.join();
    FAIL() << "client failed after " << kills << " kills: " << e.what() << "\n" << read_file(dirs.root / "crash.log");
  }
  done = true;
  killer.join();
  EXPECT_EQ(kills.load(), 5);
  EXPECT_GE(compactions(read_file(dirs.root / "crash.log")), 3) << "the journal was compacted during the run";
  EXPECT_EQ(got.steps, kSteps) << "every optimizer step ran exactly once";
  ASSERT_EQ(got.losses.size(), expected.losses.size());
  for (std::size_t i = 0; i < got.losses.size(); ++i) EXPECT_EQ(got.losses[i], expected.losses[i]) << "step " << i;

  const fs::path a = checkpoint_path(dirs.root / "ref", expected.arn),
                 b = checkpoint_path(dirs.root / "crash", got.arn);
  ASSERT_FALSE(a.empty());
  ASSERT_FALSE(b.empty());
  const std::string wa = read_file(a / "weights.safetensors"), wb = read_file(b / "weights.safetensors");
  ASSERT_GT(wa.size(), 1000u);
  EXPECT_TRUE(wa == wb) << "final adapter weights differ from the uninterrupted run";
  server->kill(SIGTERM);
}

namespace {

constexpr int kDataParallelSteps = 8;

struct DataParallelRun {
  std::string arn;
  std::vector<double> losses;
  std::vector<std::vector<token_id>> samples;  // a seeded request's, after training (half of them rank 1's)
  std::vector<std::string> errors;             // of operations that failed and were retried
};

// SFT on a two-rank server; before_step(i) runs before step i's forward_backward is waited for. An operation
// that fails is retried (the server restarts itself after a group failure; the client retries through it).
DataParallelRun train_data_parallel(std::uint16_t port, const std::function<void(int)>& before_step) {
  RemoteService service(client_of(port, 400));  // a group restart also forms the new group
  SessionOptions opts;
  opts.base_model = "rlloop-tiny";
  opts.lora = LoraOptions{4, 8, {"all-linear"}};
  opts.name = "dp";
  auto s = service.create_session(opts);
  const std::vector<Datum> batch = {sft_datum("the cat sat on the mat"), sft_datum("hello world, hello"),
                                    sft_datum("2+2=4 and 3+3=6"), sft_datum("abcabcabcabc")};
  DataParallelRun run;
  auto retried = [&](const std::function<void()>& op) {
    for (int attempt = 0;; ++attempt) {
      try {
        op();
        return;
      } catch (const rlloop::error& e) {
        run.errors.push_back(e.what());
        if (attempt >= 50) throw;
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
    }
  };
  for (int i = 0; i < kDataParallelSteps; ++i) {
    bool first = true;
    retried([&] {
      auto fb = s->forward_backward(batch, LossSpec::cross_entropy());
      if (first) before_step(i);
      first = false;
      run.losses.push_back(fb.get().metrics.at("loss:sum"));
    });
    retried([&] { s->optim_step(AdamParams{.learning_rate = 5e-3}).get(); });
  }
  run.arn = s->save_weights_for_sampler("final").get().path;
  SampleRequest req;
  req.prompt = ModelInput::from_tokens({'t', 'h', 'e', ' '});
  req.num_samples = 4;
  req.params.max_tokens = 8;
  req.params.seed = 11;
  retried([&] {
    const SampleResponse out = s->sample(req).get();  // a copy: the future's state dies with it
    for (const auto& seq : out.sequences) run.samples.push_back(seq.tokens);
  });
  return run;
}

// `sharded`: the group's sessions are fully sharded (--shard full: each rank holds half of the LoRA sessions' base).
void expect_a_killed_rank_recovered(bool sharded) {
  Dirs dirs;
  auto args = [&](const std::string& data) {
    auto a = dirs.args(data);
    a.insert(a.end(), {"--world-size", "2", "--dp-timeout-s", "10"});
    if (sharded) a.insert(a.end(), {"--shard", "full"});
    return a;
  };
  test_server::ServeProcess ref(RLLOOP_BIN, args("dp-ref"), (dirs.root / "dp-ref.log").string());
  ref.start();
  const auto ref_port = ref.wait_listening();
  ASSERT_TRUE(ref_port) << read_file(dirs.root / "dp-ref.log");
  const DataParallelRun expected = train_data_parallel(*ref_port, [](int) {});
  ref.kill(SIGTERM);
  EXPECT_TRUE(expected.errors.empty());

  const fs::path log = dirs.root / "dp-fault.log";
  test_server::ServeProcess server(RLLOOP_BIN, args("dp-fault"), log.string());
  server.start();
  const auto port = server.wait_listening();
  ASSERT_TRUE(port) << read_file(log);
  int killed = 0;
  const DataParallelRun got = train_data_parallel(*port, [&](int step) {
    if (step != 3) return;
    const auto workers = test_util::child_processes(server.pid(), "worker");
    ASSERT_EQ(workers.size(), 1u) << read_file(log);
    kill(workers[0], SIGKILL);  // while step 3's forward_backward is on its way or running
    ++killed;
  });
  EXPECT_EQ(killed, 1);
  for (const auto& e : got.errors) std::printf("retried after: %s\n", e.c_str());
  ASSERT_FALSE(got.errors.empty()) << "the operation the kill met failed";
  EXPECT_NE(got.errors.front().find("rank 1 stopped answering"), std::string::npos) << got.errors.front();
  EXPECT_NE(read_file(log).find("\"event\":\"data_parallel_restart\""), std::string::npos) << read_file(log);
  // Every retried step counted once: the losses and the final weights are those of the uninterrupted run.
  ASSERT_EQ(got.losses.size(), expected.losses.size());
  for (std::size_t i = 0; i < got.losses.size(); ++i) EXPECT_EQ(got.losses[i], expected.losses[i]) << "step " << i;
  const fs::path a = checkpoint_path(dirs.root / "dp-ref", expected.arn),
                 b = checkpoint_path(dirs.root / "dp-fault", got.arn);
  ASSERT_FALSE(a.empty());
  ASSERT_FALSE(b.empty());
  EXPECT_TRUE(read_file(a / "weights.safetensors") == read_file(b / "weights.safetensors"))
      << "final adapter weights differ from the uninterrupted run";
  // And the recovered group samples what the uninterrupted one did, each rank its share.
  EXPECT_EQ(got.samples, expected.samples);
  EXPECT_EQ(got.samples.size(), 4u);
  server.kill(SIGTERM);
}

}  // namespace

TEST(CrashRecovery, AKilledDataParallelRankFailsOneOperationAndTheServerComesBackWhole) {
  expect_a_killed_rank_recovered(false);
}
TEST(CrashRecovery, AKilledRankOfAFullyShardedGroupFailsOneOperationAndTheServerComesBackWhole) {
  expect_a_killed_rank_recovered(true);
}
