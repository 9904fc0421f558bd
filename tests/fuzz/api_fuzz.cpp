// Fuzz target for the server's protocol layer: raw bytes become one to four HTTP requests (method, target,
// headers, body) that go straight into rlloop::server::Api::handle, no sockets, against an Api hosting a
// Running session "s" (tenant a) of an instant in-memory service. Besides memory errors (ASan/UBSan in the libFuzzer
// build), every answer must keep the protocol's promises, or the target aborts:
//   * no 5xx: the service never fails internally, so a 500 means a request slipped past validation;
//   * an error carries X-Amzn-ErrorType and the documented body shape: {"__type","Message"} for the control plane,
//     {"error":{...},"message"} for the OpenAI paths, {"error","category"} for Tinker's (/api/v1/), {"message"} for
//     the rest of the runtime;
//   * a 200 JSON answer parses as JSON.
//
// Input format (what tests/fuzz/corpus/ holds; see README.md):
//   METHOD TARGET\n
//   Header-Name: value\n      (any number; "Authorization: Bearer fuzz-a" is added when none is given)
//   \n
//   body
// and further requests after a line "---next---".
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include <rlloop/session.hpp>

#include "server/server.hpp"

namespace {

using namespace rlloop;
using nlohmann::json;

// Answers every operation at once from its inputs; samples are capped at 4 tokens so that numSamples=1000,
// maxTokens=131072 costs nothing. Base model "missing" cannot be created; "poison" fails every batch.
class TinySession {
 public:
  explicit TinySession(SessionOptions o) : opts_(std::move(o)) {}
  Future<ForwardBackwardOutput> forward(const std::vector<Datum>& d, const LossSpec&) { return batch(d); }
  Future<ForwardBackwardOutput> forward_backward(const std::vector<Datum>& d, const LossSpec&) { return batch(d); }
  Future<ForwardBackwardOutput> forward_backward_custom(const std::vector<Datum>& d, const CustomLossFn&) {
    return batch(d);
  }
  Future<OptimStepOutput> optim_step(const AdamParams& a) {
    return Future<OptimStepOutput>::ready(OptimStepOutput{{{"step", double(++step_)}, {"lr", a.learning_rate}}});
  }
  Future<CheckpointRef> save_state(const std::string& name) { return Future<CheckpointRef>::ready({"/tiny/" + name}); }
  Future<LoadStateOutput> load_state(const std::string&, bool) { return Future<LoadStateOutput>::ready({}); }
  Future<CheckpointRef> save_weights_for_sampler(const std::string& name) {
    return Future<CheckpointRef>::ready({"/tiny/" + name});
  }
  Future<SampleResponse> sample(const SampleRequest& r) {
    SampleResponse out;
    const auto prompt = r.prompt.tokens();
    for (int s = 0; s < r.num_samples; ++s) {
      SampledSequence seq;
      for (int k = 1; k <= std::min(r.params.max_tokens, 4); ++k) {
        seq.tokens.push_back(static_cast<token_id>((97 + k + s) % 256));
        seq.logprobs.push_back(-0.5);
      }
      seq.prefill_tokens = static_cast<std::int64_t>(prompt.size());
      seq.decode_tokens = static_cast<std::int64_t>(seq.tokens.size());
      out.sequences.push_back(seq);
    }
    if (r.include_prompt_logprobs) out.prompt_logprobs = std::vector<double>(prompt.size(), -0.25);
    return Future<SampleResponse>::ready(out);
  }
  Future<std::vector<double>> compute_logprobs(const ComputeLogprobsRequest& r) {
    return Future<std::vector<double>>::ready(std::vector<double>(r.prompt.tokens().size(), -0.25));
  }
  SessionInfo info() {
    SessionInfo i;
    i.name = opts_.name;
    i.base_model = opts_.base_model;
    i.lora = opts_.lora;
    i.vocab_size = 256;
    i.tokenizer = "byte";
    i.step = step_;
    return i;
  }
  TokenUsage usage() { return {}; }

 private:
  Future<ForwardBackwardOutput> batch(const std::vector<Datum>& data) {
    if (opts_.base_model == "poison")
      return Future<ForwardBackwardOutput>::failed(std::make_exception_ptr(invalid_argument("poisoned")));
    ForwardBackwardOutput out;
    for (const auto& d : data) {
      out.loss_fn_outputs.push_back(
          {{"logprobs", TensorData::from_floats(std::vector<float>(d.model_input.length(), -0.1f))}});
      out.training_tokens += static_cast<std::int64_t>(d.model_input.length());
    }
    out.metrics["loss:sum"] = 0.1 * static_cast<double>(out.training_tokens);
    return Future<ForwardBackwardOutput>::ready(out);
  }
  SessionOptions opts_;
  std::int64_t step_ = 0;
};

class TinyService {
 public:
  using session_type = TinySession;
  std::shared_ptr<TinySession> create_session(const SessionOptions& o) {
    if (o.base_model == "missing") throw not_found("base model 'missing' is not in the catalogue");
    return std::make_shared<TinySession>(o);
  }
  std::shared_ptr<TinySession> create_session_from_state(const std::string&, const SessionOptions& o) {
    return create_session(o);
  }
  std::shared_ptr<TinySession> open_sampler(const std::string&) { return create_session({}); }
  std::vector<std::string> list_base_models() { return {"tiny", "poison"}; }
  ServerCapabilities capabilities() { return {{"tiny", "poison"}, {"cross_entropy", "ppo"}, false, 64}; }
};
static_assert(Service<TinyService>);

[[noreturn]] void violated(const sigv4::HttpRequest& req, const server::Response& res, const std::string& what) {
  std::fprintf(stderr, "api_fuzz: %s\nrequest: %s %s\n", what.c_str(), req.method.c_str(), req.target.c_str());
  for (const auto& [k, v] : req.headers) std::fprintf(stderr, "  %s: %s\n", k.c_str(), v.c_str());
  std::fprintf(stderr, "  body (%zu bytes): %.300s\nresponse %u: %.600s\n", req.body.size(), req.body.c_str(),
               res.status, res.body.c_str());
  std::abort();
}

std::string header_of(const server::Response& res, std::string_view name) {
  for (const auto& [k, v] : res.headers)
    if (k.size() == name.size() &&
        std::equal(k.begin(), k.end(), name.begin(), [](char a, char b) { return std::tolower(a) == std::tolower(b); }))
      return v;
  return "";
}

void check(const sigv4::HttpRequest& req, server::Response& res) {
  if (res.status < 200 || res.status >= 600) violated(req, res, "status out of range");
  if (res.status >= 500) violated(req, res, "5xx answer (an input reached an unexpected exception)");
  if (header_of(res, "x-amzn-RequestId").empty()) violated(req, res, "no x-amzn-RequestId");
  if (res.stream) {
    // Drain a streamed answer (server-sent events), bounded.
    std::size_t total = 0;
    res.stream([&](std::string_view piece) { return (total += piece.size()) < (1u << 20); });
    return;
  }
  if (res.status >= 400) {
    const std::string type = header_of(res, "X-Amzn-ErrorType");
    if (type.empty()) violated(req, res, "error without X-Amzn-ErrorType");
    const json body = json::parse(res.body, nullptr, false);
    if (!body.is_object()) violated(req, res, "error body is not a JSON object");
    const std::string path = req.target.substr(0, req.target.find('?'));
    if (req.header("X-Amz-Target")) {
      if (body.value("__type", "") != type || !body.contains("Message") || !body["Message"].is_string())
        violated(req, res, "control-plane error body is not {\"__type\",\"Message\"}");
    } else if (path.rfind("/api/v1/", 0) == 0) {  // Tinker's routes: what the tinker SDK reads
      if (!body.contains("error") || !body["error"].is_string() || body.value("category", "") != "user")
        violated(req, res, "Tinker error body is not {\"error\", \"category\": \"user\"}");
    } else if (!body.contains("message") || !body["message"].is_string()) {
      violated(req, res, "runtime error body has no \"message\"");
    }
    return;
  }
  if (res.content_type.find("json") != std::string::npos && json::parse(res.body, nullptr, false).is_discarded())
    violated(req, res, "200 answer is not JSON");
}

sigv4::HttpRequest parse_one(std::string_view text) {
  sigv4::HttpRequest r;
  auto line = [&]() {
    const auto nl = text.find('\n');
    std::string_view l = text.substr(0, nl);
    text = nl == std::string_view::npos ? std::string_view() : text.substr(nl + 1);
    if (!l.empty() && l.back() == '\r') l.remove_suffix(1);
    return l;
  };
  const std::string_view first = line();
  const auto sp = first.find(' ');
  r.method = std::string(first.substr(0, sp));
  r.target = sp == std::string_view::npos ? "/" : std::string(first.substr(sp + 1));
  while (!text.empty()) {
    const std::string_view h = line();
    if (h.empty()) break;
    const auto colon = h.find(':');
    std::string_view value = colon == std::string_view::npos ? std::string_view() : h.substr(colon + 1);
    while (!value.empty() && value.front() == ' ') value.remove_prefix(1);
    r.headers.emplace_back(std::string(h.substr(0, colon)), std::string(value));
  }
  r.body = std::string(text);
  if (!r.header("Authorization")) r.headers.emplace_back("Authorization", "Bearer fuzz-a");
  return r;
}

std::vector<sigv4::HttpRequest> parse_input(std::string_view text) {
  constexpr std::string_view sep = "\n---next---\n";
  std::vector<sigv4::HttpRequest> out;
  while (out.size() < 4) {
    const auto cut = text.find(sep);
    out.push_back(parse_one(text.substr(0, cut)));
    if (cut == std::string_view::npos) break;
    text = text.substr(cut + sep.size());
  }
  return out;
}

server::Options options() {
  server::Options o;
  o.tenants = {server::Tenant{"a", "111122223333", {{"AKIDFUZZA", "fuzz-secret-a"}}, {"fuzz-a"}, 3, 64 * 1024},
               server::Tenant{"b", "444455556666", {}, {"fuzz-b"}, 2, 4096}};
  o.log = [](const std::string&) {};
  return o;
}

server::Response call(server::Api& api, const char* target, const json& body) {
  return api.handle({"POST", "/", {{"Authorization", "Bearer fuzz-a"}, {"X-Amz-Target", target}}, body.dump()});
}

std::string status_of_s(server::Api& api) {
  const auto r = call(api, "SageMaker.DescribeTrainingSession", {{"TrainingSessionName", "s"}});
  return r.status == 200 ? json::parse(r.body)["TrainingSessionDetail"].value("TrainingSessionStatus", "") : "";
}

// Makes sure tenant a has a Running session "s" (an earlier input may have stopped or deleted it).
void ensure_session_s(server::Api& api) {
  std::string status = status_of_s(api);
  if (status == "Running") return;
  if (!status.empty()) {
    call(api, "SageMaker.StopTrainingSession", {{"TrainingSessionName", "s"}});
    for (int i = 0; i < 20000 && status_of_s(api) == "Stopping"; ++i)
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    call(api, "SageMaker.DeleteTrainingSession", {{"TrainingSessionName", "s"}});
  }
  const json body{{"TrainingSessionName", "s"},
                  {"RoleArn", "arn:aws:iam::111122223333:role/Fuzz"},
                  {"LoraConfig", {{"Rank", 4}, {"Alpha", 8}}},
                  {"ModelConfig", {{"BaseModelArn", "tiny"}}},
                  {"OutputConfig", {{"S3Location", {{"Path", "s3://bucket/out/"}}}}}};
  const auto created = call(api, "SageMaker.CreateTrainingSession", body);
  if (created.status != 200) {
    std::fprintf(stderr, "api_fuzz: cannot create session s: %s\n", created.body.c_str());
    std::abort();
  }
  for (int i = 0; i < 20000; ++i) {
    if (status_of_s(api) == "Running") return;
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  std::fprintf(stderr, "api_fuzz: session s never reached Running\n");
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size > 64 * 1024) return -1;  // keep inputs small; the body limit is checked with smaller tenant limits
  const auto requests = parse_input(std::string_view(reinterpret_cast<const char*>(data), size));
  // One Api for many inputs (creating one and its session per input would cost most of the time); renewed every
  // 500 inputs so that the operation records inputs leave behind, and the tenants' session limits, do not pile up.
  static std::unique_ptr<server::Api> shared;
  static std::size_t runs = 0;
  if (!shared || ++runs % 500 == 0) {
    shared.reset();
    shared = std::make_unique<server::Api>(options(), server::make_backend(std::make_shared<TinyService>()));
  }
  server::Api& api = *shared;
  ensure_session_s(api);
  for (const auto& req : requests) {
    auto res = api.handle(req);
    check(req, res);
  }
  // The server keeps serving after whatever came before.
  sigv4::HttpRequest health{"GET", "/health", {}, ""};
  auto h = api.handle(health);
  if (h.status != 200) violated(health, h, "/health failed after the input");
  return 0;
}
