// The SageMaker control-plane calls outside the training-session APIs that the SageMaker Python SDK makes
// (JSON 1.1, target prefix "SageMaker."): the model registry's DescribeModelPackage and ListModelPackages (training
// and sampling clients from a checkpoint's ARN, list_model_packages) and the Hub's ListHubContents and
// DescribeHubContent (list_base_models, a base model named by id). Requests are read with the members, types and
// bounds of botocore's `sagemaker` service model; answers carry the members the model requires and those the SDK
// reads (docs/wire.md, "Model packages and the Hub").
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "wire/read.hpp"

namespace rlloop::wire {

// The one Hub rlloop serves, and the version it gives every model in it.
inline constexpr const char* public_hub_name = "SageMakerPublicHub";
inline constexpr const char* hub_content_version = "1.0.0";

// ---- model packages ------------------------------------------------------------------------------------------

struct ModelPackageInfo {
  std::string arn;
  std::string session;      // the training session that saved it (the package name when it has no group)
  std::string group;        // its group's name, "" for none
  std::int64_t version = 0;
  double creation_time = 0;
  std::string base_model;   // the Hub content name of its base model
  bool is_checkpoint = false;
};

// DescribeModelPackage's ModelPackageName (an ARN or a name).
std::string describe_model_package_request_from_json(const json& body);
json describe_model_package_response_to_json(const ModelPackageInfo& p);

struct ListModelPackagesRequest {
  std::string group;                    // ModelPackageGroupName, an ARN's last segment or a name; "" = any
  std::string name_contains;            // NameContains
  double creation_time_after = -1e300;  // CreationTimeAfter (exclusive)
  double creation_time_before = 1e300;  // CreationTimeBefore (exclusive)
  bool sort_by_name = false;            // SortBy Name (else CreationTime)
  bool ascending = false;               // SortOrder Ascending (else Descending)
  std::int64_t max_results = 100;       // MaxResults, 1-100
  std::int64_t offset = 0;              // NextToken: where the page starts
};
ListModelPackagesRequest list_model_packages_request_from_json(const json& body);
// One page, and where the next starts when there is one.
json list_model_packages_response_to_json(const std::vector<ModelPackageInfo>& page, std::optional<std::int64_t> next);

// ---- the Hub -------------------------------------------------------------------------------------------------

struct HubRequest {
  std::string hub;           // HubName
  std::string content_type;  // HubContentType
  std::string name;          // DescribeHubContent's HubContentName ("" for ListHubContents)
  std::string name_contains; // ListHubContents' NameContains
  std::int64_t max_results = 100;
  std::int64_t offset = 0;
};
HubRequest list_hub_contents_request_from_json(const json& body);
HubRequest describe_hub_content_request_from_json(const json& body);

// A base model as the Hub lists it: `region` goes into its ARN, `listed_at` is its CreationTime. Every entry
// carries the keyword that marks it trainable in training sessions ("@capability:training_session").
json hub_content_summary_to_json(const std::string& name, const std::string& region, double listed_at);
json list_hub_contents_response_to_json(const std::vector<json>& page, std::optional<std::int64_t> next);
json describe_hub_content_response_to_json(const std::string& name, const std::string& region, double listed_at);

// The Hub ARN of a base model: arn:aws:sagemaker:{region}:aws:hub-content/SageMakerPublicHub/Model/{name}/1.0.0.
std::string hub_content_arn(const std::string& name, const std::string& region);
// Whether a base model's name can be a Hub content name ([a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}).
bool is_hub_content_name(const std::string& name);

}  // namespace rlloop::wire
