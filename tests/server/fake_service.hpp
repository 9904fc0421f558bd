// A deterministic in-memory Service for protocol tests: no model, instant answers derived from the inputs, and a
// log of the operations each session ran (to check ordering). A datum starting with token 99 makes the operation
// fail; base model "slow" makes every operation take 30 ms, "short" has a 64-position context; the service's Gate,
// when closed, holds every operation of its sessions until it opens.
#pragma once
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <rlloop/session.hpp>

namespace fake {

using namespace rlloop;

// Holds operations until opened, so that an operation stays InProgress (and a long-poll or a sample on it
// pending) for as long as a test needs, whatever the machine's load. Open unless a test closes it.
struct Gate {
  std::mutex mu;
  std::condition_variable cv;
  bool open = true;
  void set(bool o) {
    std::lock_guard lock(mu);
    open = o;
    cv.notify_all();
  }
  void pass() {
    std::unique_lock lock(mu);
    cv.wait(lock, [&] { return open; });
  }
};

class FakeSession {
 public:
  explicit FakeSession(SessionOptions o, std::shared_ptr<Gate> gate = nullptr)
      : opts_(std::move(o)), gate_(std::move(gate)) {}

  Future<ForwardBackwardOutput> forward(const std::vector<Datum>& d, const LossSpec& l) {
    return run_batch("forward", d, l);
  }
  Future<ForwardBackwardOutput> forward_backward(const std::vector<Datum>& d, const LossSpec& l) {
    return run_batch("forward_backward", d, l);
  }
  Future<ForwardBackwardOutput> forward_backward_custom(const std::vector<Datum>& d, const CustomLossFn& fn) {
    auto out = batch_output(d);
    std::vector<std::vector<double>> lps;
    for (std::size_t i = 0; i < d.size(); ++i) lps.push_back(out.logprobs(i));
    const CustomLossResult r = fn(d, lps);
    out.metrics["loss:sum"] = r.loss;
    record("forward_backward_custom");
    return Future<ForwardBackwardOutput>::ready(out);
  }
  Future<OptimStepOutput> optim_step(const AdamParams& a) {
    pause();
    std::lock_guard lock(mu_);
    ++step_;
    log_.push_back("optim_step");
    return Future<OptimStepOutput>::ready(OptimStepOutput{{{"step", double(step_)}, {"lr", a.learning_rate}}});
  }
  Future<CheckpointRef> save_state(const std::string& name) {
    record("save_state:" + name);
    return Future<CheckpointRef>::ready({"/fake/" + name});
  }
  Future<LoadStateOutput> load_state(const std::string& path, bool with_optimizer) {
    record("load_state:" + path + (with_optimizer ? ":opt" : ""));
    return Future<LoadStateOutput>::ready({});
  }
  Future<CheckpointRef> save_weights_for_sampler(const std::string& name) {
    record("save_weights:" + name);
    return Future<CheckpointRef>::ready({"/fake/" + name});
  }
  // Each sample continues the prompt with last+1, last+2, ... for max_tokens tokens, logprob -0.5 each.
  Future<SampleResponse> sample(const SampleRequest& r) {
    record("sample" + (r.model_path ? ":" + *r.model_path : std::string()));
    SampleResponse out;
    const auto prompt = r.prompt.tokens();
    for (int s = 0; s < r.num_samples; ++s) {
      SampledSequence seq;
      for (int k = 1; k <= r.params.max_tokens; ++k) {
        seq.tokens.push_back((prompt.back() + k + s) % 100);
        seq.logprobs.push_back(-0.5);
      }
      seq.prefill_tokens = static_cast<std::int64_t>(prompt.size());
      seq.decode_tokens = r.params.max_tokens;
      out.sequences.push_back(seq);
    }
    if (r.include_prompt_logprobs) out.prompt_logprobs = lp_of(prompt);
    return Future<SampleResponse>::ready(out);
  }
  Future<std::vector<double>> compute_logprobs(const ComputeLogprobsRequest& r) {
    record("compute_logprobs");
    return Future<std::vector<double>>::ready(lp_of(r.prompt.tokens()));
  }
  SessionInfo info() {
    SessionInfo i;
    i.name = opts_.name;
    i.base_model = opts_.base_model;
    i.lora = opts_.lora;
    i.vocab_size = 257;  // the byte tokenizer's (256 bytes + EOS), which the OpenAI routes render text with
    // Base model "short" has a 64-position context (the server checks prompt + max tokens against it at
    // submission); the others report none (0: not checked).
    i.max_position_embeddings = opts_.base_model == "short" ? 64 : 0;
    i.tokenizer = "byte";
    std::lock_guard lock(mu_);
    i.step = step_;
    return i;
  }
  TokenUsage usage() { return {}; }

  std::vector<double> last_weights() const {
    std::lock_guard lock(mu_);
    return last_weights_;
  }
  std::vector<std::string> log() const {
    std::lock_guard lock(mu_);
    return log_;
  }

  // The fake model's logprob of token t: -0.01 * (t + 1). The first prompt token gets 0.
  static std::vector<double> lp_of(const std::vector<token_id>& tokens) {
    std::vector<double> out;
    for (std::size_t i = 0; i < tokens.size(); ++i) out.push_back(i == 0 ? 0.0 : -0.01 * (tokens[i] + 1));
    return out;
  }

 private:
  void pause() const {
    if (gate_) gate_->pass();
    if (opts_.base_model == "slow") std::this_thread::sleep_for(std::chrono::milliseconds(30));
  }
  void record(std::string what) {
    pause();
    std::lock_guard lock(mu_);
    log_.push_back(std::move(what));
  }
  ForwardBackwardOutput batch_output(const std::vector<Datum>& data) {
    ForwardBackwardOutput out;
    double loss = 0;
    for (const auto& d : data) {
      if (d.model_input.tokens().at(0) == 99) throw invalid_argument("fake: poisoned datum");
      const auto targets = d.loss_fn_inputs.at("target_tokens").as_doubles();
      std::vector<float> lp;
      for (double t : targets) lp.push_back(static_cast<float>(-0.01 * (t + 1)));
      if (auto w = d.loss_fn_inputs.find("weights"); w != d.loss_fn_inputs.end()) {
        const auto ws = w->second.as_doubles();
        {
          std::lock_guard lock(mu_);
          last_weights_ = ws;
        }
        for (std::size_t k = 0; k < ws.size(); ++k) loss -= ws[k] * lp[k];
      }
      out.loss_fn_outputs.push_back({{"logprobs", TensorData::from_floats(lp)}});
      out.training_tokens += static_cast<std::int64_t>(d.model_input.length());
    }
    out.metrics["loss:sum"] = loss;
    return out;
  }
  Future<ForwardBackwardOutput> run_batch(const char* what, const std::vector<Datum>& d, const LossSpec&) {
    try {
      auto out = batch_output(d);
      record(what);
      return Future<ForwardBackwardOutput>::ready(out);
    } catch (...) {
      record(std::string(what) + ":failed");
      return Future<ForwardBackwardOutput>::failed(std::current_exception());
    }
  }

  SessionOptions opts_;
  std::shared_ptr<Gate> gate_;
  mutable std::mutex mu_;
  std::vector<std::string> log_;
  std::int64_t step_ = 0;
  std::vector<double> last_weights_;
};
static_assert(Session<FakeSession>);

class FakeService {
 public:
  using session_type = FakeSession;
  // Shared by every session this service creates.
  std::shared_ptr<Gate> gate = std::make_shared<Gate>();
  // Holds session creation (a model loading) while closed.
  std::shared_ptr<Gate> creation = std::make_shared<Gate>();

  std::shared_ptr<FakeSession> create_session(const SessionOptions& o) {
    creation->pass();
    if (o.base_model == "missing") throw not_found("base model 'missing' is not in the catalogue");
    auto s = std::make_shared<FakeSession>(o, gate);
    std::lock_guard lock(mu_);
    sessions_.push_back(s);
    return s;
  }
  std::shared_ptr<FakeSession> create_session_from_state(const std::string& path, const SessionOptions& o) {
    auto s = create_session(o);
    s->load_state(path, true);
    return s;
  }
  std::shared_ptr<FakeSession> open_sampler(const std::string&) { return create_session({}); }
  std::vector<std::string> list_base_models() { return {"tiny", "slow"}; }
  ServerCapabilities capabilities() { return {{"tiny", "slow"}, {"cross_entropy", "ppo"}, false, 64}; }

  std::vector<std::shared_ptr<FakeSession>> sessions() const {
    std::lock_guard lock(mu_);
    return sessions_;
  }

 private:
  mutable std::mutex mu_;
  std::vector<std::shared_ptr<FakeSession>> sessions_;
};
static_assert(Service<FakeService>);

}  // namespace fake
