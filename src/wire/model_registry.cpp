#include "wire/model_registry.hpp"

#include <regex>

#include <rlloop/error.hpp>

namespace rlloop::wire {

using namespace read;

namespace {

std::string bounded(const json& body, const char* key, std::size_t lo, std::size_t hi, const char* pattern = nullptr) {
  const std::string v = string(need(body, "", key), key);
  if (v.size() < lo || v.size() > hi)
    fail(key, "length must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " +
                  std::to_string(v.size()));
  if (pattern && !std::regex_match(v, std::regex(pattern))) fail(key, "does not match " + std::string(pattern));
  return v;
}

std::string one_of(const json& body, const char* key, std::initializer_list<const char*> values) {
  const std::string v = string(need(body, "", key), key);
  std::string names;
  for (const char* a : values) {
    if (v == a) return v;
    names += (names.empty() ? "" : ", ") + std::string(a);
  }
  fail(key, "'" + v + "' is not one of " + names);
}

// The name an ARN ends with (".../name"), or the name itself.
std::string last_segment(const std::string& arn_or_name) { return arn_or_name.substr(arn_or_name.rfind('/') + 1); }

constexpr const char* kPackageName = R"((arn:aws[a-z\-]*:sagemaker:[a-z0-9\-]*:[0-9]{12}:[a-z\-]*\/)?([a-zA-Z0-9]([a-zA-Z0-9-]){0,62})(\/[0-9]{1,9})?)";
constexpr const char* kGroupName = R"((arn:aws[a-z\-]*:sagemaker:[a-z0-9\-]*:[0-9]{12}:[a-z\-]*\/)?([a-zA-Z0-9]([a-zA-Z0-9-]){0,62}))";
constexpr const char* kTrainable = "@capability:training_session";

}  // namespace

// ---- model packages ------------------------------------------------------------------------------------------

std::string describe_model_package_request_from_json(const json& body) {
  object(body, "");
  only_keys(body, "", {"ModelPackageName", "IncludedData"});
  if (find(body, "IncludedData")) one_of(body, "IncludedData", {"AllData", "MetadataOnly"});
  return bounded(body, "ModelPackageName", 1, 176, kPackageName);
}

json describe_model_package_response_to_json(const ModelPackageInfo& p) {
  json container{{"BaseModel", {{"HubContentName", p.base_model}, {"HubContentVersion", hub_content_version}}},
                 {"IsCheckpoint", p.is_checkpoint}};
  json out{{"ModelPackageName", p.group.empty() ? p.session : p.group},
           {"ModelPackageArn", p.arn},
           {"ModelPackageVersion", p.version},
           {"CreationTime", p.creation_time},
           {"ModelPackageStatus", "Completed"},
           {"ModelPackageStatusDetails", {{"ValidationStatuses", json::array()}}},
           {"ModelPackageDescription",
            std::string(p.is_checkpoint ? "saveState" : "saveWeights") + " of training session " + p.session},
           {"InferenceSpecification", {{"Containers", json::array({container})}}}};
  if (!p.group.empty()) out["ModelPackageGroupName"] = p.group;
  return out;
}

ListModelPackagesRequest list_model_packages_request_from_json(const json& body) {
  object(body, "");
  only_keys(body, "",
            {"CreationTimeAfter", "CreationTimeBefore", "MaxResults", "NameContains", "ModelApprovalStatus",
             "ModelPackageGroupName", "ModelPackageType", "NextToken", "SortBy", "SortOrder"});
  ListModelPackagesRequest r;
  if (find(body, "ModelPackageGroupName"))
    r.group = last_segment(bounded(body, "ModelPackageGroupName", 1, 170, kGroupName));
  if (find(body, "NameContains")) r.name_contains = bounded(body, "NameContains", 0, 63, "[a-zA-Z0-9\\-]*");
  if (find(body, "ModelApprovalStatus"))
    one_of(body, "ModelApprovalStatus", {"Approved", "Rejected", "PendingManualApproval"});
  if (find(body, "ModelPackageType")) one_of(body, "ModelPackageType", {"Versioned", "Unversioned", "Both"});
  if (find(body, "SortBy")) r.sort_by_name = one_of(body, "SortBy", {"Name", "CreationTime"}) == "Name";
  if (find(body, "SortOrder")) r.ascending = one_of(body, "SortOrder", {"Ascending", "Descending"}) == "Ascending";
  if (const json* v = find(body, "CreationTimeAfter")) r.creation_time_after = number(*v, "CreationTimeAfter");
  if (const json* v = find(body, "CreationTimeBefore")) r.creation_time_before = number(*v, "CreationTimeBefore");
  if (const json* v = find(body, "MaxResults")) r.max_results = integer(*v, "MaxResults", 1, 100);
  r.offset = page_offset(body);
  return r;
}

json list_model_packages_response_to_json(const std::vector<ModelPackageInfo>& page, std::optional<std::int64_t> next) {
  json rows = json::array();
  for (const auto& p : page) {
    const json full = describe_model_package_response_to_json(p);
    json row;
    for (const char* k : {"ModelPackageArn", "ModelPackageName", "ModelPackageVersion", "CreationTime",
                          "ModelPackageStatus", "ModelPackageDescription", "ModelPackageGroupName"})
      if (full.contains(k)) row[k] = full[k];
    rows.push_back(std::move(row));
  }
  json out{{"ModelPackageSummaryList", std::move(rows)}};
  if (next) out["NextToken"] = std::to_string(*next);
  return out;
}

// ---- the Hub -------------------------------------------------------------------------------------------------

namespace {
constexpr const char* kHubName = R"((arn:[a-z0-9-\.]{1,63}:sagemaker:\S{1,32}:[0-9]{12}:hub\/)?[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62})";
constexpr const char* kContentName = R"([a-zA-Z0-9](-*[a-zA-Z0-9]){0,62})";

void read_hub(const json& body, HubRequest& r) {
  r.hub = last_segment(bounded(body, "HubName", 1, 255, kHubName));
  r.content_type = one_of(body, "HubContentType", {"Model", "Notebook", "ModelReference", "DataSet", "JsonDoc"});
}
}  // namespace

HubRequest list_hub_contents_request_from_json(const json& body) {
  object(body, "");
  only_keys(body, "",
            {"HubName", "HubContentType", "NameContains", "MaxSchemaVersion", "CreationTimeBefore",
             "CreationTimeAfter", "SortBy", "SortOrder", "MaxResults", "NextToken"});
  HubRequest r;
  read_hub(body, r);
  if (find(body, "NameContains")) r.name_contains = bounded(body, "NameContains", 0, 63, "[a-zA-Z0-9-]*");
  if (find(body, "SortBy")) one_of(body, "SortBy", {"HubContentName", "CreationTime", "HubContentStatus"});
  if (find(body, "SortOrder")) one_of(body, "SortOrder", {"Ascending", "Descending"});
  if (const json* v = find(body, "CreationTimeAfter")) number(*v, "CreationTimeAfter");
  if (const json* v = find(body, "CreationTimeBefore")) number(*v, "CreationTimeBefore");
  if (find(body, "MaxSchemaVersion")) bounded(body, "MaxSchemaVersion", 5, 14, R"(\d{1,4}.\d{1,4}.\d{1,4})");
  if (const json* v = find(body, "MaxResults")) r.max_results = integer(*v, "MaxResults", 1, 100);
  r.offset = page_offset(body);
  return r;
}

HubRequest describe_hub_content_request_from_json(const json& body) {
  object(body, "");
  only_keys(body, "", {"HubName", "HubContentType", "HubContentName", "HubContentVersion"});
  HubRequest r;
  read_hub(body, r);
  r.name = bounded(body, "HubContentName", 1, 63, kContentName);
  if (find(body, "HubContentVersion")) bounded(body, "HubContentVersion", 5, 14, R"(\d{1,4}.\d{1,4}.\d{1,4})");
  return r;
}

std::string hub_content_arn(const std::string& name, const std::string& region) {
  return "arn:aws:sagemaker:" + region + ":aws:hub-content/" + public_hub_name + "/Model/" + name + "/" +
         hub_content_version;
}

bool is_hub_content_name(const std::string& name) { return std::regex_match(name, std::regex(kContentName)); }

json hub_content_summary_to_json(const std::string& name, const std::string& region, double listed_at) {
  return {{"HubContentName", name},
          {"HubContentArn", hub_content_arn(name, region)},
          {"HubContentVersion", hub_content_version},
          {"HubContentType", "Model"},
          {"DocumentSchemaVersion", "2.0.0"},
          {"HubContentStatus", "Available"},
          {"CreationTime", listed_at},
          {"HubContentSearchKeywords", json::array({kTrainable})}};
}

json list_hub_contents_response_to_json(const std::vector<json>& page, std::optional<std::int64_t> next) {
  json out{{"HubContentSummaries", page}};
  if (next) out["NextToken"] = std::to_string(*next);
  return out;
}

json describe_hub_content_response_to_json(const std::string& name, const std::string& region, double listed_at) {
  json out = hub_content_summary_to_json(name, region, listed_at);
  out["HubName"] = public_hub_name;
  out["HubArn"] = "arn:aws:sagemaker:" + region + ":aws:hub/" + public_hub_name;
  // The model's document: rlloop's catalogue names are the models' ids (no Hugging Face id to publish).
  out["HubContentDocument"] = json{{"ModelName", name}}.dump();
  return out;
}

}  // namespace rlloop::wire
