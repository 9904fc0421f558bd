// SageMaker JSON 1.1 control plane: Create / Describe / List / Stop / Delete TrainingSession (spec §2).
#include <algorithm>
#include <cstring>
#include <regex>

#include "server/api_impl.hpp"

namespace rlloop::server {

namespace {

// The wire module's field readers: their invalid_argument, naming the JSON path, becomes a ValidationException.
using wire::read::array;
using wire::read::at;
using wire::read::boolean;
using wire::read::fail;
using wire::read::find;
using wire::read::integer;
using wire::read::join;
using wire::read::need;
using wire::read::number;
using wire::read::object;
using wire::read::only_keys;
using wire::read::string;

[[noreturn]] void validation(const std::string& message) { throw api_error("ValidationException", 400, message); }

// Constraint helpers that turn the wire readers' invalid_argument into ValidationException.
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

json summary(SessionHost& s) {
  json j{{"TrainingSessionArn", s.arn},
         {"TrainingSessionStatus", to_string(s.status)},
         {"CreationTime", s.creation_time},
         {"LastModifiedTime", s.last_modified}};
  return j;
}

json detail(SessionHost& s) {
  json d = s.echo;
  d["TrainingSessionArn"] = s.arn;
  d["TrainingSessionName"] = s.name;
  d["TrainingSessionStatus"] = to_string(s.status);
  d["CreationTime"] = s.creation_time;
  d["LastModifiedTime"] = s.last_modified;
  if (s.end_time > 0) d["EndTime"] = s.end_time;
  if (!s.error_details.empty()) d["ErrorDetails"] = s.error_details;
  if (s.last_sequence_number >= 0) d["LastReceivedSequenceNumber"] = s.last_sequence_number;
  d["BillableTokenUsage"] = wire::billable_usage_to_json(s.usage);
  return d;
}

}  // namespace

json Api::Impl::control_plane(const std::string& target, const json& body, const std::shared_ptr<TenantState>& t) {
  const std::string prefix = "SageMaker.";
  const std::string op = target.rfind(prefix, 0) == 0 ? target.substr(prefix.size()) : "";
  try {
    object(body, "");
    if (op == "CreateTrainingSession") {
      only_keys(body, "",
                {"TrainingSessionName", "RoleArn", "LoraConfig", "ModelConfig", "OutputConfig", "ModelPackageGroupArn",
                 "VpcConfig", "Tags"});
      const std::string name = session_name(body);
      string_field(body, "", "RoleArn", 20, 2048, R"(arn:aws[a-z\-]*:iam::\d{12}:role/?[a-zA-Z_0-9+=,.@\-_/]+)");
      const json& lora = object(need(body, "", "LoraConfig"), "LoraConfig");
      only_keys(lora, "LoraConfig", {"Rank", "Alpha"});
      // Integers here; the bounds are rlloop/limits.hpp's.
      constexpr std::int64_t int32_min = std::numeric_limits<std::int32_t>::min();
      constexpr std::int64_t int32_max = std::numeric_limits<std::int32_t>::max();
      const int rank =
          static_cast<int>(integer(need(lora, "LoraConfig", "Rank"), "LoraConfig.Rank", int32_min, int32_max));
      const int alpha =
          static_cast<int>(integer(need(lora, "LoraConfig", "Alpha"), "LoraConfig.Alpha", int32_min, int32_max));
      validate(LoraOptions{rank, alpha, {"all-linear"}}, Naming{Naming::sagemaker, "LoraConfig"});
      const json& model = object(need(body, "", "ModelConfig"), "ModelConfig");
      only_keys(model, "ModelConfig", {"BaseModelArn", "AcceptEula"});
      const std::string base_arn = string_field(model, "ModelConfig", "BaseModelArn", 1, 2048);
      const std::string base = base_model_from(base_arn);
      if (base_arn.rfind("arn:", 0) == 0) {
        // A Hub ARN names a catalogue model: one this server does not serve is the model's ResourceNotFound, at
        // once, not a session that fails later.
        const auto served = backend.list_base_models();
        if (std::find(served.begin(), served.end(), base) == served.end())
          throw api_error("ResourceNotFound", 400,
                          "base model " + base + " (ModelConfig.BaseModelArn) is not served here");
      }
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

      SessionOptions opts;
      opts.base_model = base;
      opts.lora = LoraOptions{rank, alpha, {"all-linear"}};
      opts.name = name;
      json echo = body;
      echo.erase("TrainingSessionName");
      const std::string arn =
          "arn:aws:sagemaker:" + options.region + ":" + t->config.account_id + ":training-session/" + name;

      std::lock_guard lock(mu);
      if (sessions.count({t->config.id, name}))
        throw api_error("ResourceInUse", 400, "Training session " + name + " already exists");
      std::size_t live = 0;
      for (const auto& [key, s] : sessions) live += key.first == t->config.id;
      if (live >= t->config.max_sessions)
        throw api_error("ResourceLimitExceeded", 400,
                        "tenant " + t->config.id + " already has " + std::to_string(live) + " sessions (limit " +
                            std::to_string(t->config.max_sessions) + "); delete one first");
      auto host = std::make_shared<SessionHost>(t, name, arn, opts, echo, backend, host_config());
      host->journal({{"t", "session"},
                     {"arn", arn},
                     {"baseModel", opts.base_model},
                     {"rank", rank},
                     {"alpha", alpha},
                     {"echo", echo},
                     {"creationTime", host->creation_time}});
      sessions[{t->config.id, name}] = std::move(host);
      return {{"TrainingSessionArn", arn}};
    }
    if (op == "DescribeTrainingSession") {
      only_keys(body, "", {"TrainingSessionName"});
      auto s = find_session(*t, session_name(body));
      std::lock_guard lock(s->mu);
      return {{"TrainingSessionDetail", detail(*s)}};
    }
    if (op == "ListTrainingSessions") {
      only_keys(body, "",
                {"CreationTimeAfter", "CreationTimeBefore", "NameContains", "StatusEquals", "MaxResults", "NextToken"});
      const std::string contains =
          find(body, "NameContains")
              ? string_field(body, "", "NameContains", 0, limits::session_name_max, "[a-zA-Z0-9\\-]*")
              : "";
      std::optional<wire::SessionStatus> status;
      if (const json* v = find(body, "StatusEquals")) {
        const std::string name = string(*v, "StatusEquals");
        status = wire::session_status_from_string(name);
        if (!status) fail("StatusEquals", "'" + name + "' is not a training-session status");
      }
      const double after =
          find(body, "CreationTimeAfter") ? number(*find(body, "CreationTimeAfter"), "CreationTimeAfter") : -1e300;
      const double before =
          find(body, "CreationTimeBefore") ? number(*find(body, "CreationTimeBefore"), "CreationTimeBefore") : 1e300;
      const std::int64_t max_results =
          find(body, "MaxResults") ? integer(*find(body, "MaxResults"), "MaxResults", 1, 100) : 100;
      std::int64_t offset = 0;
      if (const json* tok = find(body, "NextToken")) {
        const std::string s = string(*tok, "NextToken");
        // At most 18 digits: std::stoll would throw out_of_range (a 500) on longer ones.
        if (s.empty() || s.size() > 18 || s.find_first_not_of("0123456789") != std::string::npos)
          fail("NextToken", "is not a token from a previous page");
        offset = std::stoll(s);
      }
      std::vector<std::shared_ptr<SessionHost>> mine;
      {
        std::lock_guard lock(mu);
        for (const auto& [key, s] : sessions)
          if (key.first == t->config.id) mine.push_back(s);
      }
      std::vector<json> rows;
      std::vector<std::pair<double, std::size_t>> order;
      for (auto& s : mine) {
        std::lock_guard lock(s->mu);
        if (s->name.find(contains) == std::string::npos) continue;
        if (status && s->status != *status) continue;
        if (s->creation_time <= after || s->creation_time >= before) continue;
        rows.push_back(summary(*s));
      }
      std::stable_sort(rows.begin(), rows.end(),
                       [](const json& a, const json& b) { return a["CreationTime"] > b["CreationTime"]; });
      json page = json::array();
      for (std::int64_t i = offset; i < static_cast<std::int64_t>(rows.size()) && i < offset + max_results; ++i)
        page.push_back(rows[i]);
      json out{{"TrainingSessionSummaries", std::move(page)}};
      if (offset + max_results < static_cast<std::int64_t>(rows.size()))
        out["NextToken"] = std::to_string(offset + max_results);
      return out;
    }
    if (op == "StopTrainingSession") {
      only_keys(body, "", {"TrainingSessionName"});
      auto s = find_session(*t, session_name(body));
      s->stop();
      return json::object();
    }
    if (op == "DeleteTrainingSession") {
      only_keys(body, "", {"TrainingSessionName"});
      const std::string name = session_name(body);
      auto s = find_session(*t, name);
      {
        std::lock_guard lock(s->mu);
        using enum wire::SessionStatus;
        if (s->status != stopped && s->status != failed && s->status != expired)
          throw api_error(
              "ResourceInUse", 400,
              "Training session " + name + " is " + std::string(to_string(s->status)) + "; stop it before deleting");
      }
      s->join();
      s->journal({{"t", "delete"}});
      std::lock_guard lock(mu);
      sessions.erase({t->config.id, name});
      return json::object();
    }
  } catch (const invalid_argument& e) {
    validation(e.what());
  }
  throw api_error("UnknownOperationException", 400, "unknown operation '" + target + "'");
}

std::shared_ptr<SessionHost> Api::Impl::find_session(const TenantState& t, const std::string& name) {
  std::lock_guard lock(mu);
  auto it = sessions.find({t.config.id, name});
  if (it == sessions.end()) throw api_error("ResourceNotFound", 400, "Training session " + name + " does not exist");
  return it->second;
}

}  // namespace rlloop::server
