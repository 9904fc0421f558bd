// SageMaker's control plane on the wire (JSON 1.1; docs/wire.md): Create / Describe / List / Stop / Delete
// TrainingSession, their request bodies read member by member (the model's types, lengths and patterns; the bounds
// are rlloop/limits.hpp's) and their answers written, with the model's member names (UpperCamelCase). A reader
// throws rlloop::invalid_argument naming the member ("LoraConfig.Rank: ..."); the server answers it as a
// ValidationException.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <rlloop/types.hpp>

#include "wire/read.hpp"

namespace rlloop::wire {

// ---- training-session status (the control plane's TrainingSessionStatus enum) --------------------------------

// The model's ten values. rlloop's sessions go Created -> Running (or Failed) -> Stopping -> Stopped; the others
// are the service's (ListTrainingSessions.StatusEquals accepts every one; DeleteTrainingSession is synchronous).
enum class SessionStatus {
  created,
  blocked,
  running,
  failed,
  scheduled,
  stopping,
  stopped,
  expired,
  deleting,
  deletion_failed,
};
inline constexpr SessionStatus session_statuses[] = {
    SessionStatus::created,   SessionStatus::blocked,         SessionStatus::running, SessionStatus::failed,
    SessionStatus::scheduled, SessionStatus::stopping,        SessionStatus::stopped, SessionStatus::expired,
    SessionStatus::deleting,  SessionStatus::deletion_failed,
};

// The wire string ("Created", ..., "DeletionFailed"): what Describe / List answer and what the journal keeps.
constexpr std::string_view to_string(SessionStatus s) noexcept {
  switch (s) {
    case SessionStatus::created:
      return "Created";
    case SessionStatus::blocked:
      return "Blocked";
    case SessionStatus::running:
      return "Running";
    case SessionStatus::failed:
      return "Failed";
    case SessionStatus::scheduled:
      return "Scheduled";
    case SessionStatus::stopping:
      return "Stopping";
    case SessionStatus::stopped:
      return "Stopped";
    case SessionStatus::expired:
      return "Expired";
    case SessionStatus::deleting:
      return "Deleting";
    case SessionStatus::deletion_failed:
      return "DeletionFailed";
  }
  return "unknown";
}
// The status a wire string names, matched exactly as the model's enum is; nullopt for any other string.
constexpr std::optional<SessionStatus> session_status_from_string(std::string_view s) noexcept {
  for (SessionStatus v : session_statuses)
    if (to_string(v) == s) return v;
  return std::nullopt;
}

// ---- requests ------------------------------------------------------------------------------------------------

// CreateTrainingSession: what the service acts on, and what Describe echoes.
struct CreateTrainingSessionRequest {
  std::string name;                // TrainingSessionName
  LoraOptions lora;                // LoraConfig.Rank / Alpha, on every linear module
  std::string base_model_arn;      // ModelConfig.BaseModelArn as sent
  std::string base_model;          // its model id (".../Model/<id>/<version>"), or the plain catalogue name sent
  bool base_model_is_arn = false;  // a Hub ARN (the server checks it serves the model), not a plain name
  json echo;                       // the body less TrainingSessionName: the inputs DescribeTrainingSession echoes
};
CreateTrainingSessionRequest create_training_session_request_from_json(const json& body);

// DescribeTrainingSession, StopTrainingSession and DeleteTrainingSession: their TrainingSessionName, the only member.
std::string training_session_name_request_from_json(const json& body);

struct ListTrainingSessionsRequest {
  std::string name_contains;                   // NameContains ("" = any)
  std::optional<SessionStatus> status_equals;  // StatusEquals
  double creation_time_after = -1e300;         // CreationTimeAfter (exclusive)
  double creation_time_before = 1e300;         // CreationTimeBefore (exclusive)
  std::int64_t max_results = 100;              // MaxResults, 1-100
  std::int64_t offset = 0;                     // NextToken: where the page starts
};
ListTrainingSessionsRequest list_training_sessions_request_from_json(const json& body);

// ---- answers -------------------------------------------------------------------------------------------------

// A session as ListTrainingSessions summarises it.
struct TrainingSessionSummary {
  std::string arn;
  SessionStatus status = SessionStatus::created;
  double creation_time = 0;
  double last_modified = 0;
};
// A session as DescribeTrainingSession details it: its create inputs (the echo), then what the service adds.
struct TrainingSessionDetail {
  TrainingSessionSummary summary;
  std::string name;
  json echo = json::object();
  double end_time = 0;                     // 0 = not ended
  std::string error_details;               // "" = none
  std::int64_t last_sequence_number = -1;  // -1 = no training operation received
  TokenUsage billable_usage;
};
struct ListTrainingSessionsResponse {
  std::vector<TrainingSessionSummary> summaries;  // this page
  std::optional<std::int64_t> next_offset;        // where the next page starts (written as NextToken), if any
};

json create_training_session_response_to_json(const std::string& arn);
json to_json(const TrainingSessionSummary& s);
json describe_training_session_response_to_json(const TrainingSessionDetail& d);
json to_json(const ListTrainingSessionsResponse& r);

}  // namespace rlloop::wire
