// The Session concept: the backend behind the clients. A local LibTorch session, a remote HTTP session and
// test fakes all satisfy it; AnySession erases the type when the backend is chosen at run time.
#pragma once
#include <concepts>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <rlloop/future.hpp>
#include <rlloop/loss.hpp>
#include <rlloop/types.hpp>

namespace rlloop {

// d loss / d logprob for each datum and token, given the logprobs; see CustomLossResult.
using CustomLossFn =
    std::function<CustomLossResult(const std::vector<Datum>& data, const std::vector<std::vector<double>>& logprobs)>;

// What a training session must provide. Operations return futures and run in submission order.
//   forward / forward_backward      built-in loss on a batch (forward computes no gradient)
//   forward_backward_custom         user objective on the per-token logprobs
//   optim_step                      AdamW on the accumulated gradients, then zeroes them
//   save_state / load_state         weights + optimizer (+ step, RNG, gradients pending since the last step)
//                                   checkpoints; load_state without the optimizer starts with none pending
//   save_weights_for_sampler        weights that a sampler can load by the returned path
//   sample / compute_logprobs       rollouts and scoring, optionally from saved sampler weights
template <class S>
concept Session = requires(S& s, const std::vector<Datum>& data, const LossSpec& loss, const CustomLossFn& fn,
                           const AdamParams& adam, const std::string& name, bool flag, const SampleRequest& sreq,
                           const ComputeLogprobsRequest& lreq) {
  { s.forward(data, loss) } -> std::same_as<Future<ForwardBackwardOutput>>;
  { s.forward_backward(data, loss) } -> std::same_as<Future<ForwardBackwardOutput>>;
  { s.forward_backward_custom(data, fn) } -> std::same_as<Future<ForwardBackwardOutput>>;
  { s.optim_step(adam) } -> std::same_as<Future<OptimStepOutput>>;
  { s.save_state(name) } -> std::same_as<Future<CheckpointRef>>;
  { s.load_state(name, flag) } -> std::same_as<Future<LoadStateOutput>>;
  { s.save_weights_for_sampler(name) } -> std::same_as<Future<CheckpointRef>>;
  { s.sample(sreq) } -> std::same_as<Future<SampleResponse>>;
  { s.compute_logprobs(lreq) } -> std::same_as<Future<std::vector<double>>>;
  { s.info() } -> std::same_as<SessionInfo>;
  { s.usage() } -> std::same_as<TokenUsage>;
};

// A service creates sessions: the local engine, a remote endpoint, or a fake.
template <class Svc>
concept Service = requires(Svc& svc, const SessionOptions& opts, const std::string& path) {
  typename Svc::session_type;
  requires Session<typename Svc::session_type>;
  { svc.create_session(opts) } -> std::same_as<std::shared_ptr<typename Svc::session_type>>;
  { svc.create_session_from_state(path, opts) } -> std::same_as<std::shared_ptr<typename Svc::session_type>>;
  { svc.open_sampler(path) } -> std::same_as<std::shared_ptr<typename Svc::session_type>>;
  { svc.list_base_models() } -> std::same_as<std::vector<std::string>>;
  { svc.capabilities() } -> std::same_as<ServerCapabilities>;
};

// Type-erased session: holds any Session behind one virtual interface.
class AnySession {
 public:
  template <Session S>
  explicit AnySession(std::shared_ptr<S> s) : impl_(std::make_shared<Model<S>>(std::move(s))) {}

  Future<ForwardBackwardOutput> forward(const std::vector<Datum>& d, const LossSpec& l) { return impl_->forward(d, l); }
  Future<ForwardBackwardOutput> forward_backward(const std::vector<Datum>& d, const LossSpec& l) {
    return impl_->forward_backward(d, l);
  }
  Future<ForwardBackwardOutput> forward_backward_custom(const std::vector<Datum>& d, const CustomLossFn& f) {
    return impl_->forward_backward_custom(d, f);
  }
  Future<OptimStepOutput> optim_step(const AdamParams& a) { return impl_->optim_step(a); }
  Future<CheckpointRef> save_state(const std::string& n) { return impl_->save_state(n); }
  Future<LoadStateOutput> load_state(const std::string& p, bool with_optimizer) {
    return impl_->load_state(p, with_optimizer);
  }
  Future<CheckpointRef> save_weights_for_sampler(const std::string& n) { return impl_->save_weights_for_sampler(n); }
  Future<SampleResponse> sample(const SampleRequest& r) { return impl_->sample(r); }
  Future<std::vector<double>> compute_logprobs(const ComputeLogprobsRequest& r) { return impl_->compute_logprobs(r); }
  SessionInfo info() { return impl_->info(); }
  TokenUsage usage() { return impl_->usage(); }

 private:
  struct Interface {
    virtual ~Interface() = default;
    virtual Future<ForwardBackwardOutput> forward(const std::vector<Datum>&, const LossSpec&) = 0;
    virtual Future<ForwardBackwardOutput> forward_backward(const std::vector<Datum>&, const LossSpec&) = 0;
    virtual Future<ForwardBackwardOutput> forward_backward_custom(const std::vector<Datum>&, const CustomLossFn&) = 0;
    virtual Future<OptimStepOutput> optim_step(const AdamParams&) = 0;
    virtual Future<CheckpointRef> save_state(const std::string&) = 0;
    virtual Future<LoadStateOutput> load_state(const std::string&, bool) = 0;
    virtual Future<CheckpointRef> save_weights_for_sampler(const std::string&) = 0;
    virtual Future<SampleResponse> sample(const SampleRequest&) = 0;
    virtual Future<std::vector<double>> compute_logprobs(const ComputeLogprobsRequest&) = 0;
    virtual SessionInfo info() = 0;
    virtual TokenUsage usage() = 0;
  };
  template <class S>
  struct Model final : Interface {
    explicit Model(std::shared_ptr<S> s) : s(std::move(s)) {}
    Future<ForwardBackwardOutput> forward(const std::vector<Datum>& d, const LossSpec& l) override {
      return s->forward(d, l);
    }
    Future<ForwardBackwardOutput> forward_backward(const std::vector<Datum>& d, const LossSpec& l) override {
      return s->forward_backward(d, l);
    }
    Future<ForwardBackwardOutput> forward_backward_custom(const std::vector<Datum>& d, const CustomLossFn& f) override {
      return s->forward_backward_custom(d, f);
    }
    Future<OptimStepOutput> optim_step(const AdamParams& a) override { return s->optim_step(a); }
    Future<CheckpointRef> save_state(const std::string& n) override { return s->save_state(n); }
    Future<LoadStateOutput> load_state(const std::string& p, bool o) override { return s->load_state(p, o); }
    Future<CheckpointRef> save_weights_for_sampler(const std::string& n) override {
      return s->save_weights_for_sampler(n);
    }
    Future<SampleResponse> sample(const SampleRequest& r) override { return s->sample(r); }
    Future<std::vector<double>> compute_logprobs(const ComputeLogprobsRequest& r) override {
      return s->compute_logprobs(r);
    }
    SessionInfo info() override { return s->info(); }
    TokenUsage usage() override { return s->usage(); }
    std::shared_ptr<S> s;
  };
  std::shared_ptr<Interface> impl_;
};
static_assert(Session<AnySession>);

}  // namespace rlloop
