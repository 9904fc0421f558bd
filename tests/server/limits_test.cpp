// One validity layer (rlloop/limits.hpp), table-driven: every sampling and session bound, just outside, is refused
// at submission with a 400 that names the field on every entry point — the SageMaker runtime's sampling operation,
// OpenAI's /v1/chat/completions and /v1/completions, the control plane's CreateTrainingSession, and the remote
// session before it sends (no request reaches the server) — and the bound itself is accepted. What needs the
// model (prompt + max tokens against its context, token ids against its vocabulary) is a 400 at submission too.
// In-process server, fake service, loopback.
#include <gtest/gtest.h>

#include <atomic>
#include <functional>

#include <rlloop/limits.hpp>
#include <rlloop/remote.hpp>

#include "fake_service.hpp"
#include "remote/remote_client.hpp"
#include "server/server.hpp"
#include "test_client.hpp"

using namespace rlloop;
using test_http::json;

namespace {

// A sampling bound: the value to set, whether it is inside, and how each entry point spells the field.
enum class Key { max_tokens, temperature, top_k, top_p, num_samples, topk_prompt_logprobs };

struct Case {
  Key key;
  double value;
  bool ok;
};

struct Spellings {
  const char* cpp;     // C++ (RemoteSession, the engine)
  const char* wire;    // SageMaker runtime, after operationConfig.sample.
  const char* openai;  // OpenAI's API; nullptr: OpenAI has no such field
};

Spellings spell(Key k) {
  switch (k) {
    case Key::max_tokens:
      return {"SamplingParams.max_tokens", "samplingParams.maxTokens", "max_tokens"};
    case Key::temperature:
      return {"SamplingParams.temperature", "samplingParams.temperature", "temperature"};
    case Key::top_k:
      return {"SamplingParams.top_k", "samplingParams.topK", nullptr};
    case Key::top_p:
      return {"SamplingParams.top_p", "samplingParams.topP", "top_p"};
    case Key::num_samples:
      return {"SampleRequest.num_samples", "numSamples", "n"};
    case Key::topk_prompt_logprobs:
      return {"SampleRequest.topk_prompt_logprobs", "topkPromptLogprobs", nullptr};
  }
  return {};
}

// Each bound just outside and at itself, from the table (so the test moves with it).
std::vector<Case> cases() {
  namespace L = limits;
  return {
      {Key::max_tokens, L::max_tokens_min - 1, false},
      {Key::max_tokens, L::max_tokens_min, true},
      {Key::max_tokens, L::max_tokens_max, true},
      {Key::max_tokens, L::max_tokens_max + 1, false},
      {Key::temperature, L::temperature_min - 1e-3, false},
      {Key::temperature, L::temperature_min, true},
      {Key::temperature, L::temperature_max, true},
      {Key::temperature, L::temperature_max + 1e-3, false},
      {Key::top_k, L::top_k_min - 1, false},
      {Key::top_k, L::top_k_min, true},
      {Key::top_p, 0.0, false},  // the lower bound is open: (0, top_p_max]
      {Key::top_p, 1e-9, true},
      {Key::top_p, L::top_p_max, true},
      {Key::top_p, L::top_p_max + 1e-3, false},
      {Key::num_samples, L::num_samples_min - 1, false},
      {Key::num_samples, L::num_samples_min, true},
      {Key::num_samples, L::num_samples_max, true},
      {Key::num_samples, L::num_samples_max + 1, false},
      {Key::topk_prompt_logprobs, -1, false},
      {Key::topk_prompt_logprobs, 0, true},
      {Key::topk_prompt_logprobs, L::topk_prompt_logprobs_max, true},
      {Key::topk_prompt_logprobs, L::topk_prompt_logprobs_max + 1, false},
  };
}

std::string describe(const Case& c) {
  return std::string(spell(c.key).cpp) + " = " + json(c.value).dump() + (c.ok ? " (at the bound)" : " (outside)");
}

// Small defaults beside the value under test, so that an accepted request is cheap.
SampleRequest cpp_request(const Case& c) {
  SampleRequest r{ModelInput::from_tokens({1, 2, 3, 4}), 1, SamplingParams{.max_tokens = 2}};
  const auto i = static_cast<int>(c.value);
  switch (c.key) {
    case Key::max_tokens:
      r.params.max_tokens = i;
      break;
    case Key::temperature:
      r.params.temperature = c.value;
      break;
    case Key::top_k:
      r.params.top_k = i;
      break;
    case Key::top_p:
      r.params.top_p = c.value;
      break;
    case Key::num_samples:
      r.num_samples = i;
      break;
    case Key::topk_prompt_logprobs:
      r.topk_prompt_logprobs = i;
      break;
  }
  return r;
}

json wire_body(const Case& c) {
  json sample{{"prompt", {{"chunks", {{{"type", "encoded_text"}, {"tokens", {1, 2, 3, 4}}}}}}},
              {"numSamples", 1},
              {"samplingParams", {{"maxTokens", 2}}}};
  const bool integral = c.key != Key::temperature && c.key != Key::top_p;
  const json v = integral ? json(static_cast<std::int64_t>(c.value)) : json(c.value);
  const std::string field = spell(c.key).wire;
  if (field.rfind("samplingParams.", 0) == 0)
    sample["samplingParams"][field.substr(std::string("samplingParams.").size())] = v;
  else
    sample[field] = v;
  return {{"operationConfig", {{"sample", sample}}}};
}

json openai_body(const Case& c, bool chat, const std::string& model) {
  json body{{"model", model}, {"max_tokens", 2}};
  if (chat)
    body["messages"] = {{{"role", "user"}, {"content", "hi"}}};
  else
    body["prompt"] = {1, 2, 3, 4};
  const bool integral = c.key != Key::temperature && c.key != Key::top_p;
  body[spell(c.key).openai] = integral ? json(static_cast<std::int64_t>(c.value)) : json(c.value);
  return body;
}

std::string message_of(const test_http::Reply& r) {
  const json j = json::parse(r.body, nullptr, false);
  if (!j.is_object()) return "";
  if (j.contains("Message")) return j.value("Message", "");
  return j.value("message", "");
}

struct Limits : ::testing::Test {
  void SetUp() override {
    server::Options opts;
    opts.tenants = {server::Tenant{"a", "111122223333", {}, {"bearer-a"}, 64, 1 << 20}};
    opts.log = [this](const std::string&) { ++requests; };  // one line per request answered
    service = std::make_shared<fake::FakeService>();
    srv = std::make_unique<server::Server>(opts, server::make_backend(service));
    srv->start();
  }
  void TearDown() override { srv->stop(); }

  test_http::Client client() {
    test_http::Client c(srv->port());
    c.use_bearer("bearer-a");
    return c;
  }
  RemoteOptions remote_options() const {
    RemoteOptions o;
    o.endpoint = "http://127.0.0.1:" + std::to_string(srv->port());
    o.bearer_key = "bearer-a";
    return o;
  }
  static json create_body(const std::string& name, const std::string& model = "tiny", int rank = 8, int alpha = 16) {
    return {{"TrainingSessionName", name},
            {"RoleArn", "arn:aws:iam::111122223333:role/MyRole"},
            {"LoraConfig", {{"Rank", rank}, {"Alpha", alpha}}},
            {"ModelConfig", {{"BaseModelArn", model}}},
            {"OutputConfig", {{"S3Location", {{"Path", "s3://bucket/prefix/"}}}}}};
  }
  // Creates a session and waits (bounded) until it is Running.
  void running(test_http::Client& c, const std::string& name, const std::string& model = "tiny") {
    ASSERT_EQ(c.control("CreateTrainingSession", create_body(name, model)).status, 200u);
    for (int i = 0; i < 400; ++i) {
      auto d = c.control("DescribeTrainingSession", {{"TrainingSessionName", name}}).json_body();
      if (d["TrainingSessionDetail"]["TrainingSessionStatus"] == "Running") return;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    FAIL() << name << " never ran";
  }

  std::atomic<int> requests{0};
  std::shared_ptr<fake::FakeService> service;
  std::unique_ptr<server::Server> srv;
};

// Expects a 400 whose message starts with `field` + ": " (the error of that field, not another's).
void expect_rejected(const test_http::Reply& r, const std::string& field, const std::string& where) {
  EXPECT_EQ(r.status, 400u) << where << ": " << r.body;
  EXPECT_EQ(message_of(r).rfind(field + ": ", 0), 0u) << where << ": " << r.body;
}

TEST_F(Limits, EverySamplingBoundOnEveryEntryPoint) {
  auto c = client();
  running(c, "lim");
  RemoteSession session(std::make_shared<detail::RemoteClient>(remote_options()), "lim");
  const std::string sops = "/v1/training-sessions/lim/sampling-operations";

  for (const Case& k : cases()) {
    const std::string what = describe(k);
    const Spellings f = spell(k.key);
    // The SageMaker runtime: ExecuteSamplingOperation.
    const auto wire = c.post(sops, wire_body(k));
    if (k.ok) {
      EXPECT_EQ(wire.status, 200u) << "runtime, " << what << ": " << wire.body;
    } else {
      expect_rejected(wire, "operationConfig.sample." + std::string(f.wire), "runtime, " + what);
      EXPECT_EQ(wire.error_type, "ValidationException") << what;
    }
    // OpenAI's chat and completions (the fields OpenAI has).
    if (f.openai) {
      for (const bool chat : {true, false}) {
        const char* route = chat ? "/v1/chat/completions" : "/v1/completions";
        const auto r = c.post(route, openai_body(k, chat, "lim"));
        if (k.ok) {
          EXPECT_EQ(r.status, 200u) << route << ", " << what << ": " << r.body.substr(0, 300);
        } else {
          expect_rejected(r, f.openai, std::string(route) + ", " + what);
          EXPECT_EQ(r.error_type, "invalid_request_error") << what;
          EXPECT_EQ(json::parse(r.body)["error"]["type"], "invalid_request_error") << what;
        }
      }
      // SageMaker's SampleTrainingSession (OpenAI's body on the runtime): ValidationException.
      const auto pass = c.post("/training-sessions/lim/sample", openai_body(k, false, "lim"));
      if (k.ok)
        EXPECT_EQ(pass.status, 200u) << "pass-through, " << what << ": " << pass.body.substr(0, 300);
      else {
        expect_rejected(pass, f.openai, "pass-through, " + what);
        EXPECT_EQ(pass.error_type, "ValidationException") << what;
      }
    }
    // The remote session: refused before it sends (no request reaches the server), or sent and answered.
    if (!k.ok) {
      const int before = requests.load();
      try {
        session.sample(cpp_request(k)).get();
        ADD_FAILURE() << "remote, " << what << ": accepted";
      } catch (const invalid_argument& e) {
        EXPECT_EQ(std::string(e.what()).rfind(std::string(f.cpp) + ": ", 0), 0u) << what << ": " << e.what();
      }
      EXPECT_EQ(requests.load(), before) << "remote, " << what << ": a request reached the server";
    } else if (k.key != Key::max_tokens || k.value < 1000) {  // the fake answers 131072 tokens; the wire showed it
      EXPECT_NO_THROW(session.sample(cpp_request(k)).get()) << "remote, " << what;
    }
    // The same function in C++ (what the engine calls).
    if (k.ok)
      EXPECT_NO_THROW(validate(cpp_request(k))) << what;
    else
      EXPECT_THROW(validate(cpp_request(k)), invalid_argument) << what;
  }
}

// What needs the model is known at submission (the session's context and vocabulary): a 400 naming the field,
// not an operation that Fails later. The fake's "short" model has 64 positions and 257 tokens.
TEST_F(Limits, PromptPlusMaxTokensAgainstTheContextAtSubmission) {
  auto c = client();
  running(c, "ctx", "short");
  const std::string sops = "/v1/training-sessions/ctx/sampling-operations";
  auto wire = [](int max_tokens, json stop_ids = json::array()) {
    json params{{"maxTokens", max_tokens}};
    if (!stop_ids.empty()) params["stopTokenIds"] = stop_ids;
    return json{{"operationConfig",
                 {{"sample",
                   {{"prompt", {{"chunks", {{{"type", "encoded_text"}, {"tokens", {1, 2, 3, 4}}}}}}},
                    {"numSamples", 1},
                    {"samplingParams", params}}}}}};
  };
  EXPECT_EQ(c.post(sops, wire(60)).status, 200u);  // 4 + 60 = 64: fits exactly
  const auto over = c.post(sops, wire(61));
  expect_rejected(over, "operationConfig.sample.samplingParams.maxTokens", "runtime, 4 + 61 > 64");
  EXPECT_NE(message_of(over).find("context of 64"), std::string::npos) << over.body;
  expect_rejected(c.post(sops, wire(2, {257})), "operationConfig.sample.samplingParams.stopTokenIds",
                  "runtime, stop id 257 of 257");
  EXPECT_EQ(c.post(sops, wire(2, {256})).status, 200u);

  const json completion{{"model", "ctx"}, {"prompt", {1, 2, 3, 4}}, {"max_tokens", 60}};
  EXPECT_EQ(c.post("/v1/completions", completion).status, 200u);
  json too_long = completion;
  too_long["max_tokens"] = 61;
  expect_rejected(c.post("/v1/completions", too_long), "max_tokens", "completions, 4 + 61 > 64");
  expect_rejected(c.post("/v1/completions", json{{"model", "ctx"}, {"prompt", {1, 300}}}), "prompt",
                  "completions, token 300 of 257");
  // A chat prompt is rendered first; whatever its length, 64 new tokens beside it cannot fit.
  const json chat{{"model", "ctx"}, {"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"max_tokens", 64}};
  expect_rejected(c.post("/v1/chat/completions", chat), "max_tokens", "chat, prompt + 64 > 64");
  expect_rejected(c.post("/training-sessions/ctx/sample", too_long), "max_tokens", "pass-through, 4 + 61 > 64");

  // The remote session cannot know the context; the server refuses it at submission, naming the wire's field.
  RemoteSession session(std::make_shared<detail::RemoteClient>(remote_options()), "ctx");
  try {
    session.sample(SampleRequest{ModelInput::from_tokens({1, 2, 3, 4}), 1, SamplingParams{.max_tokens = 61}}).get();
    ADD_FAILURE() << "remote: accepted 4 + 61 > 64";
  } catch (const remote_error& e) {
    EXPECT_NE(std::string(e.what()).find("samplingParams.maxTokens: "), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(
      session.sample(SampleRequest{ModelInput::from_tokens({1, 2, 3, 4}), 1, SamplingParams{.max_tokens = 60}}).get());
}

// Session bounds: CreateTrainingSession on the control plane, and RemoteService::create_session before it sends.
TEST_F(Limits, EverySessionBoundOnEveryEntryPoint) {
  namespace L = limits;
  struct SessionCase {
    const char* what;
    std::function<void(json&)> set_wire;
    std::function<void(SessionOptions&)> set_cpp;
    bool ok;
    const char* wire_field;
    const char* cpp_field;
  };
  int next = 0;
  auto name = [&] { return "s" + std::to_string(next++); };
  const std::string longest(L::session_name_max, 'n');
  const std::string too_long(L::session_name_max + 1, 'n');
  auto rank = [](int r) {
    return SessionCase{"rank",
                       [r](json& b) { b["LoraConfig"]["Rank"] = r; },
                       [r](SessionOptions& o) { o.lora->rank = r; },
                       r >= L::lora_rank_min && r <= L::lora_rank_max,
                       "LoraConfig.Rank",
                       "LoraOptions.rank"};
  };
  auto alpha = [](std::int64_t a) {
    return SessionCase{"alpha",
                       [a](json& b) { b["LoraConfig"]["Alpha"] = a; },
                       [a](SessionOptions& o) { o.lora->alpha = static_cast<int>(a); },
                       a >= L::lora_alpha_min,
                       "LoraConfig.Alpha",
                       "LoraOptions.alpha"};
  };
  auto named = [](std::string n, bool ok) {
    return SessionCase{"name",
                       [n](json& b) { b["TrainingSessionName"] = n; },
                       [n](SessionOptions& o) { o.name = n; },
                       ok,
                       "TrainingSessionName",
                       "SessionOptions.name"};
  };
  const std::vector<SessionCase> table = {
      rank(L::lora_rank_min - 1),   rank(L::lora_rank_min),   rank(L::lora_rank_max),      rank(L::lora_rank_max + 1),
      alpha(L::lora_alpha_min - 1), alpha(L::lora_alpha_min), alpha(L::lora_alpha_max),    named(longest, true),
      named(too_long, false),       named("-lead", false),    named("under_score", false),
  };

  auto c = client();
  RemoteService remote(remote_options());
  for (const SessionCase& k : table) {
    const std::string what = std::string(k.what) + (k.ok ? " at the bound" : " outside");
    // The control plane.
    json body = create_body(name());
    k.set_wire(body);
    const auto r = c.control("CreateTrainingSession", body);
    if (k.ok) {
      EXPECT_EQ(r.status, 200u) << what << ": " << r.body;
      c.control("StopTrainingSession", {{"TrainingSessionName", body["TrainingSessionName"]}});
    } else {
      expect_rejected(r, k.wire_field, "CreateTrainingSession, " + what);
      EXPECT_EQ(r.error_type, "ValidationException") << what;
    }
    // The remote service, before it sends.
    SessionOptions o{.base_model = "tiny", .lora = LoraOptions{8, 16, {"all-linear"}}, .name = name()};
    k.set_cpp(o);
    if (k.ok) {
      if (o.name == longest) o.name = std::string(L::session_name_max - 1, 'm') + "r";  // taken just above
      EXPECT_NO_THROW(remote.create_session(o)) << "remote, " << what;
    } else {
      const int before = requests.load();
      try {
        remote.create_session(o);
        ADD_FAILURE() << "remote, " << what << ": accepted";
      } catch (const invalid_argument& e) {
        EXPECT_EQ(std::string(e.what()).rfind(std::string(k.cpp_field) + ": ", 0), 0u) << what << ": " << e.what();
      }
      EXPECT_EQ(requests.load(), before) << "remote, " << what << ": a request reached the server";
    }
  }
  // The runtime's URI takes the same name rule as the control plane (one rule, one limit).
  EXPECT_EQ(c.get("/v1/training-sessions/" + longest + "/operations/op-1").status, 404u);
  expect_rejected(c.get("/v1/training-sessions/" + too_long + "/operations/op-1"), "trainingSessionName",
                  "runtime URI");
  expect_rejected(c.post("/training-sessions/" + too_long + "/sample", json{{"prompt", {1}}}), "trainingSessionName",
                  "pass-through URI");
}

}  // namespace
