// Load: 32 concurrent clients on loopback against `rlloop serve` (a child process with a temp
// data dir) hosting real LocalSessions on rlloop-tiny, each with its own session, mixing sampling and training
// (half start with each). Two identical waves; every call must succeed with sane values, and the server's resident
// memory (read from /proc/<pid>/status) must stay bounded: the second wave may not grow it by more than a small
// allowance, so per-request leaks show.
#include <gtest/gtest.h>

#include <unistd.h>

#include <atomic>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>

#include <rlloop/remote.hpp>

#include "server_process.hpp"

using namespace rlloop;
namespace fs = std::filesystem;

namespace {

constexpr int kClients = 32;
constexpr int kRounds = 4;  // per wave: sample, train, sample, train (or the other way round)

// The VmRSS of a process in KiB, 0 if it cannot be read.
long rss_kib(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6));
  return 0;
}

// `rlloop serve` as a child process, as a user runs it: its own data dir (journal, per-step durable checkpoints)
// and its own /proc/<pid> for the RSS, apart from the clients.
struct Serve {
  fs::path root = fs::temp_directory_path() / ("rlloop-load-" + std::to_string(::getpid()));
  std::unique_ptr<test_server::ServeProcess> process;
  Serve() {
    fs::remove_all(root);
    fs::create_directories(root);
    std::ofstream(root / "tenants.json")
        << R"({"tenants": [{"id": "load", "accountId": "111122223333", "bearerKeys": ["load-key"], "maxSessions": 40}]})";
    process = std::make_unique<test_server::ServeProcess>(
        RLLOOP_BIN,
        std::vector<std::string>{"--tenants", (root / "tenants.json").string(), "--port", "0", "--data-dir",
                                 (root / "data").string(), "--device", "cpu", "--threads", "1"},
        (root / "serve.log").string());
    process->start();
  }
  ~Serve() {
    process.reset();  // SIGKILL: everything it acknowledged is already durable
    if (!::testing::Test::HasFailure()) fs::remove_all(root);
  }
};

Datum sft_datum(const std::string& text) {
  std::vector<token_id> t(text.begin(), text.end());
  Datum d;
  d.model_input = ModelInput::from_tokens({t.begin(), t.end() - 1});
  d.loss_fn_inputs["target_tokens"] = TensorData::from_tokens(std::vector<token_id>(t.begin() + 1, t.end()));
  d.loss_fn_inputs["weights"] = TensorData::from_floats(std::vector<float>(t.size() - 1, 1.0f));
  return d;
}

struct Tally {
  std::atomic<int> samples{0}, steps{0}, errors{0};
  std::mutex mu;
  std::vector<std::string> messages;
  void fail(const std::string& m) {
    ++errors;
    std::lock_guard lock(mu);
    if (messages.size() < 10) messages.push_back(m);
  }
};

// One wave for one client: kRounds rounds alternating sample (4 x 8 tokens) and train (forward_backward + step).
void client_wave(RemoteSession& s, int client, Tally& tally) {
  for (int round = 0; round < kRounds; ++round) {
    try {
      if ((round + client) % 2 == 0) {
        SampleRequest r{ModelInput::from_tokens({'a' + client % 26, 'b', 'c'}), 4,
                        SamplingParams{.max_tokens = 8, .seed = client}};
        const SampleResponse out = s.sample(r).get();
        if (out.sequences.size() != 4)
          tally.fail("client " + std::to_string(client) + ": " + std::to_string(out.sequences.size()) + " sequences");
        for (const auto& seq : out.sequences)
          if (seq.tokens.size() > 8 || seq.logprobs.size() != seq.tokens.size())
            tally.fail("client " + std::to_string(client) + ": bad sequence length");
        ++tally.samples;
      } else {
        auto fb = s.forward_backward({sft_datum("client " + std::to_string(client) + " says hello")},
                                     LossSpec::cross_entropy());
        auto step = s.optim_step(AdamParams{.learning_rate = 1e-3});
        const double loss = fb.get().metrics.at("loss:sum");
        if (!std::isfinite(loss) || loss <= 0)
          tally.fail("client " + std::to_string(client) + ": loss " + std::to_string(loss));
        step.get();
        ++tally.steps;
      }
    } catch (const std::exception& e) {
      tally.fail("client " + std::to_string(client) + ": " + e.what());
    }
  }
}

}  // namespace

TEST(Load, ThirtyTwoClientsMixingSamplingAndTrainingWithBoundedMemory) {
  Serve serve;
  const std::optional<std::uint16_t> port = serve.process->wait_listening(std::chrono::seconds(120));
  ASSERT_TRUE(port) << "rlloop serve did not start; see " << (serve.root / "serve.log");
  const pid_t pid = serve.process->pid();
  const long rss_start = rss_kib(pid);

  RemoteOptions o;
  o.endpoint = "http://127.0.0.1:" + std::to_string(*port);
  o.bearer_key = "load-key";
  o.poll_max = std::chrono::milliseconds(20);
  o.operation_timeout = std::chrono::seconds(120);

  // Each client its own service (connection pool) and session.
  std::vector<std::shared_ptr<RemoteSession>> sessions(kClients);
  std::vector<std::unique_ptr<RemoteService>> services;
  for (int c = 0; c < kClients; ++c) services.push_back(std::make_unique<RemoteService>(o));
  Tally tally;
  auto run_all = [&](auto&& body) {
    std::vector<std::thread> threads;
    for (int c = 0; c < kClients; ++c) threads.emplace_back([&, c] { body(c); });
    for (auto& t : threads) t.join();
  };
  run_all([&](int c) {
    try {
      sessions[c] = services[c]->create_session(
          SessionOptions{"rlloop-tiny", LoraOptions{4, 8, {"all-linear"}}, 0, "load-" + std::to_string(c)});
    } catch (const std::exception& e) {
      tally.fail("create " + std::to_string(c) + ": " + e.what());
    }
  });
  ASSERT_EQ(tally.errors, 0) << tally.messages.front();

  run_all([&](int c) { client_wave(*sessions[c], c, tally); });
  const long rss_wave1 = rss_kib(pid);
  run_all([&](int c) { client_wave(*sessions[c], c, tally); });
  const long rss_wave2 = rss_kib(pid);

  EXPECT_EQ(tally.errors, 0) << (tally.messages.empty() ? "" : tally.messages.front());
  EXPECT_EQ(tally.samples + tally.steps, 2 * kClients * kRounds);
  EXPECT_EQ(tally.steps, kClients * kRounds);  // half the rounds of every client train
  // Every session trained 2 waves x kRounds/2 steps, and the server billed its sample calls.
  for (int c = 0; c < kClients; c += 7) {
    EXPECT_EQ(sessions[c]->info().step, kRounds);
    const auto billed = sessions[c]->usage().sample;  // decode tokens: at most 8 per sequence (EOS may end one early)
    EXPECT_GT(billed, 0);
    EXPECT_LE(billed, 2 * (kRounds / 2) * 4 * 8);
  }

  std::printf(
      "server RSS: %.1f MiB at start, %.1f MiB after wave 1, %.1f MiB after wave 2 (%d clients, %d calls each wave)\n",
      rss_start / 1024.0, rss_wave1 / 1024.0, rss_wave2 / 1024.0, kClients, kClients * kRounds);
  ASSERT_GT(rss_start, 0);
  // 32 live rlloop-tiny sessions are a few MiB each; the whole server stays well under 1 GiB, and the second,
  // identical wave adds at most 64 MiB (operation records are kept, but they are small).
  EXPECT_LT(rss_wave2, 1024 * 1024);
  EXPECT_LT(rss_wave2 - rss_wave1, 64 * 1024);

  for (auto& s : sessions)
    if (s) s->stop();
  sessions.clear();
  services.clear();
}
