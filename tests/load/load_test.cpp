// Load (issue 5, item 7): 32 concurrent clients on loopback against rlloop-server hosting real LocalSessions on
// rlloop-tiny, each with its own session, mixing sampling and training (half start with each). Two identical
// waves; every call must succeed with sane values, and the server's resident memory (read from /proc/<pid>/status)
// must stay bounded: the second wave may not grow it by more than a small allowance, so per-request leaks show.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>

#include <rlloop/local.hpp>
#include <rlloop/remote.hpp>

#include "server/server.hpp"

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

// rlloop-server hosting LocalService in a forked child (its own /proc/<pid> for the RSS, apart from the clients).
// Not `rlloop serve`: with a --data-dir, the per-session autosaves of 32 sessions race on the shared
// <checkpoints>/LATEST temp file (src/engine atomic_write names it by pid only), failing ~15% of the operations.
struct Serve {
  pid_t pid = -1;
  explicit Serve(std::uint16_t port) {
    pid = ::fork();
    if (pid == 0) {
      server::Options opts;
      opts.port = port;
      opts.tenants = {server::Tenant{"load", "111122223333", {}, {"load-key"}, 40, 1 << 24}};
      opts.log = [](const std::string&) {};
      LocalServiceOptions lo;
      lo.device = "cpu";
      lo.num_threads = 1;
      lo.checkpoint_dir = (fs::temp_directory_path() / ("rlloop-load-" + std::to_string(::getpid()))).string();
      {
        server::Server srv(opts, server::make_backend(std::make_shared<LocalService>(lo)));
        srv.start();
        while (::getppid() != 1) std::this_thread::sleep_for(std::chrono::milliseconds(100));  // until the parent goes
      }
      ::_exit(0);
    }
  }
  ~Serve() {
    if (pid <= 0) return;
    ::kill(pid, SIGKILL);  // nothing durable to flush
    int status = 0;
    ::waitpid(pid, &status, 0);
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
        SampleRequest r{ModelInput::from_tokens({'a' + client % 26, 'b', 'c'}), 4, SamplingParams{.max_tokens = 8, .seed = client}};
        const SampleResponse out = s.sample(r).get();
        if (out.sequences.size() != 4) tally.fail("client " + std::to_string(client) + ": " + std::to_string(out.sequences.size()) + " sequences");
        for (const auto& seq : out.sequences)
          if (seq.tokens.size() > 8 || seq.logprobs.size() != seq.tokens.size()) tally.fail("client " + std::to_string(client) + ": bad sequence length");
        ++tally.samples;
      } else {
        auto fb = s.forward_backward({sft_datum("client " + std::to_string(client) + " says hello")}, LossSpec::cross_entropy());
        auto step = s.optim_step(AdamParams{.learning_rate = 1e-3});
        const double loss = fb.get().metrics.at("loss:sum");
        if (!std::isfinite(loss) || loss <= 0) tally.fail("client " + std::to_string(client) + ": loss " + std::to_string(loss));
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
  const std::uint16_t port = test_server::free_port();
  Serve serve(port);
  ASSERT_GT(serve.pid, 0);
  for (int i = 0; i < 600 && !test_server::accepts(port); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  ASSERT_TRUE(test_server::accepts(port)) << "the server did not start";
  const long rss_start = rss_kib(serve.pid);

  RemoteOptions o;
  o.endpoint = "http://127.0.0.1:" + std::to_string(port);
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
      sessions[c] = services[c]->create_session(SessionOptions{"rlloop-tiny", LoraOptions{4, 8, {"all-linear"}}, 0, "load-" + std::to_string(c)});
    } catch (const std::exception& e) {
      tally.fail("create " + std::to_string(c) + ": " + e.what());
    }
  });
  ASSERT_EQ(tally.errors, 0) << tally.messages.front();

  run_all([&](int c) { client_wave(*sessions[c], c, tally); });
  const long rss_wave1 = rss_kib(serve.pid);
  run_all([&](int c) { client_wave(*sessions[c], c, tally); });
  const long rss_wave2 = rss_kib(serve.pid);

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

  std::printf("server RSS: %.1f MiB at start, %.1f MiB after wave 1, %.1f MiB after wave 2 (%d clients, %d calls each wave)\n",
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
  fs::remove_all(fs::temp_directory_path() / ("rlloop-load-" + std::to_string(serve.pid)));
}
