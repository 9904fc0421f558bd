// A hosted session's worker: creates the session, then runs its operations one at a time in arrival (= sequence
// number) order, recording each result and billing its tokens to the session and the tenant.
#include <chrono>

#include "server/api_impl.hpp"

namespace rlloop::server {

double now_seconds() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

SessionHost::SessionHost(std::shared_ptr<TenantState> t, std::string n, std::string a, SessionOptions o, json e,
                         const Backend& backend, std::string region)
    : tenant(std::move(t)), name(std::move(n)), arn(std::move(a)), options(std::move(o)), echo(std::move(e)),
      creation_time(now_seconds()), last_modified(creation_time), region_(std::move(region)) {
  worker_ = std::thread([this, backend] { run(backend); });
}

SessionHost::~SessionHost() {
  stop();
  join();
}

void SessionHost::enqueue_locked(std::shared_ptr<OperationRecord> op) {
  queue_.push_back(std::move(op));
  cv_.notify_all();
}

void SessionHost::stop() {
  {
    std::lock_guard lock(mu);
    if (status == "Running" || status == "Blocked" || status == "Created") status = "Stopping";
    stopping_ = true;
    last_modified = now_seconds();
  }
  cv_.notify_all();
}

void SessionHost::join() {
  if (worker_.joinable()) worker_.join();
}

void SessionHost::bill(const TokenUsage& u) {
  {
    std::lock_guard lock(mu);
    usage += u;
  }
  std::lock_guard lock(tenant->mu);
  tenant->usage += u;
}

// A tenant can only name checkpoints it owns; any other ARN is "not found", never another tenant's file.
std::string SessionHost::resolve_checkpoint(const std::string& package_arn) {
  std::lock_guard lock(tenant->mu);
  auto it = tenant->checkpoints.find(package_arn);
  if (it == tenant->checkpoints.end()) throw not_found("model package '" + package_arn + "' does not exist in this account");
  return it->second;
}

std::string SessionHost::add_checkpoint(const std::string& path) {
  std::lock_guard lock(tenant->mu);
  const std::string package = "arn:aws:sagemaker:" + region_ + ":" + tenant->config.account_id + ":model-package/" + name + "/" +
                              std::to_string(tenant->next_checkpoint++);
  tenant->checkpoints[package] = path;
  return package;
}

json SessionHost::execute(OperationRecord& op) {
  // Checkpoint names are unique per tenant and session so tenants never share a directory.
  auto checkpoint_name = [&](const char* kind) {
    std::lock_guard lock(tenant->mu);
    return tenant->config.id + "-" + name + "-" + kind + "-" + std::to_string(tenant->next_checkpoint);
  };
  if (const auto* t = std::get_if<wire::TrainingOperation>(&op.op)) {
    wire::TrainingResult result = std::visit(
        [&](const auto& o) -> wire::TrainingResult {
          using T = std::decay_t<decltype(o)>;
          if constexpr (std::is_same_v<T, wire::ForwardOp> || std::is_same_v<T, wire::ForwardBackwardOp>) {
            ForwardBackwardOutput out = std::is_same_v<T, wire::ForwardOp> ? session->forward(o.data, o.loss).get()
                                                                          : session->forward_backward(o.data, o.loss).get();
            bill(TokenUsage{0, 0, out.training_tokens});
            if constexpr (std::is_same_v<T, wire::ForwardOp>) return wire::ForwardResult{std::move(out)};
            else return wire::ForwardBackwardResult{std::move(out)};
          } else if constexpr (std::is_same_v<T, wire::OptimizerStepOp>) {
            return session->optim_step(o.adam).get();
          } else if constexpr (std::is_same_v<T, wire::SaveWeightsOp>) {
            if (o.merge_weights) throw unsupported("saveWeights.mergeWeights is not supported by this server");
            return wire::SaveWeightsResult{add_checkpoint(session->save_weights_for_sampler(checkpoint_name("weights")).get().path)};
          } else if constexpr (std::is_same_v<T, wire::SaveStateOp>) {
            return wire::SaveStateResult{add_checkpoint(session->save_state(checkpoint_name("state")).get().path)};
          } else {
            session->load_state(resolve_checkpoint(o.model_package_arn), o.load_optimizer).get();
            return LoadStateOutput{};
          }
        },
        *t);
    wire::TrainingOperationState st{"Completed", std::move(result), std::nullopt, std::nullopt};
    if (const auto* f = std::get_if<wire::ForwardResult>(&*st.result)) st.training_tokens = f->output.training_tokens;
    if (const auto* f = std::get_if<wire::ForwardBackwardResult>(&*st.result)) st.training_tokens = f->output.training_tokens;
    return wire::to_json(st);
  }
  const auto& s = std::get<wire::SamplingOperation>(op.op);
  wire::SamplingResult result = std::visit(
      [&](const auto& o) -> wire::SamplingResult {
        using T = std::decay_t<decltype(o)>;
        if constexpr (std::is_same_v<T, SampleRequest>) {
          SampleRequest req = o;
          req.model_path = o.model_path ? std::optional(resolve_checkpoint(*o.model_path)) : sampler_path_;
          SampleResponse r = session->sample(req).get();
          TokenUsage u;
          for (const auto& seq : r.sequences) {
            u.prefill += seq.prefill_tokens;
            u.sample += seq.decode_tokens;
          }
          bill(u);
          return r;
        } else if constexpr (std::is_same_v<T, ComputeLogprobsRequest>) {
          ComputeLogprobsRequest req = o;
          req.model_path = o.model_path ? std::optional(resolve_checkpoint(*o.model_path)) : sampler_path_;
          auto lp = session->compute_logprobs(req).get();
          bill(TokenUsage{static_cast<std::int64_t>(o.prompt.length()), 0, 0});
          return wire::ComputeLogprobsResult{std::move(lp)};
        } else {
          sampler_path_ = resolve_checkpoint(o.model_package_arn);
          return wire::LoadWeightsForSamplingResult{};
        }
      },
      s);
  return wire::to_json(wire::SamplingOperationState{"Completed", std::move(result), std::nullopt, std::nullopt});
}

void SessionHost::run(Backend backend) {
  std::shared_ptr<AnySession> created;
  std::string failure;
  std::int64_t vocab = 0;
  try {
    created = backend.create_session(options);
    vocab = created->info().vocab_size;
  } catch (const std::exception& e) {
    failure = e.what();
  }
  {
    std::lock_guard lock(mu);
    last_modified = now_seconds();
    if (!failure.empty()) {
      status = "Failed";
      error_details = failure.substr(0, 1024);
      end_time = last_modified;
    } else if (!stopping_) {
      session = created;
      vocab_size = vocab;
      status = "Running";
    }
  }
  while (failure.empty()) {
    std::shared_ptr<OperationRecord> op;
    {
      std::unique_lock lock(mu);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (stopping_) break;
      op = queue_.front();
      queue_.pop_front();
      op->state = {{"status", "InProgress"}};
    }
    json state;
    try {
      state = execute(*op);
    } catch (const std::exception& e) {
      state = {{"status", "Failed"}, {"errorDetails", std::string(e.what()).substr(0, 1024)}};
    }
    std::lock_guard lock(mu);
    op->state = std::move(state);
    last_modified = now_seconds();
    // Later training operations were planned on this one's effect (an optimizer step on its gradients, ...): skip
    // the ones already queued rather than run them on a state the caller did not expect.
    if (op->state["status"] == "Failed" && !op->sampling) {
      for (auto& queued : queue_)
        if (!queued->sampling) queued->state = {{"status", "Skipped"}};
      std::erase_if(queue_, [](const auto& q) { return !q->sampling; });
    }
  }
  std::lock_guard lock(mu);
  for (auto& queued : queue_) queued->state = queued->sampling ? json{{"status", "Failed"}, {"errorDetails", "session stopped"}}
                                                               : json{{"status", "Skipped"}};
  queue_.clear();
  session.reset();  // frees the model while the record stays describable
  if (status == "Stopping" || status == "Created") {
    status = "Stopped";
    end_time = last_modified = now_seconds();
  }
}

}  // namespace rlloop::server
