// SageMaker's runtime API on the wire (docs/wire.md): the operation unions, their results and states, with the API's
// field names (lowerCamelCase), translated to and from the core's plain types. Writers produce what the service
// expects; readers validate every type and required field and throw rlloop::invalid_argument naming the JSON path
// ("operationConfig.forwardBackward.datumList[2].lossFnInputs.weights.data: expected numbers"), so a malformed request
// is rejected the same way by the server and by the client's own checks; the bounds are rlloop/limits.hpp's. Output
// readers (results) tolerate unknown keys; input readers (requests) reject unknown union members and unknown loss
// inputs, as the spec requires.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include <rlloop/loss.hpp>
#include <rlloop/types.hpp>

#include "wire/operations.hpp"
#include "wire/read.hpp"

namespace rlloop::wire {

// ---- the unions (derived from the bindings in wire/operations.hpp) ---------------------------------------------

using TrainingOperation = Unions<CarriedOperations<Call::training>>::Request;
using SamplingOperation = Unions<CarriedOperations<Call::sampling>>::Request;
using TrainingResult = Unions<CarriedOperations<Call::training>>::Result;
using SamplingResult = Unions<CarriedOperations<Call::sampling>>::Result;

// ExecuteTrainingOperation body.
struct ExecuteTrainingRequest {
  std::int64_t sequence_number = 0;
  std::optional<std::string> client_token;
  TrainingOperation operation;
};

// Get*OperationResult's status: queued, running, then one of the three terminal states (Skipped: a training
// operation queued behind one that failed).
enum class OperationStatus { pending, in_progress, completed, failed, skipped };

// The wire string: "Pending", "InProgress", "Completed", "Failed" or "Skipped".
constexpr std::string_view to_string(OperationStatus s) noexcept {
  switch (s) {
    case OperationStatus::pending:
      return "Pending";
    case OperationStatus::in_progress:
      return "InProgress";
    case OperationStatus::completed:
      return "Completed";
    case OperationStatus::failed:
      return "Failed";
    case OperationStatus::skipped:
      return "Skipped";
  }
  return "unknown";
}
// The status a wire string names; nullopt for any other string.
constexpr std::optional<OperationStatus> operation_status_from_string(std::string_view s) noexcept {
  for (OperationStatus v : {OperationStatus::pending, OperationStatus::in_progress, OperationStatus::completed,
                            OperationStatus::failed, OperationStatus::skipped})
    if (to_string(v) == s) return v;
  return std::nullopt;
}
// Whether an operation is finished (its state and result are final).
constexpr bool is_terminal(OperationStatus s) noexcept {
  return s != OperationStatus::pending && s != OperationStatus::in_progress;
}

// Get*OperationResult body.
template <class Result>
struct OperationState {
  OperationStatus status = OperationStatus::pending;
  std::optional<Result> result;
  std::optional<std::string> error_details;
  std::optional<std::int64_t> training_tokens;  // top-level tokenUsage (training operations only)
};
using TrainingOperationState = OperationState<TrainingResult>;
using SamplingOperationState = OperationState<SamplingResult>;

// ---- numbers on the wire ----------------------------------------------------------------------------------------

// A double as AWS writes it: a JSON number, or "NaN" / "Infinity" / "-Infinity" (nlohmann would write null, which
// botocore's parser and read::number reject). Every double the writers below emit goes through it.
json wire_number(double v);

// ---- ModelInput / TensorData / Datum -------------------------------------------------------------------------

json to_json(const ModelInput& in);
ModelInput model_input_from_json(const json& j, const std::string& path);
json to_json(const TensorData& t);
// Accepts flat `data` (with an optional `shape` whose product must match) or nested `data` (shape inferred).
TensorData tensor_from_json(const json& j, const std::string& path);
json to_json(const Datum& d);
Datum datum_from_json(const json& j, const std::string& path);

// ---- losses, sampling and optimizer settings -----------------------------------------------------------------

// Writes lossFnName and lossFnConfig into an operation config object. The wire carries the ppo / cispo clip as
// thresholds, the spec as epsilons: loss_config and loss_from_config (wire/loss_config.hpp) translate.
void write_loss(json& j, const LossSpec& loss);
LossSpec loss_from_json(const json& obj, const std::string& path);
json to_json(const SamplingParams& p);
SamplingParams sampling_params_from_json(const json& j, const std::string& path);
json to_json(const AdamParams& a);
// Ranges from the spec's AdamParamsConfig table; omitted optional fields keep AdamParams' defaults.
AdamParams adam_from_json(const json& j, const std::string& path);

// ---- requests ------------------------------------------------------------------------------------------------

json to_json(const TrainingOperation& op);
TrainingOperation training_operation_from_json(const json& j, const std::string& path);
json to_json(const ExecuteTrainingRequest& r);
bool is_valid_client_token(const std::string& s);
ExecuteTrainingRequest execute_training_request_from_json(const json& j);
json to_json(const SampleRequest& r);
json to_json(const SamplingOperation& op);
SamplingOperation sampling_operation_from_json(const json& j, const std::string& path);
// ExecuteSamplingOperation body: only operationConfig.
SamplingOperation execute_sampling_request_from_json(const json& j);

// ---- results -------------------------------------------------------------------------------------------------

json to_json(const ForwardBackwardOutput& o);
// Every member is optional in the spec's ForwardResult; unknown keys are tolerated (this is service output).
ForwardBackwardOutput forward_backward_output_from_json(const json& j, const std::string& path);
json to_json(const TrainingResult& r);
TrainingResult training_result_from_json(const json& j, const std::string& path);
json to_json(const SampledSequence& s);
json to_json(const SampleResponse& r);
SampleResponse sample_response_from_json(const json& j, const std::string& path);
json to_json(const SamplingResult& r);
SamplingResult sampling_result_from_json(const json& j, const std::string& path);
json to_json(const TrainingOperationState& s);
json to_json(const SamplingOperationState& s);
TrainingOperationState training_state_from_json(const json& j);
SamplingOperationState sampling_state_from_json(const json& j);

// ---- rlloop extensions: session info, usage and capabilities (not in the SageMaker spec) ---------------------

// rlloop's own usage reports ("prefill", "sample", "training"); absent members read as 0.
json to_json(const TokenUsage& u);
TokenUsage token_usage_from_json(const json& j, const std::string& path);
// DescribeTrainingSession's BillableTokenUsage (the SageMaker model's names); absent members read as 0.
json billable_usage_to_json(const TokenUsage& u);
TokenUsage billable_usage_from_json(const json& j, const std::string& path);
json to_json(const LoraOptions& l);
// Service output (session info): the bounds were the creator's to check.
LoraOptions lora_from_json(const json& j, const std::string& path);
json to_json(const SessionInfo& s);
SessionInfo session_info_from_json(const json& j, const std::string& path);
json to_json(const ServerCapabilities& c);
ServerCapabilities capabilities_from_json(const json& j, const std::string& path);

}  // namespace rlloop::wire
