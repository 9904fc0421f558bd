// The remote backend: a training session on a service that speaks the SageMaker training-session API
// (rlloop-server, or the real thing). Link rlloop::remote. Operations are submitted in call order with
// consecutive sequence numbers, without waiting for earlier results; futures resolve by polling. Retries reuse
// the training clientToken, and for sampling an Idempotency-Key header (an rlloop-server extension), so a retried
// operation runs once.
#pragma once
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <rlloop/session.hpp>

namespace rlloop {

struct RemoteOptions {
  std::string endpoint = "http://127.0.0.1:8080";  // http://host:port
  std::string region = "us-east-1";
  std::string signing_service = "sagemaker";
  // Authentication: a bearer key, else SigV4 with these credentials, else AWS_ACCESS_KEY_ID /
  // AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, else ~/.aws/credentials (profile AWS_PROFILE or "default").
  std::optional<std::string> bearer_key;
  std::string access_key_id, secret_access_key, session_token;
  // CreateTrainingSession inputs the service requires.
  std::string role_arn = "arn:aws:iam::000000000000:role/rlloop";
  std::string s3_output_path = "s3://rlloop/output/";
  int max_retries = 6;  // on 429, 5xx and dropped connections
  std::chrono::milliseconds backoff_base{50};
  // Operation results: each GET asks rlloop-server to hold the answer until the operation is terminal, up to
  // long_poll (?waitSeconds=, an rlloop extension; 0 = plain polling for a service without it). Between answers
  // that are not final the client sleeps poll_initial, doubling up to poll_max (the only wait without long-poll;
  // bench/server: poll_max 250 ms cost 1.25-1.67x per step).
  std::chrono::seconds long_poll{10};
  std::chrono::milliseconds poll_initial{2}, poll_max{20};
  std::chrono::seconds operation_timeout{3600};
};

namespace detail {
class RemoteClient;
}

class RemoteSession {
 public:
  RemoteSession(std::shared_ptr<detail::RemoteClient> client, std::string name);
  ~RemoteSession();

  Future<ForwardBackwardOutput> forward(const std::vector<Datum>& data, const LossSpec& loss);
  Future<ForwardBackwardOutput> forward_backward(const std::vector<Datum>& data, const LossSpec& loss);
  // Runs `forward`, calls fn on the logprobs, then forwardBackward with cross_entropy and weights = -grad:
  // d(-sum w*lp)/d lp = -w, so the service back-propagates exactly fn's gradient. Blocks until the forward is done.
  Future<ForwardBackwardOutput> forward_backward_custom(const std::vector<Datum>& data, const CustomLossFn& fn);
  Future<OptimStepOutput> optim_step(const AdamParams& params);
  Future<CheckpointRef> save_state(const std::string& name);  // path = the model-package ARN
  Future<LoadStateOutput> load_state(const std::string& path, bool with_optimizer);
  Future<CheckpointRef> save_weights_for_sampler(const std::string& name);
  Future<SampleResponse> sample(const SampleRequest& request);
  Future<std::vector<double>> compute_logprobs(const ComputeLogprobsRequest& request);
  SessionInfo info();
  TokenUsage usage();  // the session's BillableTokenUsage

  const std::string& name() const { return name_; }
  void stop();  // StopTrainingSession

  struct State;  // submission order and idempotency tokens (defined in src/remote)

 private:
  std::shared_ptr<detail::RemoteClient> client_;
  std::string name_;
  std::shared_ptr<State> state_;
};
static_assert(Session<RemoteSession>);

class RemoteService {
 public:
  using session_type = RemoteSession;
  explicit RemoteService(RemoteOptions options = {});

  // CreateTrainingSession, then waits for Running (throws remote_error if it Fails).
  std::shared_ptr<RemoteSession> create_session(const SessionOptions& options);
  std::shared_ptr<RemoteSession> create_session_from_state(const std::string& path, const SessionOptions& options);
  std::shared_ptr<RemoteSession> open_sampler(const std::string& path);
  std::vector<std::string> list_base_models();
  ServerCapabilities capabilities();

 private:
  std::shared_ptr<detail::RemoteClient> client_;
};
static_assert(Service<RemoteService>);

}  // namespace rlloop
