// What each operation does to a hosted session: the session call it makes (training operations, samples,
// logprobs, checkpoints), the tokens it bills and the model packages it issues or resolves. The queue, the
// journal and the operation's lifecycle around it are session_host.cpp's.
#include <cstdint>
#include <filesystem>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include <rlloop/detail/visit.hpp>

#include "server/api_impl.hpp"
#include "server/journal.hpp"

namespace rlloop::server {

using wire::OperationStatus;

void SessionHost::bill(OperationRecord& op, const TokenUsage& u) {
  op.billed += u;
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
  if (it == tenant->checkpoints.end())
    throw not_found("model package '" + package_arn + "' does not exist in this account");
  return it->second.path;
}

std::string SessionHost::add_checkpoint(const std::string& path, bool is_checkpoint) {
  std::lock_guard lock(tenant->mu);
  const std::int64_t n = tenant->next_checkpoint++;
  const std::string package = "arn:aws:sagemaker:" + config_.region + ":" + tenant->config.account_id +
                              ":model-package/" + name + "/" + std::to_string(n);
  ModelPackage made{path, name, options.base_model, is_checkpoint, now_seconds(), n,
                    echo.value("ModelPackageGroupArn", "")};
  // Journaled before the ARN is returned to anyone, so a restarted server still resolves it.
  journal(checkpoint_record(package, made));
  tenant->checkpoints[package] = std::move(made);
  return package;
}

void SessionHost::replay(const wire::TrainingOperation& op) {
  std::visit(
      [&](const auto& o) {
        using Op = wire::OperationOfShape<std::decay_t<decltype(o)>, wire::Call::training>;
        if constexpr (Op::replayed)
          rerun(o);
        else
          throw std::logic_error("SessionHost::replay: the journal replays only the operations marked replayed, not " +
                                 std::string(Op::name));
      },
      op);
}

void SessionHost::rerun(const wire::ForwardBackwardOp& op) { session->forward_backward(op.data, op.loss).get(); }

void SessionHost::rerun(const wire::LoadStateOp& op) {
  session->load_state(resolve_checkpoint(op.model_package_arn), op.load_optimizer).get();
}

bool SessionHost::is_sample(const OperationRecord& op) {
  const auto* s = std::get_if<wire::SamplingOperation>(&op.op);
  return s && std::holds_alternative<SampleRequest>(*s);
}

namespace {
const SampleRequest& sample_request(const OperationRecord& op) {
  return std::get<SampleRequest>(std::get<wire::SamplingOperation>(op.op));
}
}  // namespace

Future<SampleResponse> SessionHost::start_sample(OperationRecord& op) {
  SampleRequest req = sample_request(op);
  req.model_path = req.model_path ? std::optional(resolve_checkpoint(*req.model_path)) : sampler_path_;
  if (op.stream && sample_streaming_)
    return sample_streaming_(req, [stream = op.stream](const SampleResponse& so_far) { stream->update(so_far); });
  return session->sample(req);
}

json SessionHost::sample_state(OperationRecord& op, SampleResponse r) {
  // Each sequence reports the prompt as its prefill (spec SampleTokenUsage); billed once by default.
  TokenUsage u;
  for (const auto& seq : r.sequences) {
    if (config_.bill_prompt_per_sample) u.prefill += seq.prefill_tokens;
    u.sample += seq.decode_tokens;
  }
  if (!config_.bill_prompt_per_sample) u.prefill = static_cast<std::int64_t>(sample_request(op).prompt.length());
  bill(op, u);
  op.sample_result = std::make_shared<SampleResponse>(r);
  return wire::to_json(wire::SamplingOperationState{OperationStatus::completed, wire::SamplingResult{std::move(r)},
                                                    std::nullopt, std::nullopt});
}

json SessionHost::execute(OperationRecord& op) {
  // Checkpoint names are unique per tenant and session so tenants never share a directory.
  auto checkpoint_name = [&](const char* kind) {
    std::lock_guard lock(tenant->mu);
    return tenant->config.id + "-" + name + "-" + kind + "-" + std::to_string(tenant->next_checkpoint);
  };
  if (const auto* t = std::get_if<wire::TrainingOperation>(&op.op)) {
    std::optional<std::int64_t> training_tokens;  // the state's top-level tokenUsage: forward, forwardBackward
    wire::TrainingResult result = std::visit(
        [&](const auto& o) -> wire::TrainingResult {
          using T = std::decay_t<decltype(o)>;
          if constexpr (std::is_same_v<T, wire::ForwardOp> || std::is_same_v<T, wire::ForwardBackwardOp>) {
            using Op = wire::OperationOfShape<T, wire::Call::training>;
            ForwardBackwardOutput out = Op::call(*session, o.data, o.loss).get();
            bill(op, TokenUsage{0, 0, out.training_tokens});
            training_tokens = out.training_tokens;
            return typename wire::Binding<Op>::Result{std::move(out)};
          } else if constexpr (std::is_same_v<T, wire::OptimizerStepOp>) {
            return session->optim_step(o.adam).get();
          } else if constexpr (std::is_same_v<T, wire::SaveWeightsOp>) {
            if (o.merge_weights || o.peft_adapter) {
              const auto& write = o.merge_weights ? export_merged_ : export_peft_;
              const char* what = o.merge_weights ? "mergeWeights" : "rlloopPeftAdapter";
              if (!write)
                throw unsupported(std::string("saveWeights.") + what + " is not supported by this server's sessions");
              const auto dir = std::filesystem::path(config_.export_dir) /
                               checkpoint_name(o.merge_weights ? "merged" : "peft");
              return wire::SaveWeightsResult{add_checkpoint(write(dir.string()).get().path, false)};
            }
            return wire::SaveWeightsResult{
                add_checkpoint(session->save_weights_for_sampler(checkpoint_name("weights")).get().path, false)};
          } else if constexpr (std::is_same_v<T, wire::SaveStateOp>) {
            return wire::SaveStateResult{
                add_checkpoint(session->save_state(checkpoint_name("state")).get().path, true)};
          } else if constexpr (std::is_same_v<T, wire::LoadStateOp>) {
            session->load_state(resolve_checkpoint(o.model_package_arn), o.load_optimizer).get();
            return LoadStateOutput{};
          } else {
            static_assert(rlloop::detail::unhandled_alternative<T>,
                          "a training operation the session host does not run");
          }
        },
        *t);
    return wire::to_json(
        wire::TrainingOperationState{OperationStatus::completed, std::move(result), std::nullopt, training_tokens});
  }
  const auto& s = std::get<wire::SamplingOperation>(op.op);
  wire::SamplingResult result = std::visit(
      [&](const auto& o) -> wire::SamplingResult {
        using T = std::decay_t<decltype(o)>;
        if constexpr (std::is_same_v<T, SampleRequest>) {
          throw std::logic_error("SessionHost::execute: samples start beside each other (start_beside)");
        } else if constexpr (std::is_same_v<T, ComputeLogprobsRequest>) {
          ComputeLogprobsRequest req = o;
          req.model_path = o.model_path ? std::optional(resolve_checkpoint(*o.model_path)) : sampler_path_;
          auto lp = session->compute_logprobs(req).get();
          bill(op, TokenUsage{static_cast<std::int64_t>(o.prompt.length()), 0, 0});
          return wire::ComputeLogprobsResult{std::move(lp)};
        } else if constexpr (std::is_same_v<T, wire::LoadWeightsForSamplingOp>) {
          sampler_path_ = resolve_checkpoint(o.model_package_arn);
          return wire::LoadWeightsForSamplingResult{};
        } else {
          static_assert(rlloop::detail::unhandled_alternative<T>, "a sampling operation the session host does not run");
        }
      },
      s);
  return wire::to_json(
      wire::SamplingOperationState{OperationStatus::completed, std::move(result), std::nullopt, std::nullopt});
}

}  // namespace rlloop::server
