// rlloop-server over loopback HTTP with the fake service: control plane, runtime ordering, idempotency, errors,
// tenants, limits and billing.
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <optional>
#include <thread>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>

#include "fake_service.hpp"
#include "server/server.hpp"
#include "test_client.hpp"
#include "wire/runtime.hpp"

using namespace rlloop;
using test_http::json;

namespace {

const sigv4::Credentials kTenantA{"AKIDTENANTA", "secret-a", ""};

// How long an awaited event may take before the test fails instead of hanging (not a performance bound).
constexpr std::chrono::seconds kEventBound{30};

// A GET by tenant b handed to the server's Api directly, its answer made on an executor of its own. The Api
// answers before handle_async returns unless the request is a long-poll that waits, so whether it had answered
// by then tells a waiting long-poll from an immediate answer: an event, not a measured delay.
class DirectRequest {
 public:
  // A GET of `target` by tenant b.
  DirectRequest(server::Api& api, const std::string& target)
      : DirectRequest(api, {"GET", target, {{"Host", "127.0.0.1"}, {"Authorization", "Bearer bearer-b"}}, ""}) {}
  DirectRequest(server::Api& api, const sigv4::HttpRequest& req) : api_(api) {
    api.handle_async(req, io_.get_executor(), [this](server::Response r) { answer_.set_value(std::move(r)); });
    waiting_ = !ready(std::chrono::seconds(0));
  }
  ~DirectRequest() {
    if (!ready(std::chrono::seconds(0))) api_.interrupt_waits();  // answered before its executor goes away
    result_.wait();
    work_.reset();
    runner_.join();
  }
  DirectRequest(const DirectRequest&) = delete;
  DirectRequest& operator=(const DirectRequest&) = delete;

  // The Api had not answered when handle_async returned.
  bool waiting() const { return waiting_; }
  // The answer's JSON body, or nullopt when none came within kEventBound.
  std::optional<json> answer() {
    if (!ready(kEventBound)) return std::nullopt;
    return json::parse(result_.get().body);
  }

 private:
  bool ready(std::chrono::seconds within) { return result_.wait_for(within) == std::future_status::ready; }

  server::Api& api_;
  boost::asio::io_context io_;
  boost::asio::executor_work_guard<boost::asio::io_context::executor_type> work_ = boost::asio::make_work_guard(io_);
  std::thread runner_{[this] { io_.run(); }};
  std::promise<server::Response> answer_;
  std::shared_future<server::Response> result_ = answer_.get_future().share();
  bool waiting_ = false;
};

struct ServerFixture : ::testing::Test {
  void SetUp() override {
    server::Tenant a{"a", "111122223333", {{"AKIDTENANTA", "secret-a"}}, {"bearer-a"}, 3, 4096};
    server::Tenant b{"b", "444455556666", {}, {"bearer-b"}, 8, 1 << 20};
    server::Options opts;
    opts.tenants = {a, b};
    opts.default_result_wait = default_result_wait;
    opts.log = [this](const std::string& line) {
      std::lock_guard lock(log_mu);
      logs.push_back(line);
    };
    service = std::make_shared<fake::FakeService>();
    srv = std::make_unique<server::Server>(opts, server::make_backend(service));
    srv->start();
  }
  void TearDown() override {
    service->gate->set(true);  // a worker held by the gate would keep stop() waiting
    srv->stop();
  }

  test_http::Client client_a() {
    test_http::Client c(srv->port());
    c.use_sigv4(kTenantA);
    return c;
  }
  test_http::Client client_b() {
    test_http::Client c(srv->port());
    c.use_bearer("bearer-b");
    return c;
  }

  static json create_body(const std::string& name, const std::string& model = "tiny") {
    return {{"TrainingSessionName", name},
            {"RoleArn", "arn:aws:iam::111122223333:role/MyRole"},
            {"LoraConfig", {{"Rank", 8}, {"Alpha", 16}}},
            {"ModelConfig", {{"BaseModelArn", model}}},
            {"OutputConfig", {{"S3Location", {{"Path", "s3://bucket/prefix/"}}}}}};
  }

  // Creates a session and waits until it is Running.
  void create_running(test_http::Client& c, const std::string& name, const std::string& model = "tiny") {
    auto r = c.control("CreateTrainingSession", create_body(name, model));
    ASSERT_EQ(r.status, 200u) << r.body;
    for (int i = 0; i < 200; ++i) {
      auto d = c.control("DescribeTrainingSession", {{"TrainingSessionName", name}}).json_body();
      if (d["TrainingSessionDetail"]["TrainingSessionStatus"] == "Running") return;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    FAIL() << "session " << name << " never reached Running";
  }

  static json datum_json(std::vector<token_id> tokens) {
    Datum d;
    d.model_input = ModelInput::from_tokens(tokens);
    d.loss_fn_inputs["target_tokens"] = TensorData::from_tokens(tokens);
    d.loss_fn_inputs["weights"] = TensorData::from_floats(std::vector<float>(tokens.size(), 1.0f));
    return wire::to_json(d);
  }
  static json fb_body(std::int64_t seq, std::vector<token_id> tokens = {1, 2, 3}) {
    return {
        {"sequenceNumber", seq},
        {"operationConfig",
         {{"forwardBackward", {{"datumList", json::array({datum_json(tokens)})}, {"lossFnName", "cross_entropy"}}}}}};
  }
  static json step_body(std::int64_t seq) {
    return {{"sequenceNumber", seq},
            {"operationConfig", {{"optimizerStep", {{"adamParamsConfig", {{"learningRate", 1e-3}}}}}}}};
  }

  // Polls an operation until it reaches a terminal status.
  static json wait_op(test_http::Client& c, const std::string& url) {
    for (int i = 0; i < 400; ++i) {
      auto r = c.get(url);
      EXPECT_EQ(r.status, 200u) << r.body;
      json j = r.json_body();
      const std::string s = j["status"];
      if (s == "Completed" || s == "Failed" || s == "Skipped") return j;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    ADD_FAILURE() << "operation never finished: " << url;
    return {};
  }

  std::shared_ptr<fake::FakeService> service;
  std::unique_ptr<server::Server> srv;
  std::mutex log_mu;
  std::vector<std::string> logs;
  std::chrono::milliseconds default_result_wait{0};  // Options::default_result_wait, set by derived fixtures
};

// A server whose Get*OperationResult without ?waitSeconds= waits up to an hour: within a test, only the
// operation finishing or the server stopping can answer such a poll.
struct LongWaitServerFixture : ServerFixture {
  LongWaitServerFixture() { default_result_wait = std::chrono::hours(1); }

  // Starts session "lp" with one operation that the closed gate holds; returns that operation's result path.
  std::string held_operation() {
    auto c = client_b();
    create_running(c, "lp");
    service->gate->set(false);
    const std::string ops = "/v1/training-sessions/lp/operations";
    return ops + "/" + c.post(ops, fb_body(1)).json_body()["operationId"].get<std::string>();
  }
};

}  // namespace

TEST_F(ServerFixture, HealthNeedsNoAuthButEverythingElseDoes) {
  test_http::Client anon(srv->port());
  EXPECT_EQ(anon.get("/health").status, 200u);
  auto r = anon.control("ListTrainingSessions", json::object());
  EXPECT_EQ(r.status, 403u);
  EXPECT_EQ(r.error_type, "MissingAuthenticationToken");
  anon.use_bearer("nope");
  EXPECT_EQ(anon.get("/v1/usage").error_type, "UnrecognizedClientException");
  anon.use_sigv4({"AKIDTENANTA", "wrong-secret", ""});
  r = anon.get("/v1/usage");
  EXPECT_EQ(r.status, 403u);
  EXPECT_EQ(r.error_type, "SignatureDoesNotMatch");
}

TEST_F(ServerFixture, ControlPlaneLifeCycle) {
  auto c = client_a();
  create_running(c, "sess-1");
  auto dup = c.control("CreateTrainingSession", create_body("sess-1"));
  EXPECT_EQ(dup.status, 400u);
  EXPECT_EQ(dup.json_body()["__type"], "ResourceInUse");

  auto d =
      c.control("DescribeTrainingSession", {{"TrainingSessionName", "sess-1"}}).json_body()["TrainingSessionDetail"];
  EXPECT_EQ(d["TrainingSessionArn"], "arn:aws:sagemaker:us-east-1:111122223333:training-session/sess-1");
  EXPECT_EQ(d["LoraConfig"]["Rank"], 8);
  EXPECT_EQ(d["RoleArn"], "arn:aws:iam::111122223333:role/MyRole");
  EXPECT_FALSE(d.contains("LastReceivedSequenceNumber"));

  create_running(c, "sess-2");
  auto list = c.control("ListTrainingSessions", {{"MaxResults", 1}}).json_body();
  ASSERT_EQ(list["TrainingSessionSummaries"].size(), 1u);
  EXPECT_EQ(list["TrainingSessionSummaries"][0]["TrainingSessionArn"],
            "arn:aws:sagemaker:us-east-1:111122223333:training-session/sess-2");
  auto page2 = c.control("ListTrainingSessions", {{"MaxResults", 1}, {"NextToken", list["NextToken"]}}).json_body();
  EXPECT_EQ(page2["TrainingSessionSummaries"][0]["TrainingSessionArn"],
            "arn:aws:sagemaker:us-east-1:111122223333:training-session/sess-1");
  EXPECT_FALSE(page2.contains("NextToken"));

  auto del = c.control("DeleteTrainingSession", {{"TrainingSessionName", "sess-1"}});
  EXPECT_EQ(del.json_body()["__type"], "ResourceInUse");
  EXPECT_EQ(c.control("StopTrainingSession", {{"TrainingSessionName", "sess-1"}}).status, 200u);
  auto fb = c.post("/v1/training-sessions/sess-1/operations", fb_body(1));
  EXPECT_EQ(fb.status, 409u);
  EXPECT_EQ(fb.error_type, "ConflictException");
  for (int i = 0; i < 200; ++i) {
    auto s = c.control("DescribeTrainingSession", {{"TrainingSessionName", "sess-1"}}).json_body();
    if (s["TrainingSessionDetail"]["TrainingSessionStatus"] == "Stopped") break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(c.control("DeleteTrainingSession", {{"TrainingSessionName", "sess-1"}}).status, 200u);
  auto gone = c.control("DescribeTrainingSession", {{"TrainingSessionName", "sess-1"}});
  EXPECT_EQ(gone.status, 400u);
  EXPECT_EQ(gone.json_body()["__type"], "ResourceNotFound");
}

TEST_F(ServerFixture, CreateValidatesTheSpecConstraints) {
  auto c = client_a();
  auto bad_name = create_body("bad_name!");
  auto r = c.control("CreateTrainingSession", bad_name);
  EXPECT_EQ(r.json_body()["__type"], "ValidationException");
  EXPECT_NE(r.json_body()["Message"].get<std::string>().find("TrainingSessionName: does not match"), std::string::npos);
  auto no_role = create_body("ok");
  no_role.erase("RoleArn");
  EXPECT_EQ(c.control("CreateTrainingSession", no_role).json_body()["Message"], "RoleArn: required field is missing");
  auto rank = create_body("ok");
  rank["LoraConfig"]["Rank"] = 512;
  EXPECT_EQ(c.control("CreateTrainingSession", rank).json_body()["Message"],
            "LoraConfig.Rank: must be in [1, 256], got 512");
  EXPECT_EQ(c.control("FlyToTheMoon", json::object()).json_body()["__type"], "UnknownOperationException");

  // A Hub ARN names a catalogue model: one the server does not serve is the model's ResourceNotFound, at once.
  auto hub = create_body("hub");
  hub["ModelConfig"]["BaseModelArn"] =
      "arn:aws:sagemaker:us-west-2:aws:hub-content/SageMakerPublicHub/Model/missing/1.0.0";
  const auto unknown = c.control("CreateTrainingSession", hub);
  EXPECT_EQ(unknown.status, 400u);
  EXPECT_EQ(unknown.json_body()["__type"], "ResourceNotFound");
  EXPECT_EQ(unknown.json_body()["Message"], "base model missing (ModelConfig.BaseModelArn) is not served here");
  // A base model given by name or path (an rlloop extension) that the service cannot load fails the session.
  hub["ModelConfig"]["BaseModelArn"] = "missing";
  ASSERT_EQ(c.control("CreateTrainingSession", hub).status, 200u);
  json d;
  for (int i = 0; i < 200; ++i) {
    d = c.control("DescribeTrainingSession", {{"TrainingSessionName", "hub"}}).json_body()["TrainingSessionDetail"];
    if (d["TrainingSessionStatus"] != "Created") break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(d["TrainingSessionStatus"], "Failed");
  EXPECT_NE(d["ErrorDetails"].get<std::string>().find("base model 'missing'"), std::string::npos);
}

TEST_F(ServerFixture, PipelinedOperationsRunInSequenceOrderAndAreBilled) {
  auto c = client_a();
  create_running(c, "train");
  // Submitted back to back without waiting: forward_backward then optim_step.
  const std::string fb = c.post("/v1/training-sessions/train/operations", fb_body(1)).json_body()["operationId"];
  const std::string st = c.post("/v1/training-sessions/train/operations", step_body(2)).json_body()["operationId"];
  const json fbr = wait_op(c, "/v1/training-sessions/train/operations/" + fb);
  ASSERT_EQ(fbr["status"], "Completed") << fbr.dump();
  const auto out = std::get<wire::ForwardBackwardResult>(*wire::training_state_from_json(fbr).result).output;
  EXPECT_NEAR(out.logprobs(0)[2], -0.04, 1e-6);
  EXPECT_NEAR(out.metrics.at("loss:sum"), 0.02 + 0.03 + 0.04, 1e-6);
  EXPECT_EQ(fbr["tokenUsage"]["trainingTokens"], 3);
  const json str = wait_op(c, "/v1/training-sessions/train/operations/" + st);
  EXPECT_EQ(str["operationResult"]["optimizerStep"]["metrics"]["step"], 1.0);
  EXPECT_EQ(service->sessions().back()->log(), (std::vector<std::string>{"forward_backward", "optim_step"}));

  auto d =
      c.control("DescribeTrainingSession", {{"TrainingSessionName", "train"}}).json_body()["TrainingSessionDetail"];
  EXPECT_EQ(d["LastReceivedSequenceNumber"], 2);
  EXPECT_EQ(d["BillableTokenUsage"]["TrainingTokenCount"], 3);

  auto stale = c.post("/v1/training-sessions/train/operations", fb_body(2));
  EXPECT_EQ(stale.status, 400u);
  EXPECT_EQ(stale.error_type, "ValidationException");
  EXPECT_EQ(stale.json_body()["message"], "sequenceNumber 2 must be greater than the last received 2");
  // The wrong kind of operation id is not found.
  EXPECT_EQ(c.get("/v1/training-sessions/train/sampling-operations/" + fb).status, 404u);
  EXPECT_EQ(c.get("/v1/training-sessions/train/operations/op-nope").error_type, "ResourceNotFoundException");
}

TEST_F(ServerFixture, ClientTokenMakesRetriesIdempotent) {
  auto c = client_a();
  create_running(c, "idem");
  json body = fb_body(5);
  body["clientToken"] = "step-5-fb";
  const auto first = c.post("/v1/training-sessions/idem/operations", body).json_body()["operationId"];
  const auto again = c.post("/v1/training-sessions/idem/operations", body).json_body()["operationId"];
  EXPECT_EQ(first, again);
  wait_op(c, "/v1/training-sessions/idem/operations/" + first.get<std::string>());
  EXPECT_EQ(service->sessions().back()->log().size(), 1u);
  json changed = fb_body(5, {4, 5});
  changed["clientToken"] = "step-5-fb";
  auto r = c.post("/v1/training-sessions/idem/operations", changed);
  EXPECT_EQ(r.status, 400u);
  EXPECT_NE(r.json_body()["message"].get<std::string>().find("already used with different parameters"),
            std::string::npos);
}

TEST_F(ServerFixture, IdempotencyKeyMakesSamplingRetriesIdempotent) {
  // Sampling requests have no clientToken; rlloop-server takes the Idempotency-Key header instead, so
  // a client retrying after a lost answer gets the original operation back: sampled and billed once.
  auto c = client_a();
  create_running(c, "sidem");
  const std::string url = "/v1/training-sessions/sidem/sampling-operations";
  json sample = {{"operationConfig",
                  {{"sample",
                    {{"prompt", wire::to_json(ModelInput::from_tokens({1, 2, 3}))},
                     {"numSamples", 2},
                     {"samplingParams", {{"maxTokens", 4}}}}}}}};
  const test_http::Client::Headers key{{"Idempotency-Key", "sample-7"}};
  const std::string first = c.post(url, sample, key).json_body()["operationId"];
  const json done = wait_op(c, url + "/" + first);
  ASSERT_EQ(done["status"], "Completed");
  const json billed = c.get("/v1/usage").json_body()["usage"];
  EXPECT_EQ(billed["prefill"], 3);
  EXPECT_EQ(billed["sample"], 8);

  const std::string again = c.post(url, sample, key).json_body()["operationId"];
  EXPECT_EQ(again, first);
  EXPECT_EQ(wait_op(c, url + "/" + again), done);  // the same result, not a new sample
  EXPECT_EQ(service->sessions().back()->log(), (std::vector<std::string>{"sample"}));
  EXPECT_EQ(c.get("/v1/usage").json_body()["usage"], billed);

  // A key reused with other parameters is an error; a bad key is a ValidationException naming the header.
  json changed = sample;
  changed["operationConfig"]["sample"]["numSamples"] = 3;
  auto r = c.post(url, changed, key);
  EXPECT_EQ(r.status, 400u);
  EXPECT_EQ(r.json_body()["message"], "Idempotency-Key sample-7 was already used with different parameters");
  r = c.post(url, sample, {{"Idempotency-Key", "no spaces"}});
  EXPECT_EQ(r.status, 400u);
  EXPECT_EQ(r.json_body()["message"], "Idempotency-Key: must be 1-128 characters of [a-zA-Z0-9-]");
  // A training clientToken and a sampling key share one namespace per session but never alias each other.
  json fb = fb_body(1);
  fb["clientToken"] = "sample-7";
  EXPECT_EQ(c.post("/v1/training-sessions/sidem/operations", fb).status, 400u);
  // Without a key every request is a new sample, as the API documents.
  const std::string other = c.post(url, sample).json_body()["operationId"];
  EXPECT_NE(other, first);
  wait_op(c, url + "/" + other);
  EXPECT_EQ(service->sessions().back()->log().size(), 2u);
}

TEST_F(ServerFixture, WaitSecondsLongPollsUntilTheOperationIsTerminal) {
  // rlloop's long-poll: GET ...?waitSeconds=N answers when the operation is terminal (one request, no polling).
  auto c = client_b();
  create_running(c, "lp");
  const std::string ops = "/v1/training-sessions/lp/operations";
  service->gate->set(false);  // the session's operations stay unfinished until the gate opens
  c.post(ops, fb_body(1));
  c.post(ops, step_body(2));
  const std::string last = c.post(ops, fb_body(3)).json_body()["operationId"];
  {
    DirectRequest poll(srv->api(), ops + "/" + last + "?waitSeconds=20");
    // The gate holds the operations, so an answer by now could only have been an unfinished state.
    EXPECT_TRUE(poll.waiting()) << "the long-poll answered before its operation finished";
    service->gate->set(true);
    const auto answer = poll.answer();
    ASSERT_TRUE(answer) << "no answer after the operation finished";
    EXPECT_EQ((*answer)["status"], "Completed");
  }
  // Other parameters are ignored; a bad waitSeconds is a ValidationException.
  EXPECT_EQ(c.get(ops + "/" + last + "?waitSeconds=0&x=1").json_body()["status"], "Completed");
  for (const std::string bad : {"21", "-1", "1.5", "", "999"}) {
    auto r = c.get(ops + "/" + last + "?waitSeconds=" + bad);
    EXPECT_EQ(r.status, 400u) << bad;
    EXPECT_EQ(r.json_body()["message"], "waitSeconds must be an integer in [0, 20]") << bad;
  }
}

TEST_F(LongWaitServerFixture, ALongPollAnswersWhenItsOperationFinishesNotAtItsDeadline) {
  DirectRequest poll(srv->api(), held_operation());  // no ?waitSeconds=: the server's default wait, an hour
  EXPECT_TRUE(poll.waiting());
  service->gate->set(true);
  const auto answer = poll.answer();  // the deadline is out of reach: only the operation finishing answers
  ASSERT_TRUE(answer) << "the long-poll did not answer when its operation finished";
  EXPECT_EQ((*answer)["status"], "Completed");
}

TEST_F(LongWaitServerFixture, DescribingASessionStillCreatingAnswersOnceItRuns) {
  service->creation->set(false);  // the session's model "loads" until the gate opens
  auto c = client_b();
  ASSERT_EQ(c.control("CreateTrainingSession", create_body("slow")).status, 200u);
  const sigv4::HttpRequest describe{"POST",
                                    "/",
                                    {{"Host", "127.0.0.1"},
                                     {"Authorization", "Bearer bearer-b"},
                                     {"X-Amz-Target", "SageMaker.DescribeTrainingSession"}},
                                    json{{"TrainingSessionName", "slow"}}.dump()};
  DirectRequest poll(srv->api(), describe);  // the server's default wait: an hour
  EXPECT_TRUE(poll.waiting()) << "answered while the session was still Creating";
  service->creation->set(true);
  const auto answer = poll.answer();  // the deadline is out of reach: only the session starting answers
  ASSERT_TRUE(answer) << "the describe did not answer when the session started";
  EXPECT_EQ((*answer)["TrainingSessionDetail"]["TrainingSessionStatus"], "Running");
  // A session that is not Creating is described at once; an unknown one is refused at once.
  EXPECT_FALSE(DirectRequest(srv->api(), describe).waiting());
  sigv4::HttpRequest unknown = describe;
  unknown.body = json{{"TrainingSessionName", "nobody"}}.dump();
  DirectRequest refused(srv->api(), unknown);
  EXPECT_FALSE(refused.waiting());
  EXPECT_NE(refused.answer()->dump().find("nobody"), std::string::npos);
}

TEST_F(LongWaitServerFixture, AServerThatStopsAnswersItsLongPollsAtOnce) {
  DirectRequest poll(srv->api(), held_operation());
  EXPECT_TRUE(poll.waiting());
  // stop() ends with the session workers, one of which the gate holds: it runs beside this thread until the
  // gate opens, after the poll's answer (or the lack of one) is in.
  auto stopped = std::async(std::launch::async, [this] { srv->stop(); });
  const auto answer = poll.answer();  // with the operation held and the deadline an hour away, only stop() answers
  service->gate->set(true);
  stopped.get();
  ASSERT_TRUE(answer) << "stop() left a long-poll waiting";
  // The state the poll read as the server stopped: queued, running, or Skipped when the shutdown skipped the
  // queued operation before the woken poll read it (the poll is answered on its own executor, beside stop()).
  const std::string status = (*answer)["status"];
  EXPECT_TRUE(status == "Pending" || status == "InProgress" || status == "Skipped") << status;
}

TEST_F(ServerFixture, BadRequestsAreValidationErrorsNamingTheField) {
  auto c = client_a();
  create_running(c, "val");
  json body = fb_body(1);
  body["operationConfig"]["forwardBackward"]["datumList"][0]["lossFnInputs"]["weights"]["data"] = {"x", "y", "z"};
  auto r = c.post("/v1/training-sessions/val/operations", body);
  EXPECT_EQ(r.status, 400u);
  EXPECT_EQ(r.json_body()["message"],
            "operationConfig.forwardBackward.datumList[0].lossFnInputs.weights.data: expected numbers");
  r = c.post("/v1/training-sessions/val/operations", fb_body(2, {1, 2, 500}));
  EXPECT_EQ(r.status, 400u);
  EXPECT_NE(r.json_body()["message"].get<std::string>().find("token id 500 at position 2 is out of range [0, 257)"),
            std::string::npos);
  r = c.send("POST", "/v1/training-sessions/val/operations", "{not json");
  EXPECT_EQ(r.error_type, "ValidationException");
  // Routing replay asked of a model without experts, both ways: a 400 at submission.
  body = fb_body(2);
  body["operationConfig"]["forwardBackward"]["datumList"][0]["lossFnInputs"]["routed_experts"] = {
      {"data", {{{0, 1}}, {{1, 2}}, {{2, 3}}}}, {"dtype", "int64"}};
  r = c.post("/v1/training-sessions/val/operations", body);
  EXPECT_EQ(r.status, 400u);
  EXPECT_EQ(r.json_body()["message"], "datum 0: loss input 'routed_experts': the model has no experts to route to");
  r = c.post("/v1/training-sessions/val/sampling-operations",
             {{"operationConfig",
               {{"sample",
                 {{"prompt", wire::to_json(ModelInput::from_tokens({1, 2}))},
                  {"numSamples", 1},
                  {"samplingParams", {{"maxTokens", 2}}},
                  {"includeRoutedExperts", true}}}}}});
  EXPECT_EQ(r.status, 400u);
  EXPECT_EQ(r.json_body()["message"], "operationConfig.sample.includeRoutedExperts: the model has no experts");
  EXPECT_EQ(c.post("/v1/training-sessions/nosuch/operations", fb_body(1)).status, 404u);
}

TEST_F(ServerFixture, AFailedOperationSkipsTheQueuedOnes) {
  auto c = client_a();
  create_running(c, "fail", "slow");
  const std::string bad =
      c.post("/v1/training-sessions/fail/operations", fb_body(1, {99, 1})).json_body()["operationId"];
  const std::string next = c.post("/v1/training-sessions/fail/operations", step_body(2)).json_body()["operationId"];
  const json b = wait_op(c, "/v1/training-sessions/fail/operations/" + bad);
  EXPECT_EQ(b["status"], "Failed");
  EXPECT_EQ(b["errorDetails"], "fake: poisoned datum");
  EXPECT_EQ(wait_op(c, "/v1/training-sessions/fail/operations/" + next)["status"], "Skipped");
  // Operations submitted after the failure run normally.
  const std::string later = c.post("/v1/training-sessions/fail/operations", step_body(3)).json_body()["operationId"];
  EXPECT_EQ(wait_op(c, "/v1/training-sessions/fail/operations/" + later)["status"], "Completed");
}

TEST_F(ServerFixture, SamplingOperationsAndCheckpointsAreTenantScoped) {
  auto a = client_a();
  create_running(a, "samp");
  json sample = {{"operationConfig",
                  {{"sample",
                    {{"prompt", wire::to_json(ModelInput::from_tokens({1, 2, 3}))},
                     {"numSamples", 2},
                     {"samplingParams", {{"maxTokens", 4}}},
                     {"includePromptLogprobs", true}}}}}};
  const std::string id = a.post("/v1/training-sessions/samp/sampling-operations", sample).json_body()["operationId"];
  const json r = wait_op(a, "/v1/training-sessions/samp/sampling-operations/" + id);
  const auto resp = std::get<SampleResponse>(*wire::sampling_state_from_json(r).result);
  ASSERT_EQ(resp.sequences.size(), 2u);
  EXPECT_EQ(resp.sequences[1].tokens, (std::vector<token_id>{5, 6, 7, 8}));
  EXPECT_EQ(*resp.prompt_logprobs, fake::FakeSession::lp_of({1, 2, 3}));

  const std::string save = a.post("/v1/training-sessions/samp/operations",
                                  {{"sequenceNumber", 1}, {"operationConfig", {{"saveWeights", json::object()}}}})
                               .json_body()["operationId"];
  const std::string arn =
      wait_op(a, "/v1/training-sessions/samp/operations/" + save)["operationResult"]["saveWeights"]["modelPackageArn"];
  EXPECT_EQ(arn, "arn:aws:sagemaker:us-east-1:111122223333:model-package/samp/1");
  sample["operationConfig"]["sample"]["modelPackageArn"] = arn;
  const std::string id2 = a.post("/v1/training-sessions/samp/sampling-operations", sample).json_body()["operationId"];
  EXPECT_EQ(wait_op(a, "/v1/training-sessions/samp/sampling-operations/" + id2)["status"], "Completed");
  EXPECT_EQ(service->sessions().back()->log().back(), "sample:/fake/a-samp-weights-1");

  // Tenant b sees nothing of tenant a: not the session, not its operations, not its checkpoints.
  auto b = client_b();
  EXPECT_EQ(b.control("DescribeTrainingSession", {{"TrainingSessionName", "samp"}}).json_body()["__type"],
            "ResourceNotFound");
  EXPECT_EQ(b.get("/v1/training-sessions/samp/sampling-operations/" + id).status, 404u);
  EXPECT_TRUE(b.control("ListTrainingSessions", json::object()).json_body()["TrainingSessionSummaries"].empty());
  create_running(b, "samp");  // the same name is free in another tenant
  // a's checkpoint ARN is not b's: refused at submission, as an ARN of no checkpoint at all.
  const auto other = b.post("/v1/training-sessions/samp/sampling-operations", sample);
  EXPECT_EQ(other.status, 404u);
  EXPECT_NE(other.json_body()["message"].get<std::string>().find("does not exist in this account"), std::string::npos);

  // Billing: a has a 3-token prompt (billed once per call) + 2 samples x 4 decode, twice; b has nothing billed.
  const json ua = a.get("/v1/usage").json_body();
  EXPECT_EQ(ua["tenant"], "a");
  EXPECT_EQ(ua["usage"]["prefill"], 6);
  EXPECT_EQ(ua["usage"]["sample"], 16);
  EXPECT_EQ(b.get("/v1/usage").json_body()["usage"]["sample"], 0);
}

TEST_F(ServerFixture, PromptBilledPerSampleWhenConfigured) {
  // Options::bill_prompt_per_sample (rlloop serve --bill-prompt-per-sample): n samples bill the prompt n times.
  srv->stop();
  server::Options opts;
  opts.tenants = {server::Tenant{"b", "444455556666", {}, {"bearer-b"}, 8, 1 << 20}};
  opts.log = [](const std::string&) {};
  opts.bill_prompt_per_sample = true;
  srv = std::make_unique<server::Server>(opts, server::make_backend(service));
  srv->start();
  auto c = client_b();
  create_running(c, "pps");
  json sample = {{"operationConfig",
                  {{"sample",
                    {{"prompt", wire::to_json(ModelInput::from_tokens({1, 2, 3}))},
                     {"numSamples", 2},
                     {"samplingParams", {{"maxTokens", 4}}}}}}}};
  const std::string id = c.post("/v1/training-sessions/pps/sampling-operations", sample).json_body()["operationId"];
  EXPECT_EQ(wait_op(c, "/v1/training-sessions/pps/sampling-operations/" + id)["status"], "Completed");
  const json u = c.get("/v1/usage").json_body()["usage"];
  EXPECT_EQ(u["prefill"], 6);
  EXPECT_EQ(u["sample"], 8);
}

TEST_F(ServerFixture, TenantLimitsAreErrorsNotCrashes) {
  auto a = client_a();
  for (const char* n : {"l1", "l2", "l3"}) ASSERT_EQ(a.control("CreateTrainingSession", create_body(n)).status, 200u);
  auto r = a.control("CreateTrainingSession", create_body("l4"));
  EXPECT_EQ(r.json_body()["__type"], "ResourceLimitExceeded");
  // Tenant a may send 4096 bytes; the server still answers the next request on the same connection.
  r = a.send("POST", "/v1/training-sessions/l1/operations", std::string(5000, ' '));
  EXPECT_EQ(r.status, 413u);
  EXPECT_EQ(r.error_type, "RequestEntityTooLarge");
  EXPECT_EQ(a.get("/health").status, 200u);
}

TEST_F(ServerFixture, LogsOneJsonLinePerRequest) {
  auto a = client_a();
  a.get("/v1/usage");
  a.control("DescribeTrainingSession", {{"TrainingSessionName", "none"}});
  std::lock_guard lock(log_mu);
  ASSERT_EQ(logs.size(), 2u);
  const json first = json::parse(logs[0]), second = json::parse(logs[1]);
  EXPECT_EQ(first["tenant"], "a");
  EXPECT_EQ(first["status"], 200);
  EXPECT_NE(first["requestId"], second["requestId"]);
  EXPECT_EQ(second["errorType"], "ResourceNotFound");
  EXPECT_EQ(second["target"], "SageMaker.DescribeTrainingSession");
}
