// rlloop-server hosting real LocalSessions (rlloop-tiny, LoRA): a short SFT loop through RemoteService -> HTTP ->
// server -> LocalService gives the metrics of the same loop on a LocalSession in this process; saveWeights with
// mergeWeights exports the merged model.
#include <gtest/gtest.h>

#include <boost/asio.hpp>

#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <thread>

#include <rlloop/local.hpp>
#include <rlloop/remote.hpp>

#include "../engine/session_util.hpp"
#include "server/server.hpp"
#include "test_client.hpp"

using namespace rlloop;
using test_http::json;
using test_util::bytes;
using test_util::LoopGate;
using test_util::sft_datum;
namespace fs = std::filesystem;

namespace {

struct EngineServer : ::testing::Test {
  void SetUp() override {
    dir = fs::temp_directory_path() / ("rlloop-srv-engine-" + std::to_string(::getpid()));
    fs::remove_all(dir);
    local.checkpoint_dir = (dir / "local").string();
    local.device = "cpu";
    configure_engine_process({.num_threads = 1});  // the served and the local sessions compute alike
    LocalServiceOptions served = local;
    served.checkpoint_dir = (dir / "served").string();
    server::Options opts;
    opts.tenants = {server::Tenant{"a", "111122223333", {}, {"key-a"}, 4, 1 << 26}};
    opts.data_dir = (dir / "data").string();
    opts.log = [](const std::string&) {};
    served_service = std::make_shared<LocalService>(served);
    srv = std::make_unique<server::Server>(opts, server::make_backend(served_service));
    srv->start();
  }
  void TearDown() override {
    srv->stop();
    fs::remove_all(dir);
  }
  RemoteOptions remote() const {
    RemoteOptions o;
    o.endpoint = "http://127.0.0.1:" + std::to_string(srv->port());
    o.bearer_key = "key-a";
    return o;
  }
  fs::path dir;
  LocalServiceOptions local;
  std::shared_ptr<LocalService> served_service;  // the server's sessions: their engine loops can be observed
  std::unique_ptr<server::Server> srv;
};

// A LoRA session on rlloop-tiny named `name`: served, and in this process to compare with.
SessionOptions lora_tiny(const std::string& name) {
  SessionOptions opts;
  opts.base_model = "rlloop-tiny";
  opts.lora = LoraOptions{4, 8, {"all-linear"}};
  opts.name = name;
  return opts;
}

// Waits (a few seconds at most) until `ready` holds.
// Up to 60 s: a bound for a machine under load (a test suite run with -j2 beside a build), not a timing.
bool eventually(const std::function<bool()>& ready) {
  for (int i = 0; i < 12000 && !ready(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  return ready();
}

}  // namespace

TEST_F(EngineServer, SftLoopThroughServerMatchesLocalSession) {
  const SessionOptions opts = lora_tiny("sft");
  RemoteService service(remote());
  auto remote_session = service.create_session(opts);
  LocalService local_service(local);
  auto local_session = local_service.create_session(opts);
  EXPECT_EQ(remote_session->info().vocab_size, local_session->info().vocab_size);

  const std::vector<std::vector<Datum>> batches = {{sft_datum("the cat sat on the mat"), sft_datum("hello world")},
                                                   {sft_datum("2+2=4; 3+3=6")},
                                                   {sft_datum("the cat sat on the mat"), sft_datum("abcabcabc")}};
  AdamParams adam;
  adam.learning_rate = 1e-2;
  double first_loss = 0, last_loss = 0;
  for (int epoch = 0; epoch < 2; ++epoch) {
    for (const auto& batch : batches) {
      // Submitted back to back on the remote side (pipelined), as a training loop would.
      auto rf = remote_session->forward_backward(batch, LossSpec::cross_entropy());
      auto rs = remote_session->optim_step(adam);
      const auto r = rf.get();
      const auto l = local_session->forward_backward(batch, LossSpec::cross_entropy()).get();
      const auto r_step = rs.get();
      const auto l_step = local_session->optim_step(adam).get();
      ASSERT_NEAR(r.metrics.at("loss:sum"), l.metrics.at("loss:sum"), 1e-5);
      EXPECT_EQ(r.training_tokens, l.training_tokens);
      for (std::size_t i = 0; i < batch.size(); ++i) {
        const auto rl = r.logprobs(i), ll = l.logprobs(i);
        ASSERT_EQ(rl.size(), ll.size());
        for (std::size_t k = 0; k < rl.size(); ++k) ASSERT_NEAR(rl[k], ll[k], 1e-5) << "datum " << i << " token " << k;
      }
      EXPECT_EQ(r_step.metrics.at("step"), l_step.metrics.at("step"));
      if (epoch == 0 && &batch == &batches[0]) first_loss = l.metrics.at("loss:sum");
      if (epoch == 1 && &batch == &batches[0]) last_loss = l.metrics.at("loss:sum");
    }
  }
  EXPECT_LT(last_loss, first_loss);  // the loop really trained
  EXPECT_EQ(remote_session->info().step, 6);
  // Billing counted every trained token exactly once.
  EXPECT_EQ(remote_session->usage().training, local_session->usage().training);

  // Sampling with a seed gives the same tokens through the server.
  SampleRequest sr;
  sr.prompt = ModelInput::from_tokens(bytes("the cat"));
  sr.num_samples = 3;
  sr.params.max_tokens = 6;
  sr.params.seed = 7;
  EXPECT_EQ(remote_session->sample(sr).get().sequences.at(0).tokens,
            local_session->sample(sr).get().sequences.at(0).tokens);
  // The server bills exactly what the session does: the prompt once per call (not per sample), every decoded token.
  const TokenUsage ru = remote_session->usage(), lu = local_session->usage();
  EXPECT_EQ(ru.prefill, 7);
  EXPECT_EQ(ru.prefill, lu.prefill);
  EXPECT_EQ(ru.sample, lu.sample);
  EXPECT_EQ(ru.training, lu.training);
}

// Consecutive sample operations of one session run side by side: the session decodes them in one batch instead of
// one after another. An operation queued after them waits for them, and a sample after it sees what it did.
TEST_F(EngineServer, ConsecutiveSamplesOfASessionDecodeTogether) {
  const SessionOptions opts = lora_tiny("batch");
  RemoteService service(remote());
  auto remote_session = service.create_session(opts);
  LocalService local_service(local);
  auto local_session = local_service.create_session(opts);
  SessionOptions side_opts = opts;  // on the server's engine loop, to hold it
  side_opts.name = "side";
  auto side = served_service->create_session(side_opts);
  auto loop_stats = [&] { return served_service->base_model_stats().at(0); };

  std::vector<SampleRequest> reqs;
  for (const char* prompt : {"the cat", "a dog", "2+2=", "hello"}) {
    SampleRequest r;
    r.prompt = ModelInput::from_tokens(bytes(prompt));
    r.num_samples = 2;
    r.params.max_tokens = 12;
    r.params.seed = static_cast<int>(reqs.size()) + 3;
    reqs.push_back(std::move(r));
  }
  const std::vector<Datum> batch = {sft_datum("the cat sat on the mat")};
  AdamParams adam;
  adam.learning_rate = 1e-2;
  constexpr int kSteps = 3;  // enough to change the samples

  auto gate = std::make_unique<LoopGate>(*side);
  gate->wait_held();  // (not counted among the queued operations below)
  std::vector<Future<SampleResponse>> samples;
  for (const auto& r : reqs) samples.push_back(remote_session->sample(r));
  std::vector<Future<ForwardBackwardOutput>> trained;
  std::vector<Future<OptimStepOutput>> stepped;
  for (int i = 0; i < kSteps; ++i) {
    trained.push_back(remote_session->forward_backward(batch, LossSpec::cross_entropy()));
    stepped.push_back(remote_session->optim_step(adam));
  }
  auto after = remote_session->sample(reqs[0]);
  // Every sample waits on the held loop; the training operations behind them wait on the server.
  ASSERT_TRUE(eventually([&] { return loop_stats().queued_operations == static_cast<int>(reqs.size()); }))
      << loop_stats().queued_operations << " operations queued on the loop";
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // (a server that started them would have by now)
  EXPECT_EQ(loop_stats().queued_operations, static_cast<int>(reqs.size())) << "the training operations wait";
  gate->release();
  for (std::size_t i = 0; i < reqs.size(); ++i) {
    const SampleResponse r = samples[i].get(), l = local_session->sample(reqs[i]).get();
    ASSERT_EQ(r.sequences.size(), l.sequences.size());
    for (std::size_t k = 0; k < r.sequences.size(); ++k) {
      EXPECT_EQ(r.sequences[k].tokens, l.sequences[k].tokens) << "request " << i << " sample " << k;
      ASSERT_EQ(r.sequences[k].logprobs.size(), l.sequences[k].logprobs.size());
      for (std::size_t t = 0; t < r.sequences[k].logprobs.size(); ++t)
        EXPECT_NEAR(r.sequences[k].logprobs[t], l.sequences[k].logprobs[t], test_util::lp_tol());
    }
  }
  EXPECT_EQ(loop_stats().peak_batch_requests, static_cast<int>(reqs.size())) << "every sample in one step";
  for (int i = 0; i < kSteps; ++i) {
    ASSERT_NEAR(trained[i].get().metrics.at("loss:sum"),
                local_session->forward_backward(batch, LossSpec::cross_entropy()).get().metrics.at("loss:sum"), 1e-5);
    stepped[i].get();
    local_session->optim_step(adam).get();
  }
  const SampleResponse moved = local_session->sample(reqs[0]).get();
  EXPECT_NE(moved.sequences.at(0).tokens, samples[0].get().sequences.at(0).tokens) << "the step changed the samples";
  EXPECT_EQ(after.get().sequences.at(0).tokens, moved.sequences.at(0).tokens) << "the sample after the step sees it";
}

TEST_F(EngineServer, MergedWeightsExportAndBaseModelCatalogue) {
  RemoteService service(remote());
  const auto models = service.list_base_models();
  EXPECT_NE(std::find(models.begin(), models.end(), "rlloop-tiny"), models.end());
  EXPECT_NE(std::find(models.begin(), models.end(), "rlloop-small"), models.end());

  SessionOptions opts;
  opts.base_model = "rlloop-tiny";
  opts.lora = LoraOptions{4, 8, {"all-linear"}};
  opts.name = "merge";
  auto s = service.create_session(opts);
  // saveWeights with mergeWeights through the raw operation API (RemoteSession saves adapters only).
  test_http::Client c(srv->port());
  c.use_bearer("key-a");
  auto r = c.post("/v1/training-sessions/merge/operations",
                  {{"sequenceNumber", 1}, {"operationConfig", {{"saveWeights", {{"mergeWeights", true}}}}}});
  ASSERT_EQ(r.status, 200u) << r.body;
  const std::string id = r.json_body()["operationId"];
  test_http::json state;
  for (int i = 0; i < 2000; ++i) {
    state = c.get("/v1/training-sessions/merge/operations/" + id).json_body();
    if (state["status"] != "Pending" && state["status"] != "InProgress") break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_EQ(state["status"], "Completed") << state.dump();
  const std::string arn = state["operationResult"]["saveWeights"]["modelPackageArn"];
  EXPECT_EQ(arn, "arn:aws:sagemaker:us-east-1:111122223333:model-package/merge/1");
  const fs::path exported = dir / "data" / "exports" / "a-merge-merged-1";
  ASSERT_TRUE(fs::exists(exported / "config.json")) << exported;
  bool has_weights = false;
  for (const auto& e : fs::directory_iterator(exported)) has_weights |= e.path().extension() == ".safetensors";
  EXPECT_TRUE(has_weights);
  SessionOptions missing = opts;
  missing.base_model = "no-such-model";
  missing.name = "missing";
  EXPECT_THROW(service.create_session(missing), remote_error);
}

// A streamed completion sends its first tokens while the rest is still being decoded: the engine loop is held
// after the request's first decoding step, and the first text chunk reaches the client while it is held.
TEST_F(EngineServer, StreamedCompletionsArriveWhileTheSampleStillDecodes) {
  const SessionOptions opts = lora_tiny("stream");
  RemoteService service(remote());
  auto remote_session = service.create_session(opts);
  // A session of the same base in the server's own service: it runs on the same engine loop.
  SessionOptions side_opts = opts;
  side_opts.name = "side";
  auto side = served_service->create_session(side_opts);
  auto loop_stats = [&] { return served_service->base_model_stats().at(0); };

  // Gates on one session run one per loop turn, each after a decoding step: gates[0] holds the loop now, and
  // releasing gates one at a time lets the sample decode one step at a time.
  constexpr std::size_t kGates = 8;
  std::vector<std::unique_ptr<LoopGate>> gates;
  for (std::size_t i = 0; i < kGates; ++i) gates.push_back(std::make_unique<LoopGate>(*side));
  gates[0]->wait_held();  // (so the kGates queued operations below are the sample and the other gates)

  boost::asio::io_context io;
  boost::asio::ip::tcp::socket socket(io);
  socket.connect({boost::asio::ip::make_address("127.0.0.1"), srv->port()});
  const std::string body =
      json{{"model", "stream"}, {"prompt", "the cat"}, {"max_tokens", 64}, {"seed", 5}, {"stream", true}}.dump();
  const std::string request =
      "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer key-a\r\n"
      "Content-Type: application/json\r\nContent-Length: " +
      std::to_string(body.size()) + "\r\n\r\n" + body;
  boost::asio::write(socket, boost::asio::buffer(request));
  // The sample is queued behind the held loop, with the other gates.
  ASSERT_TRUE(eventually([&] { return loop_stats().queued_operations == static_cast<int>(kGates); }));

  std::string received;
  auto has_text = [&] { return received.find(R"("text":")") != std::string::npos; };
  auto first_text = std::async(std::launch::async, [&] {
    while (!has_text() && received.find("[DONE]") == std::string::npos) {
      char buf[4096];
      received.append(buf, socket.read_some(boost::asio::buffer(buf)));
    }
  });
  // One turn at a time until the first text arrives. The stream holds back the last piece (a later token may still
  // change it), so that takes two tokens: the prefill's and one step's, in the first turn as the loop orders its
  // work; a few more turns are allowed so that the test does not depend on that order.
  std::size_t released = 0;
  bool arrived = false;
  BaseModelStats held;
  while (!arrived && released + 1 < kGates) {
    gates[released++]->release();
    arrived = first_text.wait_for(std::chrono::seconds(released + 1 < kGates ? 2 : 20)) == std::future_status::ready;
    held = loop_stats();
  }
  while (released < kGates) gates[released++]->release();  // (a stream that waits for the whole sample gets it now)
  first_text.get();
  ASSERT_TRUE(arrived && has_text()) << "no text while the sample was held, one step at a time: " << received;
  EXPECT_EQ(held.active_requests, 1) << "the first chunk came while the sample was still decoding";
  EXPECT_LT(held.decode_steps, 63u);
  EXPECT_EQ(received.find("finish_reason\":\"length"), std::string::npos);

  while (received.find("data: [DONE]") == std::string::npos) {
    char buf[4096];
    received.append(buf, socket.read_some(boost::asio::buffer(buf)));
  }
  // The pieces streamed add up to what the same request answers unstreamed.
  auto text_of = [](const std::string& sse) {
    std::string text;
    for (std::size_t at = sse.find("data: {"); at != std::string::npos; at = sse.find("data: {", at + 1)) {
      const json event = json::parse(sse.substr(at + 6, sse.find("\n", at) - at - 6));
      for (const auto& c : event["choices"]) text += c.value("text", "");
    }
    return text;
  };
  test_http::Client c(srv->port());
  c.use_bearer("key-a");
  auto whole = c.post("/v1/completions", {{"model", "stream"}, {"prompt", "the cat"}, {"max_tokens", 64}, {"seed", 5}});
  ASSERT_EQ(whole.status, 200u) << whole.body;
  const json answer = whole.json_body();
  EXPECT_EQ(text_of(received), answer["choices"][0]["text"].get<std::string>());
  EXPECT_EQ(answer["usage"]["completion_tokens"], 64) << "the seed gives 64 tokens without an end of sequence";

  // Chat, several choices and a stop string: each choice's streamed deltas add up to its unstreamed content.
  const json chat{{"model", "stream"}, {"messages", {{{"role", "user"}, {"content", "say something"}}}},
                  {"max_tokens", 48},  {"n", 3},
                  {"seed", 9},         {"stop", {"e "}}};
  json streamed_chat = chat;
  streamed_chat["stream"] = true;
  const auto sse = c.post("/v1/chat/completions", streamed_chat);
  ASSERT_EQ(sse.status, 200u) << sse.body;
  std::vector<std::string> contents(3);
  for (std::size_t at = sse.body.find("data: {"); at != std::string::npos; at = sse.body.find("data: {", at + 1)) {
    const json event = json::parse(sse.body.substr(at + 6, sse.body.find("\n", at) - at - 6));
    for (const auto& choice : event["choices"])
      contents.at(choice["index"].get<std::size_t>()) += choice["delta"].value("content", "");
  }
  const auto unstreamed = c.post("/v1/chat/completions", chat);
  ASSERT_EQ(unstreamed.status, 200u) << unstreamed.body;
  std::size_t streamed_bytes = 0;
  for (std::size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(contents[i], unstreamed.json_body()["choices"][i]["message"]["content"].get<std::string>()) << i;
    streamed_bytes += contents[i].size();
  }
  EXPECT_GT(streamed_bytes, 20u) << "the choices stream text, not just their ends";
}
