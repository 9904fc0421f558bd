// RemoteSession / RemoteService over the wire JSON of wire/runtime.hpp and wire/control_plane.hpp.
#include <algorithm>
#include <atomic>
#include <random>
#include <thread>

#include <rlloop/limits.hpp>
#include <rlloop/remote.hpp>

#include "remote_client.hpp"
#include "wire/control_plane.hpp"
#include "wire/runtime.hpp"

namespace rlloop {

using nlohmann::json;

struct RemoteSession::State {
  std::mutex submit_mu;  // submissions leave in call order, so sequence numbers follow the caller's program order
  std::int64_t next_sequence = 1;
  std::atomic<std::int64_t> next_sampling{1};  // sampling requests: Idempotency-Key <prefix>-s<n>
  std::string token_prefix;
};

namespace {

// CreateTrainingSession's BaseModelArn: a catalogue name goes as its SageMaker Hub ARN (the only form the
// service model's pattern admits); an ARN, or a model directory (an rlloop serve extension), goes as it is.
std::string base_model_arn(const std::string& model, const std::string& region) {
  if (!is_hub_model_id(model)) return model;
  return "arn:aws:sagemaker:" + region + ":aws:hub-content/SageMakerPublicHub/Model/" + model;
}

std::string random_hex(std::size_t n) {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  static constexpr char digits[] = "0123456789abcdef";
  std::string s;
  for (std::size_t i = 0; i < n; ++i) s.push_back(digits[rng() % 16]);
  return s;
}

// Polls an operation until it is terminal (long-polls, then a growing interval); returns the Get*Result body.
json poll(detail::RemoteClient& client, const std::string& url) {
  const auto& o = client.options();
  auto interval = o.poll_initial;
  const auto deadline = std::chrono::steady_clock::now() + o.operation_timeout;
  while (true) {
    std::string target = url;
    if (o.long_poll.count() > 0) {
      const auto left = std::chrono::duration_cast<std::chrono::seconds>(deadline - std::chrono::steady_clock::now());
      target += "?waitSeconds=" + std::to_string(std::clamp<long long>(std::min(left, o.long_poll).count(), 1, 20));
    }
    json state = client.rest("GET", target);
    // A status this client does not know (none today) is polled again, as Pending and InProgress are.
    const auto status = wire::operation_status_from_string(state.value("status", ""));
    if (status == wire::OperationStatus::completed) return state;
    if (status == wire::OperationStatus::failed)
      throw remote_error("OperationFailed", 200, state.value("errorDetails", "operation failed"));
    if (status == wire::OperationStatus::skipped)
      throw remote_error("OperationSkipped", 200, "an earlier operation of this session failed");
    if (std::chrono::steady_clock::now() > deadline) throw io_error("operation " + url + " did not finish in time");
    std::this_thread::sleep_for(interval);
    interval = std::min(o.poll_max, interval * 2);
  }
}

// Resolves a Future on a detached thread, so dropping the Future never blocks the caller.
template <class T, class Fn>
Future<T> in_background(Fn fn) {
  auto promise = std::make_shared<Promise<T>>();
  Future<T> f = promise->future();
  std::thread([promise, fn = std::move(fn)]() mutable { promise->fulfil(fn); }).detach();
  return f;
}

}  // namespace

RemoteSession::RemoteSession(std::shared_ptr<detail::RemoteClient> client, std::string name)
    : client_(std::move(client)), name_(std::move(name)), state_(std::make_shared<State>()) {
  state_->token_prefix = random_hex(12);
}

RemoteSession::~RemoteSession() = default;

namespace {
// Submits a training operation and returns a Future of its result member.
template <class T, class Extract>
Future<T> submit(const std::shared_ptr<detail::RemoteClient>& client, RemoteSession::State& state,
                 const std::string& name, wire::TrainingOperation op, Extract extract) {
  std::string id;
  {
    std::lock_guard lock(state.submit_mu);
    const std::int64_t seq = state.next_sequence++;
    wire::ExecuteTrainingRequest req{seq, state.token_prefix + "-" + std::to_string(seq), std::move(op)};
    id =
        client->rest("POST", "/v1/training-sessions/" + name + "/operations", wire::to_json(req).dump())["operationId"];
  }
  const std::string url = "/v1/training-sessions/" + name + "/operations/" + id;
  return in_background<T>([client, url, extract] {
    const auto st = wire::training_state_from_json(poll(*client, url));
    if (!st.result) throw remote_error("InternalServerException", 200, "completed operation has no result");
    return extract(*st.result);
  });
}
// Sampling requests have no clientToken in the API; the same key goes in an Idempotency-Key header on
// every retry instead, so rlloop-server runs (and bills) a retried sample once.
template <class T, class Extract>
Future<T> submit_sampling(const std::shared_ptr<detail::RemoteClient>& client, RemoteSession::State& state,
                          const std::string& name, wire::SamplingOperation op, Extract extract) {
  const std::string key = state.token_prefix + "-s" + std::to_string(state.next_sampling++);
  const std::string id =
      client->rest("POST", "/v1/training-sessions/" + name + "/sampling-operations",
                   json{{"operationConfig", wire::to_json(op)}}.dump(), {{"Idempotency-Key", key}})["operationId"];
  const std::string url = "/v1/training-sessions/" + name + "/sampling-operations/" + id;
  return in_background<T>([client, url, extract] {
    const auto st = wire::sampling_state_from_json(poll(*client, url));
    if (!st.result) throw remote_error("InternalServerException", 200, "completed operation has no result");
    return extract(*st.result);
  });
}
template <class R>
const R& member(const auto& result) {
  if (const R* r = std::get_if<R>(&result)) return *r;
  throw remote_error("InternalServerException", 200, "operation result holds the wrong member");
}
}  // namespace

Future<ForwardBackwardOutput> RemoteSession::forward(const std::vector<Datum>& data, const LossSpec& loss) {
  return submit<ForwardBackwardOutput>(
      client_, *state_, name_, wire::ForwardOp{{data, loss}},
      [](const wire::TrainingResult& r) { return member<wire::ForwardResult>(r).output; });
}

Future<ForwardBackwardOutput> RemoteSession::forward_backward(const std::vector<Datum>& data, const LossSpec& loss) {
  return submit<ForwardBackwardOutput>(
      client_, *state_, name_, wire::ForwardBackwardOp{{data, loss}},
      [](const wire::TrainingResult& r) { return member<wire::ForwardBackwardResult>(r).output; });
}

Future<ForwardBackwardOutput> RemoteSession::forward_backward_custom(const std::vector<Datum>& data,
                                                                     const CustomLossFn& fn) {
  // cross_entropy needs weights; the forward pass ignores them, so zeros are fine where the caller gave none.
  std::vector<Datum> probe = data;
  for (auto& d : probe)
    if (!d.loss_fn_inputs.count("weights"))
      d.loss_fn_inputs["weights"] = TensorData::from_floats(std::vector<float>(d.model_input.length(), 0.0f));
  const ForwardBackwardOutput fwd = forward(probe, LossSpec::cross_entropy()).get();
  std::vector<std::vector<double>> logprobs;
  for (std::size_t i = 0; i < data.size(); ++i) logprobs.push_back(fwd.logprobs(i));
  const CustomLossResult custom = fn(data, logprobs);
  if (custom.grad_logprobs.size() != data.size())
    throw invalid_argument("forward_backward_custom: the loss returned " + std::to_string(custom.grad_logprobs.size()) +
                           " gradients for " + std::to_string(data.size()) + " datums");
  std::vector<Datum> weighted = probe;
  for (std::size_t i = 0; i < data.size(); ++i) {
    if (custom.grad_logprobs[i].size() != logprobs[i].size())
      throw invalid_argument("forward_backward_custom: gradient " + std::to_string(i) + " has " +
                             std::to_string(custom.grad_logprobs[i].size()) + " values, expected " +
                             std::to_string(logprobs[i].size()));
    std::vector<float> w;
    for (double g : custom.grad_logprobs[i]) w.push_back(static_cast<float>(-g));
    weighted[i].loss_fn_inputs["weights"] = TensorData::from_floats(std::move(w));
  }
  const double loss = custom.loss;
  const Metrics metrics = custom.metrics;
  return submit<ForwardBackwardOutput>(client_, *state_, name_,
                                       wire::ForwardBackwardOp{{weighted, LossSpec::cross_entropy()}},
                                       [loss, metrics](const wire::TrainingResult& r) {
                                         ForwardBackwardOutput out = member<wire::ForwardBackwardResult>(r).output;
                                         out.metrics["loss:sum"] = loss;  // the user's loss, not the surrogate's
                                         for (const auto& [k, v] : metrics) out.metrics[k] = v;
                                         return out;
                                       });
}

Future<OptimStepOutput> RemoteSession::optim_step(const AdamParams& params) {
  return submit<OptimStepOutput>(client_, *state_, name_, wire::OptimizerStepOp{params},
                                 [](const wire::TrainingResult& r) { return member<OptimStepOutput>(r); });
}

Future<CheckpointRef> RemoteSession::save_state(const std::string& name) {
  return submit<CheckpointRef>(client_, *state_, name_, wire::SaveStateOp{name}, [](const wire::TrainingResult& r) {
    return CheckpointRef{member<wire::SaveStateResult>(r).model_package_arn};
  });
}

Future<LoadStateOutput> RemoteSession::load_state(const std::string& path, bool with_optimizer) {
  return submit<LoadStateOutput>(client_, *state_, name_, wire::LoadStateOp{path, with_optimizer},
                                 [](const wire::TrainingResult& r) { return member<LoadStateOutput>(r); });
}

Future<CheckpointRef> RemoteSession::save_weights_for_sampler(const std::string& name) {
  return submit<CheckpointRef>(
      client_, *state_, name_, wire::SaveWeightsOp{.description = name}, [](const wire::TrainingResult& r) {
        const auto& w = member<wire::SaveWeightsResult>(r);
        if (!w.model_package_arn)
          throw remote_error("InternalServerException", 200, "saveWeights returned no modelPackageArn");
        return CheckpointRef{*w.model_package_arn};
      });
}

Future<SampleResponse> RemoteSession::sample(const SampleRequest& request) {
  validate(request);  // before it is sent: the bounds of rlloop/limits.hpp (the server checks the model's context)
  return submit_sampling<SampleResponse>(client_, *state_, name_, request,
                                         [](const wire::SamplingResult& r) { return member<SampleResponse>(r); });
}

Future<std::vector<double>> RemoteSession::compute_logprobs(const ComputeLogprobsRequest& request) {
  return submit_sampling<std::vector<double>>(client_, *state_, name_, request, [](const wire::SamplingResult& r) {
    return member<wire::ComputeLogprobsResult>(r).logprobs;
  });
}

SessionInfo RemoteSession::info() {
  return wire::session_info_from_json(client_->rest("GET", "/v1/training-sessions/" + name_ + "/info"), "info");
}

TokenUsage RemoteSession::usage() {
  const json d = client_->control("DescribeTrainingSession", {{"TrainingSessionName", name_}})["TrainingSessionDetail"];
  return wire::billable_usage_from_json(d.value("BillableTokenUsage", json::object()),
                                        "TrainingSessionDetail.BillableTokenUsage");
}

void RemoteSession::stop() { client_->control("StopTrainingSession", {{"TrainingSessionName", name_}}); }

RemoteService::RemoteService(RemoteOptions options)
    : client_(std::make_shared<detail::RemoteClient>(std::move(options))) {}

std::shared_ptr<RemoteSession> RemoteService::create_session(const SessionOptions& options) {
  if (!options.lora) throw unsupported("remote sessions are LoRA only (the training-session API requires LoraConfig)");
  validate(options);  // before it is sent
  const std::string name = options.name.empty() ? "rlloop-" + random_hex(12) : options.name;
  const auto& o = client_->options();
  client_->control("CreateTrainingSession",
                   {{"TrainingSessionName", name},
                    {"RoleArn", o.role_arn},
                    {"LoraConfig", {{"Rank", options.lora->rank}, {"Alpha", options.lora->alpha}}},
                    {"ModelConfig", {{"BaseModelArn", base_model_arn(options.base_model, o.region)}}},
                    {"OutputConfig", {{"S3Location", {{"Path", o.s3_output_path}}}}}});
  auto interval = o.poll_initial;
  while (true) {
    const json d =
        client_->control("DescribeTrainingSession", {{"TrainingSessionName", name}})["TrainingSessionDetail"];
    const std::string status = d.value("TrainingSessionStatus", "");
    const auto known = wire::session_status_from_string(status);
    if (known == wire::SessionStatus::running) break;
    if (known != wire::SessionStatus::created && known != wire::SessionStatus::scheduled)
      throw remote_error("SessionNotRunning", 200,
                         "training session " + name + " is " + status + ": " + d.value("ErrorDetails", ""));
    std::this_thread::sleep_for(interval);
    interval = std::min(o.poll_max, interval * 2);
  }
  return std::make_shared<RemoteSession>(client_, name);
}

std::shared_ptr<RemoteSession> RemoteService::create_session_from_state(const std::string& path,
                                                                        const SessionOptions& options) {
  auto s = create_session(options);
  s->load_state(path, true).get();
  return s;
}

std::shared_ptr<RemoteSession> RemoteService::open_sampler(const std::string& path) {
  throw unsupported(
      "open_sampler('" + path +
      "'): a remote sampler needs a session; use save_weights_and_get_sampling_client or a SamplingClient "
      "with model_path on a live session");
}

std::vector<std::string> RemoteService::list_base_models() {
  return client_->rest("GET", "/v1/base-models").at("baseModels").get<std::vector<std::string>>();
}

ServerCapabilities RemoteService::capabilities() {
  return wire::capabilities_from_json(client_->rest("GET", "/v1/capabilities"), "capabilities");
}

}  // namespace rlloop
