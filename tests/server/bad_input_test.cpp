// Bad input over loopback HTTP: malformed JSON, wrong types, unknown union members and fields,
// oversized bodies, invalid names, calls in the wrong session state, unknown paths and targets, and SigV4
// requests that were tampered with, expired or signed by another tenant. Each gets its documented status and
// error name in the documented shape (docs/wire.md: runtime = X-Amzn-ErrorType + {"message"}, control plane =
// {"__type", "Message"}), and the server keeps serving on the same connection afterwards.
// (server_test.cpp covers the basic cases: bad JSON on the runtime, bad token ids, 413 from a tenant limit,
// duplicate names, Stop-before-Delete, unknown X-Amz-Target.)
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "fake_service.hpp"
#include "server/server.hpp"
#include "test_client.hpp"
#include "wire/runtime.hpp"

using namespace rlloop;
using test_http::json;

namespace {

namespace http = boost::beast::http;
using tcp = boost::asio::ip::tcp;

const sigv4::Credentials kKeyA{"AKIDBADA", "secret-bad-a", ""};
const sigv4::Credentials kKeyB{"AKIDBADB", "secret-bad-b", ""};

// One request on a fresh connection, any method, headers exactly as given (nothing signed or added).
test_http::Reply raw(std::uint16_t port, const sigv4::HttpRequest& r) {
  boost::asio::io_context io;
  tcp::socket socket(io);
  socket.connect({boost::asio::ip::make_address("127.0.0.1"), port});
  http::request<http::string_body> req;
  req.method_string(r.method);
  req.target(r.target);
  req.version(11);
  for (const auto& [k, v] : r.headers) req.set(k, v);
  req.body() = r.body;
  req.prepare_payload();
  http::write(socket, req);
  boost::beast::flat_buffer buffer;
  http::response<http::string_body> res;
  http::read(socket, buffer, res);
  return {res.result_int(), std::string(res["X-Amzn-ErrorType"]), res.body()};
}

sigv4::HttpRequest signed_request(const std::string& method, const std::string& target, const std::string& body,
                                  const sigv4::Credentials& creds, sigv4::clock::time_point when = sigv4::clock::now(),
                                  const std::string& amz_target = "") {
  sigv4::HttpRequest r{method, target, {{"Host", "127.0.0.1"}}, body};
  if (!body.empty())
    r.set_header("Content-Type", amz_target.empty() ? "application/json" : "application/x-amz-json-1.1");
  if (!amz_target.empty()) r.set_header("X-Amz-Target", amz_target);
  sigv4::SigningParams p;
  p.time = when;
  sigv4::sign(r, creds, p);
  return r;
}

// The runtime error shape: status, X-Amzn-ErrorType and {"message": non-empty}; returns the message.
std::string runtime_error_of(const test_http::Reply& r, unsigned status, const std::string& type) {
  EXPECT_EQ(r.status, status) << r.body;
  EXPECT_EQ(r.error_type, type) << r.body;
  const json j = json::parse(r.body, nullptr, false);
  EXPECT_TRUE(j.is_object() && j.contains("message") && j["message"].is_string()) << r.body;
  EXPECT_FALSE(j.contains("__type")) << r.body;
  return j.is_object() ? j.value("message", "") : "";
}

// The control-plane error shape: {"__type": type, "Message": non-empty}, HTTP 400 unless said otherwise.
std::string control_error_of(const test_http::Reply& r, const std::string& type, unsigned status = 400) {
  EXPECT_EQ(r.status, status) << r.body;
  EXPECT_EQ(r.error_type, type) << r.body;
  const json j = json::parse(r.body, nullptr, false);
  EXPECT_TRUE(j.is_object()) << r.body;
  if (!j.is_object()) return "";
  EXPECT_EQ(j.value("__type", ""), type) << r.body;
  EXPECT_FALSE(j.value("Message", "").empty()) << r.body;
  return j.value("Message", "");
}

struct BadInput : ::testing::Test {
  void SetUp() override {
    // Tenant a: 8 KiB bodies; tenant b: 1 MiB (so the transport's limit is 1 MiB).
    server::Tenant a{"a", "111122223333", {{kKeyA.access_key_id, kKeyA.secret_access_key}}, {"bearer-a"}, 4, 8192};
    server::Tenant b{"b", "444455556666", {{kKeyB.access_key_id, kKeyB.secret_access_key}}, {"bearer-b"}, 4, 1 << 20};
    server::Options opts;
    opts.tenants = {a, b};
    opts.log = [](const std::string&) {};
    service = std::make_shared<fake::FakeService>();
    srv = std::make_unique<server::Server>(opts, server::make_backend(service));
    srv->start();
  }
  void TearDown() override { srv->stop(); }

  test_http::Client client(const std::string& bearer = "bearer-a") {
    test_http::Client c(srv->port());
    c.use_bearer(bearer);
    return c;
  }

  static json create_body(const std::string& name, const std::string& model = "tiny") {
    return {{"TrainingSessionName", name},
            {"RoleArn", "arn:aws:iam::111122223333:role/MyRole"},
            {"LoraConfig", {{"Rank", 8}, {"Alpha", 16}}},
            {"ModelConfig", {{"BaseModelArn", model}}},
            {"OutputConfig", {{"S3Location", {{"Path", "s3://bucket/prefix/"}}}}}};
  }
  // Creates a session and waits (bounded) until it leaves Created; returns its status.
  static std::string create(test_http::Client& c, const std::string& name, const std::string& model = "tiny") {
    auto r = c.control("CreateTrainingSession", create_body(name, model));
    EXPECT_EQ(r.status, 200u) << r.body;
    return wait_status(c, name, [](const std::string& s) { return s != "Created"; });
  }
  template <class Pred>
  static std::string wait_status(test_http::Client& c, const std::string& name, Pred done) {
    std::string s;
    for (int i = 0; i < 400; ++i) {
      s = c.control("DescribeTrainingSession", {{"TrainingSessionName", name}})
              .json_body()["TrainingSessionDetail"]["TrainingSessionStatus"];
      if (done(s)) return s;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return s;
  }
  static json datum_json(std::vector<token_id> tokens) {
    Datum d;
    d.model_input = ModelInput::from_tokens(tokens);
    d.loss_fn_inputs["target_tokens"] = TensorData::from_tokens(tokens);
    d.loss_fn_inputs["weights"] = TensorData::from_floats(std::vector<float>(tokens.size(), 1.0f));
    return wire::to_json(d);
  }
  static json fb_body(std::int64_t seq) {
    return {{"sequenceNumber", seq},
            {"operationConfig",
             {{"forwardBackward",
               {{"datumList", json::array({datum_json({1, 2, 3})})}, {"lossFnName", "cross_entropy"}}}}}};
  }
  static json sample_body() {
    return {{"operationConfig",
             {{"sample",
               {{"prompt", wire::to_json(ModelInput::from_tokens({1, 2}))},
                {"numSamples", 1},
                {"samplingParams", {{"maxTokens", 2}}}}}}}};
  }
  // A forward_backward that still runs to Completed: the proof that the server kept serving.
  static void still_trains(test_http::Client& c, const std::string& name, std::int64_t seq) {
    auto r = c.post("/v1/training-sessions/" + name + "/operations", fb_body(seq));
    ASSERT_EQ(r.status, 200u) << r.body;
    const std::string url =
        "/v1/training-sessions/" + name + "/operations/" + r.json_body()["operationId"].get<std::string>();
    std::string status;
    for (int i = 0; i < 400 && status != "Completed" && status != "Failed"; ++i) {
      status = c.get(url).json_body()["status"];
      if (status != "Completed") std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    EXPECT_EQ(status, "Completed");
  }

  std::shared_ptr<fake::FakeService> service;
  std::unique_ptr<server::Server> srv;
};

}  // namespace

TEST_F(BadInput, ControlPlaneMalformedJsonAndWrongTypes) {
  auto c = client();
  // Not JSON at all: SerializationException (the JSON 1.1 protocol's name for an unreadable body).
  auto r = c.send("POST", "/", "{\"TrainingSessionName\": ", "SageMaker.CreateTrainingSession");
  EXPECT_NE(control_error_of(r, "SerializationException").find("not valid JSON"), std::string::npos);
  control_error_of(c.send("POST", "/", R"({"MaxResults": 1e999})", "SageMaker.ListTrainingSessions"),
                   "SerializationException");
  // JSON, but not an object.
  EXPECT_EQ(control_error_of(c.send("POST", "/", "[1,2]", "SageMaker.ListTrainingSessions"), "ValidationException"),
            "request body: expected an object");
  // Wrong types, naming the field.
  auto body = create_body("types");
  body["LoraConfig"]["Rank"] = "8";
  EXPECT_EQ(control_error_of(c.control("CreateTrainingSession", body), "ValidationException"),
            "LoraConfig.Rank: expected an integer");
  body = create_body("types");
  body["ModelConfig"]["AcceptEula"] = "yes";
  EXPECT_EQ(control_error_of(c.control("CreateTrainingSession", body), "ValidationException"),
            "ModelConfig.AcceptEula: expected a boolean");
  body = create_body("types");
  body["Tags"] = {{"Key", "k"}};  // an object where an array belongs
  EXPECT_EQ(control_error_of(c.control("CreateTrainingSession", body), "ValidationException"),
            "Tags: expected an array");
  EXPECT_EQ(control_error_of(c.control("ListTrainingSessions", {{"MaxResults", "10"}}), "ValidationException"),
            "MaxResults: expected an integer");
  EXPECT_EQ(control_error_of(c.control("ListTrainingSessions", {{"MaxResults", 0}}), "ValidationException"),
            "MaxResults: must be in [1, 100], got 0");
  EXPECT_EQ(control_error_of(c.control("DescribeTrainingSession", {{"TrainingSessionName", 7}}), "ValidationException"),
            "TrainingSessionName: expected a string");
  // Unknown fields are errors, not silently ignored.
  body = create_body("types");
  body["LoraConfig"]["Dropout"] = 0.1;
  EXPECT_EQ(control_error_of(c.control("CreateTrainingSession", body), "ValidationException"),
            "LoraConfig.Dropout: unknown field");
  // A NextToken that is digits but not a token of ours (too large for any offset).
  EXPECT_EQ(control_error_of(c.control("ListTrainingSessions", {{"NextToken", "99999999999999999999999"}}),
                             "ValidationException"),
            "NextToken: is not a token from a previous page");
  EXPECT_EQ(control_error_of(c.control("ListTrainingSessions", {{"NextToken", "abc"}}), "ValidationException"),
            "NextToken: is not a token from a previous page");
  // None of it created anything, and the connection still serves.
  EXPECT_TRUE(c.control("ListTrainingSessions", json::object()).json_body()["TrainingSessionSummaries"].empty());
  EXPECT_EQ(c.get("/health").status, 200u);
}

TEST_F(BadInput, InvalidSessionNames) {
  auto c = client();
  for (const std::string& bad : {std::string(""), std::string("under_score"), std::string("-lead"), std::string(64, 'x'),
                                std::string("trail-"), std::string("sp ace")}) {
    const std::string m = control_error_of(c.control("CreateTrainingSession", create_body(bad)), "ValidationException");
    EXPECT_EQ(m.rfind("TrainingSessionName: ", 0), 0u) << bad << ": " << m;
    control_error_of(c.control("DescribeTrainingSession", {{"TrainingSessionName", bad}}), "ValidationException");
  }
  ASSERT_EQ(create(c, std::string(63, 'n')), "Running");  // the longest valid name
  // The runtime's URI takes the control plane's rule (rlloop/limits.hpp): a name that cannot exist is a 400.
  EXPECT_EQ(
      runtime_error_of(c.post("/v1/training-sessions/bad_name/operations", fb_body(1)), 400, "ValidationException"),
      "trainingSessionName: does not match [a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}");
  runtime_error_of(c.post("/v1/training-sessions/" + std::string(65, 'n') + "/operations", fb_body(1)), 400,
                   "ValidationException");
  runtime_error_of(c.get("/v1/training-sessions//operations/op-1"), 400, "ValidationException");
  runtime_error_of(c.get("/v1/training-sessions/" + std::string(63, 'n') + "/operations/op_1"), 400,
                   "ValidationException");
  runtime_error_of(c.get("/v1/training-sessions/" + std::string(63, 'n') + "/operations/" + std::string(65, 'o')), 400,
                   "ValidationException");
  // A valid name that does not exist is 404, on the runtime and the pass-through alike.
  runtime_error_of(c.post("/v1/training-sessions/nosuch/sampling-operations", sample_body()), 404,
                   "ResourceNotFoundException");
  control_error_of(c.control("StopTrainingSession", {{"TrainingSessionName", "nosuch"}}), "ResourceNotFound");
  control_error_of(c.control("DeleteTrainingSession", {{"TrainingSessionName", "nosuch"}}), "ResourceNotFound");
  still_trains(c, std::string(63, 'n'), 1);
}

TEST_F(BadInput, RuntimeWrongTypesAndUnknownUnionMembers) {
  auto c = client();
  ASSERT_EQ(create(c, "rt"), "Running");
  const std::string ops = "/v1/training-sessions/rt/operations", sops = "/v1/training-sessions/rt/sampling-operations";
  auto msg = [&](const std::string& url, const json& body) {
    return runtime_error_of(c.post(url, body), 400, "ValidationException");
  };

  EXPECT_EQ(msg(ops, {{"sequenceNumber", "1"}, {"operationConfig", fb_body(1)["operationConfig"]}}),
            "sequenceNumber: expected an integer");
  EXPECT_EQ(msg(ops, {{"sequenceNumber", -1}, {"operationConfig", fb_body(1)["operationConfig"]}}),
            "sequenceNumber: must be in [1, 2147483647], got -1");
  EXPECT_EQ(msg(ops, {{"operationConfig", fb_body(1)["operationConfig"]}}),
            "sequenceNumber: required field is missing");
  EXPECT_EQ(
      msg(ops,
          {{"sequenceNumber", 1}, {"clientToken", "no spaces"}, {"operationConfig", fb_body(1)["operationConfig"]}}),
      "clientToken: must be 1-128 characters of [a-zA-Z0-9-]");
  EXPECT_EQ(msg(ops, {{"sequenceNumber", 1}, {"operationConfig", fb_body(1)["operationConfig"]}, {"extra", 1}}),
            "extra: unknown field");
  // Unions: an unknown member, two members, none, and a member that is not an object.
  EXPECT_EQ(msg(ops, {{"sequenceNumber", 1}, {"operationConfig", {{"flyToTheMoon", json::object()}}}}),
            "operationConfig.flyToTheMoon: unknown member (expected one of forward, forwardBackward, optimizerStep, "
            "saveWeights, "
            "saveState, loadState)");
  EXPECT_NE(msg(ops, {{"sequenceNumber", 1},
                      {"operationConfig",
                       {{"saveState", json::object()}, {"optimizerStep", {{"adamParamsConfig", json::object()}}}}}})
                .find("operationConfig: expected exactly one of"),
            std::string::npos);
  EXPECT_NE(msg(ops, {{"sequenceNumber", 1}, {"operationConfig", json::object()}}).find("(got 0 members)"),
            std::string::npos);
  EXPECT_EQ(msg(ops, {{"sequenceNumber", 1}, {"operationConfig", {{"saveState", "now"}}}}),
            "operationConfig.saveState: expected an object");
  EXPECT_EQ(msg(sops, {{"operationConfig", {{"forwardBackward", json::object()}}}}),
            "operationConfig.forwardBackward: unknown member (expected one of sample, computeLogprobs, "
            "loadWeightsForSampling)");
  // Wrong types and ranges deeper in.
  json fb = fb_body(1);
  fb["operationConfig"]["forwardBackward"]["lossFnName"] = "hinge";
  EXPECT_EQ(msg(ops, fb).rfind("operationConfig.forwardBackward: unknown loss function 'hinge'", 0), 0u);
  fb = fb_body(1);
  fb["operationConfig"]["forwardBackward"]["datumList"] = json::array();
  EXPECT_NE(msg(ops, fb).find("operationConfig.forwardBackward.datumList"), std::string::npos);
  fb = fb_body(1);
  fb["operationConfig"]["forwardBackward"]["lossFnConfig"] = {{"clip_low_threshold", 2.0}};
  EXPECT_NE(msg(ops, fb).find("clip_low_threshold"), std::string::npos);
  json s = sample_body();
  s["operationConfig"]["sample"]["numSamples"] = 0;
  EXPECT_EQ(msg(sops, s), "operationConfig.sample.numSamples: must be in [1, 1000], got 0");
  s = sample_body();
  s["operationConfig"]["sample"]["samplingParams"]["maxTokens"] = 2.5;
  EXPECT_EQ(msg(sops, s), "operationConfig.sample.samplingParams.maxTokens: expected an integer");
  s = sample_body();
  s["operationConfig"]["sample"]["prompt"]["chunks"][0]["type"] = "image";
  EXPECT_NE(msg(sops, s).find("unsupported chunk type 'image'"), std::string::npos);
  // Sampling requests have no sequenceNumber or clientToken.
  s = sample_body();
  s["sequenceNumber"] = 1;
  EXPECT_EQ(msg(sops, s), "sequenceNumber: unknown field");
  // Malformed JSON and an empty body on the runtime.
  EXPECT_EQ(c.send("POST", sops, "{\"operationConfig\": [").error_type, "ValidationException");
  runtime_error_of(c.send("POST", ops, ""), 400, "ValidationException");
  runtime_error_of(c.send("POST", ops, "null"), 400, "ValidationException");
  // A number JSON cannot hold: the parser throws out_of_range, not parse_error, and it is still the client's 400.
  runtime_error_of(c.send("POST", ops, R"({"sequenceNumber": 1e999, "operationConfig": {"saveState": {}}})"), 400,
                   "ValidationException");

  // Nothing was accepted: the session's sequence numbers are untouched and the next real operation runs.
  auto d = c.control("DescribeTrainingSession", {{"TrainingSessionName", "rt"}}).json_body()["TrainingSessionDetail"];
  EXPECT_FALSE(d.contains("LastReceivedSequenceNumber"));
  EXPECT_TRUE(service->sessions().back()->log().empty());
  still_trains(c, "rt", 1);
}

TEST_F(BadInput, OversizedBodies) {
  auto c = client();
  ASSERT_EQ(create(c, "big"), "Running");
  // Over tenant a's 8 KiB: 413 after reading it, and the keep-alive connection goes on.
  runtime_error_of(c.send("POST", "/v1/training-sessions/big/operations", std::string(9000, ' ')), 413,
                   "RequestEntityTooLarge");
  control_error_of(c.send("POST", "/", std::string(9000, ' '), "SageMaker.ListTrainingSessions"),
                   "RequestEntityTooLarge", 413);
  EXPECT_EQ(c.get("/health").status, 200u);
  // Over every tenant's limit (1 MiB): the transport answers 413 from the Content-Length alone, without reading
  // the body, and closes that connection; other connections are unaffected.
  boost::asio::io_context io;
  tcp::socket socket(io);
  socket.connect({boost::asio::ip::make_address("127.0.0.1"), srv->port()});
  const std::string head =
      "POST /v1/training-sessions/big/operations HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer bearer-a\r\n"
      "Content-Type: application/json\r\nContent-Length: 100000000\r\n\r\n{";
  boost::asio::write(socket, boost::asio::buffer(head));
  boost::beast::flat_buffer buffer;
  http::response<http::string_body> res;
  http::read(socket, buffer, res);
  EXPECT_EQ(res.result_int(), 413u);
  EXPECT_EQ(res["X-Amzn-ErrorType"], "RequestEntityTooLarge");
  EXPECT_TRUE(json::parse(res.body()).contains("message"));
  EXPECT_FALSE(res.keep_alive());
  still_trains(c, "big", 1);
}

TEST_F(BadInput, CallsInTheWrongSessionState) {
  auto c = client();
  ASSERT_EQ(create(c, "st"), "Running");
  still_trains(c, "st", 1);
  // Running: cannot be deleted.
  control_error_of(c.control("DeleteTrainingSession", {{"TrainingSessionName", "st"}}), "ResourceInUse");
  ASSERT_EQ(c.control("StopTrainingSession", {{"TrainingSessionName", "st"}}).status, 200u);
  ASSERT_EQ(wait_status(c, "st", [](const std::string& s) { return s == "Stopped"; }), "Stopped");
  // Stopped: every operation kind is a 409 ConflictException naming the state; reading old results still works.
  const std::string why = "Training session st is Stopped; must be Running or Blocked";
  EXPECT_EQ(runtime_error_of(c.post("/v1/training-sessions/st/operations", fb_body(2)), 409, "ConflictException"), why);
  EXPECT_EQ(
      runtime_error_of(c.post("/v1/training-sessions/st/sampling-operations", sample_body()), 409, "ConflictException"),
      why);
  auto chat = c.post("/v1/chat/completions",
                     {{"model", "st"}, {"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"max_tokens", 2}});
  EXPECT_EQ(chat.status, 409u) << chat.body;
  EXPECT_EQ(chat.error_type, "ConflictException");
  EXPECT_TRUE(chat.json_body().contains("error"));
  EXPECT_EQ(c.get("/v1/training-sessions/st/operations/op-nope").status, 404u);
  // Stopping again is harmless; deleting now works; then it is gone for every call.
  EXPECT_EQ(c.control("StopTrainingSession", {{"TrainingSessionName", "st"}}).status, 200u);
  EXPECT_EQ(c.control("DeleteTrainingSession", {{"TrainingSessionName", "st"}}).status, 200u);
  control_error_of(c.control("DeleteTrainingSession", {{"TrainingSessionName", "st"}}), "ResourceNotFound");
  runtime_error_of(c.post("/v1/training-sessions/st/operations", fb_body(3)), 404, "ResourceNotFoundException");

  // Failed (the base model cannot be loaded): 409 too, and it can be deleted without a Stop.
  ASSERT_EQ(create(c, "broken", "missing"), "Failed");
  EXPECT_EQ(runtime_error_of(c.post("/v1/training-sessions/broken/operations", fb_body(1)), 409, "ConflictException"),
            "Training session broken is Failed; must be Running or Blocked");
  runtime_error_of(c.get("/v1/training-sessions/broken/info"), 409, "ConflictException");
  EXPECT_EQ(c.control("DeleteTrainingSession", {{"TrainingSessionName", "broken"}}).status, 200u);

  ASSERT_EQ(create(c, "after"), "Running");
  still_trains(c, "after", 1);
}

TEST_F(BadInput, UnknownPathsMethodsAndTargets) {
  auto c = client();
  ASSERT_EQ(create(c, "p"), "Running");
  const std::uint16_t port = srv->port();
  auto bearer = [](std::string method, std::string target, std::string body = "") {
    return sigv4::HttpRequest{std::move(method),
                              std::move(target),
                              {{"Host", "127.0.0.1"}, {"Authorization", "Bearer bearer-a"}},
                              std::move(body)};
  };
  // Unknown REST paths and methods: 404 ResourceNotFoundException naming the route.
  EXPECT_EQ(runtime_error_of(raw(port, bearer("GET", "/nope")), 404, "ResourceNotFoundException"),
            "no route for GET /nope");
  runtime_error_of(raw(port, bearer("GET", "/v1/training-sessions")), 404, "ResourceNotFoundException");
  runtime_error_of(raw(port, bearer("GET", "/v1/training-sessions/p/whatever")), 404, "ResourceNotFoundException");
  runtime_error_of(raw(port, bearer("GET", "/v1/training-sessions/p/operations/op-1/extra")), 404,
                   "ResourceNotFoundException");
  runtime_error_of(raw(port, bearer("DELETE", "/v1/training-sessions/p/operations")), 404, "ResourceNotFoundException");
  runtime_error_of(raw(port, bearer("PUT", "/v1/usage")), 404, "ResourceNotFoundException");
  runtime_error_of(raw(port, bearer("GET", "/v1/training-sessions/p/operations")), 404, "ResourceNotFoundException");
  runtime_error_of(raw(port, bearer("POST", "/v1/training-sessions/p/info", "{}")), 404, "ResourceNotFoundException");
  // Control plane: an X-Amz-Target on another method/path, or naming no operation of ours.
  auto target = [&](std::string method, std::string path, std::string amz) {
    auto r = bearer(std::move(method), std::move(path), "{}");
    r.set_header("X-Amz-Target", std::move(amz));
    return raw(port, r);
  };
  EXPECT_EQ(control_error_of(target("GET", "/", "SageMaker.ListTrainingSessions"), "UnknownOperationException"),
            "control-plane calls are POST /");
  control_error_of(target("POST", "/v1/usage", "SageMaker.ListTrainingSessions"), "UnknownOperationException");
  EXPECT_EQ(control_error_of(target("POST", "/", "Other.ListTrainingSessions"), "UnknownOperationException"),
            "unknown operation 'Other.ListTrainingSessions'");
  control_error_of(target("POST", "/", "SageMaker."), "UnknownOperationException");
  control_error_of(target("POST", "/", "SageMaker.CreateTrainingJob"), "UnknownOperationException");
  // OpenAI paths answer in OpenAI's shape (plus "message" and the error header).
  auto m = c.post("/v1/chat/completions", {{"model", "nosuch"}, {"messages", {{{"role", "user"}, {"content", "x"}}}}});
  EXPECT_GE(m.status, 400u);
  EXPECT_LT(m.status, 500u);
  EXPECT_FALSE(m.error_type.empty());
  EXPECT_TRUE(m.json_body()["error"].contains("message"));
  still_trains(c, "p", 1);
}

TEST_F(BadInput, SigV4TamperedExpiredOrOtherTenantIsRejected) {
  const std::uint16_t port = srv->port();
  // Good signature first, so the rejections below are about what was changed.
  auto ok = raw(port, signed_request("POST", "/", create_body("sig").dump(), kKeyA, sigv4::clock::now(),
                                     "SageMaker.CreateTrainingSession"));
  ASSERT_EQ(ok.status, 200u) << ok.body;

  // Tampered body after signing (the payload hash is part of the signature): control-plane shape.
  auto req = signed_request("POST", "/", json{{"TrainingSessionName", "sig"}}.dump(), kKeyA, sigv4::clock::now(),
                            "SageMaker.DescribeTrainingSession");
  req.body = json{{"TrainingSessionName", "siG"}}.dump();
  control_error_of(raw(port, req), "SignatureDoesNotMatch", 403);
  // Tampered path and header on the runtime: runtime shape.
  req = signed_request("GET", "/v1/usage", "", kKeyA);
  req.target = "/v1/base-models";
  runtime_error_of(raw(port, req), 403, "SignatureDoesNotMatch");
  req = signed_request("GET", "/v1/usage", "", kKeyA);
  req.set_header("X-Amz-Date", sigv4::format_amz_date(sigv4::clock::now() + std::chrono::seconds(1)));
  runtime_error_of(raw(port, req), 403, "SignatureDoesNotMatch");
  // Expired: signed 20 minutes ago (the server allows 15 minutes of skew), and dated 20 minutes ahead.
  EXPECT_NE(runtime_error_of(raw(port, signed_request("GET", "/v1/usage", "", kKeyA,
                                                      sigv4::clock::now() - std::chrono::minutes(20))),
                             403, "InvalidSignatureException")
                .find("Signature expired"),
            std::string::npos);
  runtime_error_of(
      raw(port, signed_request("GET", "/v1/usage", "", kKeyA, sigv4::clock::now() + std::chrono::minutes(20))), 403,
      "InvalidSignatureException");
  control_error_of(raw(port, signed_request("POST", "/", "{}", kKeyA, sigv4::clock::now() - std::chrono::hours(2),
                                            "SageMaker.ListTrainingSessions")),
                   "InvalidSignatureException", 403);
  // Unknown access key; a known key with the other tenant's secret.
  runtime_error_of(raw(port, signed_request("GET", "/v1/usage", "", {"AKIDNOBODY", "x", ""})), 403,
                   "UnrecognizedClientException");
  runtime_error_of(
      raw(port, signed_request("GET", "/v1/usage", "", {kKeyA.access_key_id, kKeyB.secret_access_key, ""})), 403,
      "SignatureDoesNotMatch");
  // Signature stripped down / malformed.
  req = signed_request("GET", "/v1/usage", "", kKeyA);
  req.set_header("Authorization",
                 req.header("Authorization")->substr(0, req.header("Authorization")->find(", Signature=")));
  runtime_error_of(raw(port, req), 403, "IncompleteSignature");
  // A valid signature by tenant b reaches nothing of tenant a's: the session is "not found", not "forbidden".
  control_error_of(raw(port, signed_request("POST", "/", json{{"TrainingSessionName", "sig"}}.dump(), kKeyB,
                                            sigv4::clock::now(), "SageMaker.DescribeTrainingSession")),
                   "ResourceNotFound");
  control_error_of(raw(port, signed_request("POST", "/", json{{"TrainingSessionName", "sig"}}.dump(), kKeyB,
                                            sigv4::clock::now(), "SageMaker.StopTrainingSession")),
                   "ResourceNotFound");
  runtime_error_of(raw(port, signed_request("POST", "/v1/training-sessions/sig/operations", fb_body(1).dump(), kKeyB)),
                   404, "ResourceNotFoundException");
  // Tenant a's session is untouched by all of the above and still runs signed work.
  auto a = client();
  ASSERT_EQ(wait_status(a, "sig", [](const std::string& s) { return s != "Created"; }), "Running");
  auto fb = raw(port, signed_request("POST", "/v1/training-sessions/sig/operations", fb_body(1).dump(), kKeyA));
  EXPECT_EQ(fb.status, 200u) << fb.body;
  still_trains(a, "sig", 2);
  EXPECT_EQ(service->sessions().back()->log(), (std::vector<std::string>{"forward_backward", "forward_backward"}));
}
