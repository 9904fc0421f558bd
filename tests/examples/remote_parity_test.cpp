// The same loop gives the same numbers on a LocalSession in this process and through RemoteService -> HTTP ->
// `rlloop serve` (a child process on a loopback port), under the same seeds: GRPO (sampled tokens exactly,
// reward / loss / clip fraction / entropy / logprobs within 1e-5), SFT and DPO. Both sides run LibTorch on one
// thread (`--threads 1` / `configure_engine_process({.num_threads = 1})`) so the arithmetic is the same; LoRA
// rank 4 on rlloop-tiny, seed 0 on both sides (the API has no seed field: the server creates every session with
// seed 0).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <rlloop/algorithms/dpo.hpp>
#include <rlloop/algorithms/grpo.hpp>
#include <rlloop/algorithms/sft.hpp>
#include <rlloop/local.hpp>
#include <rlloop/remote.hpp>
#include <rlloop/rlloop.hpp>

#include "../server/server_process.hpp"

using namespace rlloop;
namespace fs = std::filesystem;

namespace {

constexpr double kTol = 1e-5;
const char* const kProbe = "2+3=5 and the cat sat";

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<token_id> bytes(const std::string& s) { return {s.begin(), s.end()}; }

SessionOptions session_options(const std::string& name) {
  SessionOptions o;
  o.base_model = "rlloop-tiny";
  o.lora = LoraOptions{4, 8, {"all-linear"}};
  o.seed = 0;
  o.name = name;
  return o;
}

// Logprobs of a fixed text under the session's current weights: equal weights on both sides after the loop.
template <Session S>
std::vector<double> probe(TrainingClient<S>& client) {
  return client.live_sampling_client().compute_logprobs(ModelInput::from_tokens(bytes(kProbe))).get();
}

void expect_near_all(const std::vector<double>& a, const std::vector<double>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (std::size_t i = 0; i < a.size(); ++i) ASSERT_NEAR(a[i], b[i], kTol) << what << " [" << i << "]";
}

// ---- GRPO -------------------------------------------------------------------------------------------------------

struct Prompt {
  std::string prompt;
};

// Deterministic, and spread out over the random bytes a fresh model writes: the share of bytes below 128.
struct LowBytes {
  double operator()(const Prompt&, std::string_view completion) const {
    if (completion.empty()) return 0.0;
    double low = 0;
    for (unsigned char c : completion) low += c < 128 ? 1.0 : 0.0;
    return low / static_cast<double>(completion.size());
  }
};
static_assert(Reward<LowBytes, Prompt>);

struct GrpoTrace {
  std::vector<algorithms::PolicyGradientStats> stats;
  std::vector<std::vector<std::vector<token_id>>> tokens;  // [step][sequence]
  std::vector<std::vector<double>> logprobs;               // [step] sampler logprobs of every sequence, concatenated
  std::vector<double> probe;
  std::int64_t steps = 0;
};

template <Service Svc>
GrpoTrace run_grpo(ServiceClient<Svc>& service) {
  using S = typename Svc::session_type;
  auto client = service.create_training_client(session_options("grpo-parity"));
  algorithms::GRPO<S> grpo(client, load_tokenizer(client),
                           {.group_size = 4,
                            .sampling = {.max_tokens = 8, .temperature = 1.0, .seed = 11},
                            .loss = LossFn::ppo,
                            .adam = {.learning_rate = 1e-2}});
  const std::vector<std::vector<Prompt>> batches = {
      {{"2+3="}, {"hello "}}, {{"the cat "}, {"7*6="}}, {{"abc"}, {"2+3="}}};
  GrpoTrace t;
  for (const auto& problems : batches) {
    auto pending = grpo.submit(problems);
    t.stats.push_back(grpo.learn(pending, LowBytes{}));
    auto& tokens = t.tokens.emplace_back();
    auto& logprobs = t.logprobs.emplace_back();
    for (const auto& f : pending.samples)
      for (const auto& seq : f.get().sequences) {
        tokens.push_back(seq.tokens);
        logprobs.insert(logprobs.end(), seq.logprobs.begin(), seq.logprobs.end());
      }
  }
  t.probe = probe(client);
  t.steps = client.get_info().step;
  return t;
}

// ---- SFT --------------------------------------------------------------------------------------------------------

struct SftTrace {
  std::vector<algorithms::SftStats> stats;
  std::vector<double> probe;
};

template <Service Svc>
SftTrace run_sft(ServiceClient<Svc>& service) {
  using S = typename Svc::session_type;
  auto client = service.create_training_client(session_options("sft-parity"));
  algorithms::Sft<S> sft(client, {.adam = {.learning_rate = 1e-2, .beta2 = 0.99}});
  const std::vector<std::pair<std::string, std::string>> examples = {
      {"2+3=", "#### 5"}, {"7+8=", "#### 15"}, {"4*6=", "#### 24"}, {"9-2=", "#### 7"}};
  SftTrace t;
  for (int step = 0; step < 4; ++step) {
    std::vector<Datum> batch;
    for (int k = 0; k < 3; ++k) {
      const auto& [p, c] = examples[static_cast<std::size_t>(step + k) % examples.size()];
      batch.push_back(algorithms::completion_datum(bytes(p), bytes(c)));
    }
    t.stats.push_back(sft.step(batch));
  }
  t.probe = probe(client);
  return t;
}

// ---- DPO --------------------------------------------------------------------------------------------------------

struct DpoTrace {
  std::vector<algorithms::DpoStats> stats;
  std::vector<double> probe;
};

template <Service Svc>
DpoTrace run_dpo(ServiceClient<Svc>& service) {
  using S = typename Svc::session_type;
  auto client = service.create_training_client(session_options("dpo-parity"));
  // The reference: the starting weights, saved for sampling (on the server: a model-package ARN).
  auto reference = client.save_weights_and_get_sampling_client("reference");
  algorithms::DPO<S> dpo(client, reference, {.beta = 0.5, .adam = {.learning_rate = 1e-2}});
  const std::vector<algorithms::PreferencePair> pairs = {
      {bytes("2+3="), bytes("#### 5"), bytes("#### 6")},
      {bytes("7+8="), bytes("#### 15"), bytes("fifteen?")},
      {bytes("say hi: "), bytes("hi"), bytes("no thanks")},
  };
  DpoTrace t;
  for (int step = 0; step < 3; ++step) t.stats.push_back(dpo.step(pairs));  // later steps hit the reference cache
  t.probe = probe(client);
  return t;
}

}  // namespace

class RemoteParity : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = fs::temp_directory_path() / ("rlloop-remote-parity-" + std::to_string(::getpid()));
    fs::remove_all(root_);
    fs::create_directories(root_);
    std::ofstream(root_ / "tenants.json")
        << R"({"tenants": [{"id": "parity", "bearerKeys": ["parity-key"], "maxSessions": 16}]})";
    server_ =
        new test_server::ServeProcess(RLLOOP_BIN,
                                      {"--tenants", (root_ / "tenants.json").string(), "--port", "0", "--data-dir",
                                       (root_ / "data").string(), "--device", "cpu", "--threads", "1"},
                                      (root_ / "serve.log").string());
    server_->start();
    port_ = server_->wait_listening();
  }
  static void TearDownTestSuite() {
    server_->kill(SIGTERM);
    delete server_;
    server_ = nullptr;
    if (!::testing::UnitTest::GetInstance()->Failed()) fs::remove_all(root_);
  }
  void SetUp() override { ASSERT_TRUE(port_) << "rlloop serve did not start:\n" << read_file(root_ / "serve.log"); }

  ServiceClient<RemoteService> remote() const {
    RemoteOptions o;
    o.endpoint = "http://127.0.0.1:" + std::to_string(*port_);
    o.bearer_key = "parity-key";
    return ServiceClient<RemoteService>{RemoteService(o)};
  }
  ServiceClient<LocalService> local(const std::string& name) const {
    LocalServiceOptions o;
    o.device = "cpu";
    configure_engine_process({.num_threads = 1});
    o.checkpoint_dir = (root_ / "local" / name).string();
    return ServiceClient<LocalService>{LocalService(o)};
  }

  static inline fs::path root_;
  static inline std::optional<std::uint16_t> port_;  // where this suite's server listens; nullopt if it did not start
  static inline test_server::ServeProcess* server_ = nullptr;
};

TEST_F(RemoteParity, GrpoLoopGivesTheLocalMetricsAndTokens) {
  auto local_service = local("grpo");
  auto remote_service = remote();
  const GrpoTrace l = run_grpo(local_service);
  const GrpoTrace r = run_grpo(remote_service);
  ASSERT_EQ(l.stats.size(), 3u);
  ASSERT_EQ(r.stats.size(), 3u);
  int trained_steps = 0;
  for (std::size_t s = 0; s < l.stats.size(); ++s) {
    const auto &a = l.stats[s], &b = r.stats[s];
    SCOPED_TRACE("step " + std::to_string(s));
    EXPECT_EQ(r.tokens[s], l.tokens[s]);  // same seeds, same weights: the same completions, token for token
    ASSERT_EQ(l.tokens[s].size(), 8u);    // 2 prompts x group of 4
    expect_near_all(r.logprobs[s], l.logprobs[s], "sampler logprobs");
    EXPECT_NEAR(b.reward_mean, a.reward_mean, kTol);
    EXPECT_NEAR(b.reward_std, a.reward_std, kTol);
    EXPECT_NEAR(b.loss, a.loss, kTol);
    EXPECT_NEAR(b.clip_fraction, a.clip_fraction, kTol);
    EXPECT_NEAR(b.entropy, a.entropy, kTol);
    EXPECT_EQ(b.groups_used, a.groups_used);
    EXPECT_EQ(b.sampled_tokens, a.sampled_tokens);
    EXPECT_EQ(b.trained_tokens, a.trained_tokens);
    // The reward really varies (random bytes of a fresh model), so the loop trains on something.
    EXPECT_GT(a.reward_std, 0.0);
    EXPECT_GT(a.entropy, 0.0);
    trained_steps += a.groups_used > 0 ? 1 : 0;
  }
  EXPECT_GT(trained_steps, 0);
  EXPECT_EQ(r.steps, l.steps);
  EXPECT_EQ(l.steps, trained_steps);  // one optimizer step per batch with a usable group
  expect_near_all(r.probe, l.probe, "logprobs after the loop");
}

TEST_F(RemoteParity, SftLoopGivesTheLocalLosses) {
  auto local_service = local("sft");
  auto remote_service = remote();
  const SftTrace l = run_sft(local_service);
  const SftTrace r = run_sft(remote_service);
  ASSERT_EQ(l.stats.size(), r.stats.size());
  for (std::size_t s = 0; s < l.stats.size(); ++s) {
    SCOPED_TRACE("step " + std::to_string(s));
    EXPECT_NEAR(r.stats[s].loss_per_token, l.stats[s].loss_per_token, kTol);
    EXPECT_EQ(r.stats[s].weight, l.stats[s].weight);
    EXPECT_GT(l.stats[s].loss_per_token, 0.0);
  }
  // Steps 0 and 4 would see the same batch; over 4 steps at lr 1e-2 the loss on the repeated examples falls.
  EXPECT_LT(l.stats.back().loss_per_token, l.stats.front().loss_per_token);
  expect_near_all(r.probe, l.probe, "logprobs after the loop");
}

TEST_F(RemoteParity, DpoLoopGivesTheLocalMetrics) {
  auto local_service = local("dpo");
  auto remote_service = remote();
  const DpoTrace l = run_dpo(local_service);
  const DpoTrace r = run_dpo(remote_service);
  ASSERT_EQ(l.stats.size(), r.stats.size());
  for (std::size_t s = 0; s < l.stats.size(); ++s) {
    SCOPED_TRACE("step " + std::to_string(s));
    const auto &a = l.stats[s], &b = r.stats[s];
    EXPECT_NEAR(b.loss, a.loss, kTol);
    EXPECT_NEAR(b.accuracy, a.accuracy, kTol);
    EXPECT_NEAR(b.reward_chosen, a.reward_chosen, kTol);
    EXPECT_NEAR(b.reward_rejected, a.reward_rejected, kTol);
    EXPECT_NEAR(b.margin, a.margin, kTol);
    EXPECT_EQ(b.reference_calls, a.reference_calls);
  }
  // Step 0 starts at the reference: z = 0, loss = log 2; then the margin grows.
  EXPECT_NEAR(l.stats[0].loss, std::log(2.0), 1e-6);
  EXPECT_EQ(l.stats[0].reference_calls, 6);
  EXPECT_EQ(l.stats[1].reference_calls, 0);
  EXPECT_GT(l.stats.back().margin, 0.0);
  EXPECT_LT(l.stats.back().loss, l.stats[0].loss);
  expect_near_all(r.probe, l.probe, "logprobs after the loop");
}
