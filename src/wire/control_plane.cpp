#include "wire/control_plane.hpp"

#include <cctype>
#include <cstring>
#include <limits>
#include <regex>

#include <rlloop/error.hpp>
#include <rlloop/limits.hpp>

#include "wire/runtime.hpp"

namespace rlloop::wire {

using namespace read;

namespace {

// A string member of [min_len, max_len] characters, matching `pattern` when given.
std::string string_field(const json& obj, const std::string& path, const char* key, std::size_t min_len,
                         std::size_t max_len, const char* pattern = nullptr) {
  const std::string v = string(need(obj, path, key), join(path, key));
  if (v.size() < min_len || v.size() > max_len)
    fail(join(path, key), "length must be in [" + std::to_string(min_len) + ", " + std::to_string(max_len) + "], got " +
                              std::to_string(v.size()));
  if (pattern && !std::regex_match(v, std::regex(pattern)))
    fail(join(path, key), "does not match " + std::string(pattern));
  return v;
}

// Tag keys and values: the model's ([\p{L}\p{Z}\p{N}_.:/=+\-@]*), letters, separators and numbers of any script
// (std::regex has no Unicode classes; bytes of multi-byte UTF-8 sequences count as letters).
void check_tag_text(const std::string& v, const std::string& path) {
  for (unsigned char c : v)
    if (!(c >= 0x80 || std::isalnum(c) || c == ' ' || std::strchr("_.:/=+-@", c)))
      fail(path, "character '" + std::string(1, static_cast<char>(c)) + "' is not allowed in a tag");
}

// VpcConfig: 1-5 security group ids and 1-16 subnet ids (rlloop runs no VPC; it is validated and echoed).
void check_vpc_config(const json& vpc) {
  object(vpc, "VpcConfig");
  only_keys(vpc, "VpcConfig", {"SecurityGroupIds", "Subnets"});
  auto ids = [&](const char* key, std::size_t max, const char* pattern) {
    const std::string path = join("VpcConfig", key);
    const json& list = array(need(vpc, "VpcConfig", key), path);
    if (list.empty() || list.size() > max) fail(path, "needs 1 to " + std::to_string(max) + " entries");
    const std::regex id_re(pattern);
    for (std::size_t i = 0; i < list.size(); ++i) {
      const std::string v = string(list[i], at(path, i));
      if (v.size() > 32 || !std::regex_match(v, id_re)) fail(at(path, i), "does not match " + std::string(pattern));
    }
  };
  ids("SecurityGroupIds", 5, "[-0-9a-zA-Z]+");
  ids("Subnets", 16, "[-0-9a-zA-Z]+");
}

std::string session_name(const json& body) {
  std::string name = string(need(body, "", "TrainingSessionName"), "TrainingSessionName");
  validate_session_name(name, "TrainingSessionName");
  return name;
}

// The base model the Service gets: the model id of a SageMaker Hub ARN (".../Model/<id>/<version>"), or, as an
// rlloop extension for local use, a plain catalogue name.
std::string base_model_from(const std::string& arn) {
  if (arn.rfind("arn:", 0) != 0) return arn;
  static const std::regex hub(
      R"((arn:[a-z0-9-.]{1,63}:sagemaker:[a-zA-Z0-9]+(?:-[a-zA-Z0-9]+)+:([0-9]{12}|aws):hub-content/)[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}/Model/([a-zA-Z0-9](-*[a-zA-Z0-9]){0,63})(/[0-9]{1,4}\.[0-9]{1,4}\.[0-9]{1,4})?)");
  std::smatch m;
  if (!std::regex_match(arn, m, hub)) fail("ModelConfig.BaseModelArn", "is not a SageMaker Hub model ARN");
  return m[4].str();
}

}  // namespace

CreateTrainingSessionRequest create_training_session_request_from_json(const json& body) {
  object(body, "");
  only_keys(body, "",
            {"TrainingSessionName", "RoleArn", "LoraConfig", "ModelConfig", "OutputConfig", "ModelPackageGroupArn",
             "VpcConfig", "Tags"});
  CreateTrainingSessionRequest r;
  r.name = session_name(body);
  string_field(body, "", "RoleArn", 20, 2048, R"(arn:aws[a-z\-]*:iam::\d{12}:role/?[a-zA-Z_0-9+=,.@\-_/]+)");
  const json& lora = object(need(body, "", "LoraConfig"), "LoraConfig");
  only_keys(lora, "LoraConfig", {"Rank", "Alpha"});
  // Integers here; the bounds are rlloop/limits.hpp's.
  constexpr std::int64_t int32_min = std::numeric_limits<std::int32_t>::min();
  constexpr std::int64_t int32_max = std::numeric_limits<std::int32_t>::max();
  r.lora.rank = static_cast<int>(integer(need(lora, "LoraConfig", "Rank"), "LoraConfig.Rank", int32_min, int32_max));
  r.lora.alpha = static_cast<int>(integer(need(lora, "LoraConfig", "Alpha"), "LoraConfig.Alpha", int32_min, int32_max));
  r.lora.target_modules = {"all-linear"};
  validate(r.lora, Naming{Naming::sagemaker, "LoraConfig"});
  const json& model = object(need(body, "", "ModelConfig"), "ModelConfig");
  only_keys(model, "ModelConfig", {"BaseModelArn", "AcceptEula"});
  r.base_model_arn = string_field(model, "ModelConfig", "BaseModelArn", 1, 2048);
  r.base_model = base_model_from(r.base_model_arn);
  r.base_model_is_arn = r.base_model_arn.rfind("arn:", 0) == 0;
  if (const json* e = find(model, "AcceptEula")) boolean(*e, "ModelConfig.AcceptEula");
  const json& output = object(need(body, "", "OutputConfig"), "OutputConfig");
  only_keys(output, "OutputConfig", {"S3Location"});
  const json& s3 = object(need(output, "OutputConfig", "S3Location"), "OutputConfig.S3Location");
  only_keys(s3, "OutputConfig.S3Location", {"Path", "KmsKeyArn"});
  string_field(s3, "OutputConfig.S3Location", "Path", 1, 1024, "(https|s3)://([^/]+)/?(.*)");
  if (find(s3, "KmsKeyArn"))
    string_field(s3, "OutputConfig.S3Location", "KmsKeyArn", 1, 2048,
                 R"(arn:aws[a-z\-]*:kms:[a-z0-9\-]+:[0-9]{12}:key/(mrk-)?[a-f0-9\-]+)");
  if (find(body, "ModelPackageGroupArn"))
    string_field(body, "", "ModelPackageGroupArn", 1, 2048,
                 R"(arn:aws[a-z\-]*:sagemaker:[a-z0-9\-]{9,16}:[0-9]{12}:model-package-group/[\S]{1,2048})");
  if (const json* vpc = find(body, "VpcConfig")) check_vpc_config(*vpc);
  if (const json* tags = find(body, "Tags")) {
    array(*tags, "Tags");
    if (tags->size() > 50) fail("Tags", "at most 50 tags");
    for (std::size_t i = 0; i < tags->size(); ++i) {
      object((*tags)[i], at("Tags", i));
      only_keys((*tags)[i], at("Tags", i), {"Key", "Value"});
      check_tag_text(string_field((*tags)[i], at("Tags", i), "Key", 1, 128), join(at("Tags", i), "Key"));
      check_tag_text(string_field((*tags)[i], at("Tags", i), "Value", 0, 256), join(at("Tags", i), "Value"));
    }
  }
  r.echo = body;
  r.echo.erase("TrainingSessionName");
  return r;
}

std::string training_session_name_request_from_json(const json& body) {
  object(body, "");
  only_keys(body, "", {"TrainingSessionName"});
  return session_name(body);
}

ListTrainingSessionsRequest list_training_sessions_request_from_json(const json& body) {
  object(body, "");
  only_keys(body, "",
            {"CreationTimeAfter", "CreationTimeBefore", "NameContains", "StatusEquals", "MaxResults", "NextToken"});
  ListTrainingSessionsRequest r;
  if (find(body, "NameContains"))
    r.name_contains = string_field(body, "", "NameContains", 0, limits::session_name_max, "[a-zA-Z0-9\\-]*");
  if (const json* v = find(body, "StatusEquals")) {
    const std::string name = string(*v, "StatusEquals");
    r.status_equals = session_status_from_string(name);
    if (!r.status_equals) fail("StatusEquals", "'" + name + "' is not a training-session status");
  }
  if (const json* v = find(body, "CreationTimeAfter")) r.creation_time_after = number(*v, "CreationTimeAfter");
  if (const json* v = find(body, "CreationTimeBefore")) r.creation_time_before = number(*v, "CreationTimeBefore");
  if (const json* v = find(body, "MaxResults")) r.max_results = integer(*v, "MaxResults", 1, 100);
  r.offset = page_offset(body);
  return r;
}

json create_training_session_response_to_json(const std::string& arn) { return {{"TrainingSessionArn", arn}}; }

json to_json(const TrainingSessionSummary& s) {
  return {{"TrainingSessionArn", s.arn},
          {"TrainingSessionStatus", to_string(s.status)},
          {"CreationTime", s.creation_time},
          {"LastModifiedTime", s.last_modified}};
}

json describe_training_session_response_to_json(const TrainingSessionDetail& s) {
  json d = s.echo;
  d.update(to_json(s.summary));
  d["TrainingSessionName"] = s.name;
  if (s.end_time > 0) d["EndTime"] = s.end_time;
  if (!s.error_details.empty()) d["ErrorDetails"] = s.error_details;
  if (s.last_sequence_number >= 0) d["LastReceivedSequenceNumber"] = s.last_sequence_number;
  d["BillableTokenUsage"] = billable_usage_to_json(s.billable_usage);
  return {{"TrainingSessionDetail", std::move(d)}};
}

json to_json(const ListTrainingSessionsResponse& r) {
  json page = json::array();
  for (const auto& s : r.summaries) page.push_back(to_json(s));
  json out{{"TrainingSessionSummaries", std::move(page)}};
  if (r.next_offset) out["NextToken"] = std::to_string(*r.next_offset);
  return out;
}

}  // namespace rlloop::wire
