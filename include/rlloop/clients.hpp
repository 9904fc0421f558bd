// The three clients a loop talks to. They are thin: every call forwards to the session and
// returns its future, so the same loop runs on the local, remote or fake backend.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <rlloop/session.hpp>

namespace rlloop {

// What sample() reports about the prompt besides the samples.
struct PromptLogprobOptions {
  bool include = false;  // every prompt token's logprob (SampleResponse::prompt_logprobs; the first gets 0.0)
  int top_k = 0;         // the k most likely tokens at every prompt position (SampleResponse::topk_prompt_logprobs)
};

// Rollouts and scoring against fixed weights (a saved sampler checkpoint) or the live session weights.
template <Session S>
class SamplingClient {
 public:
  SamplingClient(std::shared_ptr<S> session, std::optional<std::string> model_path)
      : session_(std::move(session)), model_path_(std::move(model_path)) {}

  Future<SampleResponse> sample(const ModelInput& prompt, int num_samples, const SamplingParams& params,
                                const PromptLogprobOptions& prompt_logprobs = {}) const {
    SampleRequest req{prompt, num_samples, params, prompt_logprobs.include, prompt_logprobs.top_k, model_path_};
    return session_->sample(req);
  }
  // The whole request, for what the short form does not set (SampleRequest::include_routed_experts); its
  // model_path is this client's.
  Future<SampleResponse> sample(SampleRequest req) const {
    req.model_path = model_path_;
    return session_->sample(req);
  }
  // Logprob of every prompt token given the ones before it (the first gets 0.0).
  Future<std::vector<double>> compute_logprobs(const ModelInput& prompt) const {
    return session_->compute_logprobs(ComputeLogprobsRequest{prompt, model_path_});
  }
  const std::optional<std::string>& model_path() const { return model_path_; }
  S& session() const { return *session_; }

 private:
  std::shared_ptr<S> session_;
  std::optional<std::string> model_path_;
};

// Training and checkpoints on one session.
template <Session S>
class TrainingClient {
 public:
  explicit TrainingClient(std::shared_ptr<S> session) : session_(std::move(session)) {}

  Future<ForwardBackwardOutput> forward(const std::vector<Datum>& data, const LossSpec& loss) {
    return session_->forward(data, loss);
  }
  Future<ForwardBackwardOutput> forward_backward(const std::vector<Datum>& data, const LossSpec& loss) {
    return session_->forward_backward(data, loss);
  }
  Future<ForwardBackwardOutput> forward_backward_custom(const std::vector<Datum>& data, CustomLossFn fn) {
    return session_->forward_backward_custom(data, fn);
  }
  Future<OptimStepOutput> optim_step(const AdamParams& params) { return session_->optim_step(params); }
  Future<CheckpointRef> save_state(const std::string& name) { return session_->save_state(name); }
  Future<LoadStateOutput> load_state(const std::string& path, bool with_optimizer = true) {
    return session_->load_state(path, with_optimizer);
  }
  Future<CheckpointRef> save_weights_for_sampler(const std::string& name) {
    return session_->save_weights_for_sampler(name);
  }
  // Saves sampler weights and returns a client that samples from exactly those weights. A local session keeps
  // the 4 most recently used of these models loaded and reads older ones from their checkpoint again, so the
  // checkpoint must stay in place while the client is in use.
  SamplingClient<S> save_weights_and_get_sampling_client(const std::string& name) {
    return SamplingClient<S>(session_, session_->save_weights_for_sampler(name).get().path);
  }
  // A client that samples from the session's current weights (sees every later optimizer step).
  SamplingClient<S> live_sampling_client() const { return SamplingClient<S>(session_, std::nullopt); }

  // get_info().tokenizer names the model's tokenizer; rlloop::load_tokenizer(client) (<rlloop/tokenizer.hpp>,
  // the rlloop::tokenizer library) loads it.
  SessionInfo get_info() const { return session_->info(); }
  TokenUsage usage() const { return session_->usage(); }

  S& session() const { return *session_; }

 private:
  std::shared_ptr<S> session_;
};

// create_lora_training_client's settings, named at the call site:
//   service.create_lora_training_client("rlloop-small", {.rank = 8, .alpha = 16, .seed = 7});
// The adapter's defaults are LoraOptions'.
struct LoraTrainingOptions {
  int rank = LoraOptions{}.rank;
  int alpha = LoraOptions{}.alpha;  // the adapter's update is scaled by alpha / rank
  std::vector<std::string> target_modules = LoraOptions{}.target_modules;
  std::int64_t seed = 0;  // SessionOptions::seed: the adapter's initialisation and the default sampling seeds
};

// Platform settings; starts sessions on a Service.
template <Service Svc>
class ServiceClient {
 public:
  using session_type = typename Svc::session_type;

  explicit ServiceClient(Svc service) : service_(std::move(service)) {}

  TrainingClient<session_type> create_lora_training_client(const std::string& base_model,
                                                           const LoraTrainingOptions& options = {}) {
    SessionOptions opts;
    opts.base_model = base_model;
    opts.lora = LoraOptions{options.rank, options.alpha, options.target_modules};
    opts.seed = options.seed;
    return TrainingClient<session_type>(service_.create_session(opts));
  }
  TrainingClient<session_type> create_full_training_client(const std::string& base_model, std::int64_t seed = 0) {
    SessionOptions opts;
    opts.base_model = base_model;
    opts.seed = seed;
    return TrainingClient<session_type>(service_.create_session(opts));
  }
  TrainingClient<session_type> create_training_client(const SessionOptions& opts) {
    return TrainingClient<session_type>(service_.create_session(opts));
  }
  // Resumes from save_state: opts describe the model the state belongs to.
  TrainingClient<session_type> create_training_client_from_state(const std::string& path, const SessionOptions& opts) {
    return TrainingClient<session_type>(service_.create_session_from_state(path, opts));
  }
  SamplingClient<session_type> create_sampling_client(const std::string& path) {
    return SamplingClient<session_type>(service_.open_sampler(path), std::nullopt);
  }
  std::vector<std::string> list_base_models() { return service_.list_base_models(); }
  ServerCapabilities get_server_capabilities() { return service_.capabilities(); }

  Svc& service() { return service_; }

 private:
  Svc service_;
};

}  // namespace rlloop
