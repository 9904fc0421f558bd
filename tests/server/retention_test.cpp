// Retention through the API (in-process, fake service): a session keeps the results of its most recent finished
// operations for their age, then answers ResourceNotFoundException saying the operation expired; client tokens
// and Idempotency-Keys dedupe retries for their own window; a durable server restarted on its data directory,
// with compactions behind it, gives the same answers as the server it replaces.
#include <gtest/gtest.h>

#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <thread>

#include "fake_service.hpp"
#include "server/server.hpp"
#include "wire/runtime.hpp"

using namespace rlloop;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

struct Retained : ::testing::Test {
  server::Options options;
  std::shared_ptr<fake::FakeService> service = std::make_shared<fake::FakeService>();
  std::unique_ptr<server::Api> api;
  std::mutex log_mu;
  std::vector<std::string> logs;

  Retained() {
    options.tenants = {server::Tenant{"a", "111122223333", {}, {"key-a"}, 4, 1 << 20}};
    options.log = [this](const std::string& line) {
      std::lock_guard lock(log_mu);
      logs.push_back(line);
    };
  }
  void start() { api = std::make_unique<server::Api>(options, server::make_backend(service)); }

  server::Response call(const std::string& method, const std::string& target, const json& body = nullptr,
                        std::vector<std::pair<std::string, std::string>> headers = {}) {
    headers.emplace_back("Authorization", "Bearer key-a");
    return api->handle({method, target, std::move(headers), body.is_null() ? "" : body.dump()});
  }
  json control(const std::string& op, const json& body) {
    auto r = call("POST", "/", body, {{"X-Amz-Target", "SageMaker." + op}});
    EXPECT_EQ(r.status, 200u) << r.body;
    return json::parse(r.body);
  }
  void create_running(const std::string& name) {
    control("CreateTrainingSession", {{"TrainingSessionName", name},
                                      {"RoleArn", "arn:aws:iam::111122223333:role/MyRole"},
                                      {"LoraConfig", {{"Rank", 8}, {"Alpha", 16}}},
                                      {"ModelConfig", {{"BaseModelArn", "tiny"}}},
                                      {"OutputConfig", {{"S3Location", {{"Path", "s3://bucket/prefix/"}}}}}});
    for (int i = 0; i < 1000; ++i) {
      if (describe(name)["TrainingSessionStatus"] == "Running") return;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    FAIL() << "session " << name << " never reached Running";
  }
  json describe(const std::string& name) {
    return control("DescribeTrainingSession", {{"TrainingSessionName", name}})["TrainingSessionDetail"];
  }

  static json forward(std::int64_t seq, std::optional<std::string> token = {}) {
    Datum d;
    d.model_input = ModelInput::from_tokens({1, 2, static_cast<token_id>(seq % 90)});
    d.loss_fn_inputs["target_tokens"] = TensorData::from_tokens(std::vector<token_id>{2, 3, 4});
    d.loss_fn_inputs["weights"] = TensorData::from_floats(std::vector<float>{1.0f, 1.0f, 1.0f});
    json body{{"sequenceNumber", seq},
              {"operationConfig",
               {{"forward", {{"datumList", json::array({wire::to_json(d)})}, {"lossFnName", "cross_entropy"}}}}}};
    if (token) body["clientToken"] = *token;
    return body;
  }
  static json sample() {
    return {{"operationConfig",
             {{"sample",
               {{"prompt", wire::to_json(ModelInput::from_tokens({1, 2, 3}))},
                {"numSamples", 1},
                {"samplingParams", {{"maxTokens", 2}}}}}}}};
  }
  // Submits an operation; its id.
  std::string submit(const std::string& session, const std::string& kind, const json& body,
                     std::vector<std::pair<std::string, std::string>> headers = {}) {
    auto r = call("POST", "/v1/training-sessions/" + session + "/" + kind, body, std::move(headers));
    EXPECT_EQ(r.status, 200u) << r.body;
    return json::parse(r.body).value("operationId", "");
  }
  // The result once terminal (a long-poll answers when it is), as GET answered it.
  json finished(const std::string& session, const std::string& kind, const std::string& id) {
    auto r = call("GET", "/v1/training-sessions/" + session + "/" + kind + "/" + id + "?waitSeconds=20");
    EXPECT_EQ(r.status, 200u) << r.body;
    return json::parse(r.body);
  }
  server::Response get(const std::string& session, const std::string& kind, const std::string& id) {
    return call("GET", "/v1/training-sessions/" + session + "/" + kind + "/" + id);
  }
  std::size_t events(const std::string& name) {
    std::lock_guard lock(log_mu);
    return std::count_if(logs.begin(), logs.end(), [&](const std::string& l) {
      return l.find("\"event\":\"" + name + "\"") != std::string::npos;
    });
  }
};

void expect_expired(const server::Response& r, const std::string& id) {
  EXPECT_EQ(r.status, 404u);
  const auto header =
      std::find_if(r.headers.begin(), r.headers.end(), [](const auto& h) { return h.first == "X-Amzn-ErrorType"; });
  ASSERT_NE(header, r.headers.end());
  EXPECT_EQ(header->second, "ResourceNotFoundException");
  const std::string message = json::parse(r.body)["message"];
  EXPECT_NE(message.find(id), std::string::npos) << message;
  EXPECT_NE(message.find("expired"), std::string::npos) << message;
}

}  // namespace

TEST_F(Retained, ASessionKeepsTheResultsOfItsMostRecentFinishedOperations) {
  options.retention.results = 3;
  start();
  create_running("s");
  std::vector<std::string> ids;
  std::vector<json> results;
  for (int seq = 1; seq <= 5; ++seq) {
    ids.push_back(submit("s", "operations", forward(seq)));
    results.push_back(finished("s", "operations", ids.back()));
    ASSERT_EQ(results.back()["status"], "Completed");
  }
  expect_expired(get("s", "operations", ids[0]), ids[0]);
  expect_expired(get("s", "operations", ids[1]), ids[1]);
  for (int i = 2; i < 5; ++i) {
    auto r = get("s", "operations", ids[i]);
    ASSERT_EQ(r.status, 200u) << r.body;
    EXPECT_EQ(json::parse(r.body), results[i]);
  }
  // An id the session never issued is not found, not expired; so is one of the other kind.
  auto never = get("s", "operations", "op-0-999");
  EXPECT_EQ(never.status, 404u);
  EXPECT_EQ(json::parse(never.body)["message"], "operation op-0-999 does not exist in training session s");
  EXPECT_EQ(json::parse(get("s", "sampling-operations", ids[4]).body)["message"],
            "operation " + ids[4] + " does not exist in training session s");
  // Sampling and training operations share the count.
  const std::string sampled = submit("s", "sampling-operations", sample());
  ASSERT_EQ(finished("s", "sampling-operations", sampled)["status"], "Completed");
  expect_expired(get("s", "operations", ids[2]), ids[2]);
  EXPECT_EQ(get("s", "sampling-operations", sampled).status, 200u);
}

TEST_F(Retained, AResultGoesOnceItIsAsOldAsTheRetentionAge) {
  options.retention.result_age = std::chrono::seconds(0);  // gone as soon as it is finished
  start();
  create_running("s");
  const std::string id = submit("s", "operations", forward(1));
  // Listed while it is queued or running, never as Completed: it expires as it finishes.
  server::Response r = get("s", "operations", id);
  for (int i = 0; i < 2000 && r.status == 200; ++i) {
    EXPECT_NE(json::parse(r.body)["status"], "Completed");
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    r = get("s", "operations", id);
  }
  expect_expired(r, id);
  EXPECT_EQ(service->sessions().back()->log(), std::vector<std::string>{"forward"});
}

TEST_F(Retained, IdempotencyKeysDedupeRetriesForTheirWindow) {
  options.retention.client_tokens = 2;
  start();
  create_running("s");
  auto with_key = [&](const std::string& key) {
    return submit("s", "sampling-operations", sample(), {{"Idempotency-Key", key}});
  };
  const std::string k1 = with_key("k1"), k2 = with_key("k2"), k3 = with_key("k3");
  EXPECT_EQ(with_key("k3"), k3) << "inside the window: the same operation";
  EXPECT_EQ(with_key("k2"), k2);
  const std::string again = with_key("k1");
  EXPECT_NE(again, k1) << "k1 fell out of the window (2 keys): a new operation";
  finished("s", "sampling-operations", again);
  std::size_t samples = 0;
  for (const auto& entry : service->sessions().back()->log()) samples += entry == "sample";
  EXPECT_EQ(samples, 4u);
}

TEST_F(Retained, AClientTokenOlderThanItsAgeNoLongerDedupes) {
  options.retention.client_token_age = std::chrono::seconds(0);
  start();
  create_running("s");
  const std::string first = submit("s", "operations", forward(1, "tok"));
  finished("s", "operations", first);
  // The same request again is a new operation, which its sequence number (no longer above the last) refuses.
  auto retry = call("POST", "/v1/training-sessions/s/operations", forward(1, "tok"));
  EXPECT_EQ(retry.status, 400u);
  EXPECT_EQ(json::parse(retry.body)["message"], "sequenceNumber 1 must be greater than the last received 1");
}

TEST_F(Retained, ARestartedServerAnswersAsBeforeWithCompactionsBehindIt) {
  const fs::path dir = fs::temp_directory_path() / ("rlloop-retention-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  options.data_dir = dir.string();
  options.retention.results = 3;
  options.compact_after_records = 4;
  start();
  create_running("s");
  std::vector<std::string> ids;
  std::vector<json> results;
  for (int seq = 1; seq <= 8; ++seq) {
    ids.push_back(submit("s", "operations", forward(seq, "tok-" + std::to_string(seq))));
    results.push_back(finished("s", "operations", ids.back()));
  }
  const std::string sampled = submit("s", "sampling-operations", sample(), {{"Idempotency-Key", "key-1"}});
  const json sample_result = finished("s", "sampling-operations", sampled);
  const json usage = json::parse(call("GET", "/v1/usage").body);
  const json before = describe("s");
  for (int i = 0; i < 1000 && events("compacted") == 0; ++i)  // the journal compacts on its own thread
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_GE(events("compacted"), 1u);
  api.reset();

  start();
  EXPECT_TRUE(fs::exists(dir / "snapshot.jsonl"));
  EXPECT_EQ(describe("s")["LastReceivedSequenceNumber"], before["LastReceivedSequenceNumber"]);
  EXPECT_EQ(describe("s")["BillableTokenUsage"], before["BillableTokenUsage"]);
  EXPECT_EQ(json::parse(call("GET", "/v1/usage").body), usage);
  // The three most recent results (the sample and two forwards) are back as they were; older ones expired.
  EXPECT_EQ(json::parse(get("s", "sampling-operations", sampled).body), sample_result);
  for (int i = 6; i < 8; ++i) EXPECT_EQ(json::parse(get("s", "operations", ids[i]).body), results[i]);
  expect_expired(get("s", "operations", ids[5]), ids[5]);
  expect_expired(get("s", "operations", ids[0]), ids[0]);
  // Retries inside the token window still get their operations back, after the restart too.
  EXPECT_EQ(submit("s", "operations", forward(8, "tok-8")), ids[7]);
  EXPECT_EQ(submit("s", "operations", forward(1, "tok-1")), ids[0]);
  EXPECT_EQ(submit("s", "sampling-operations", sample(), {{"Idempotency-Key", "key-1"}}), sampled);
  // A new operation gets an id the session never issued before.
  const std::string next = submit("s", "operations", forward(9));
  EXPECT_EQ(std::count(ids.begin(), ids.end(), next), 0);
  EXPECT_NE(next, sampled);
  EXPECT_EQ(finished("s", "operations", next)["status"], "Completed");
  api.reset();
  fs::remove_all(dir);
}
