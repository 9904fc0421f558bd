// What Tinker's route files share: tinker.cpp (sessions, models, operations and their futures) and
// tinker_checkpoints.cpp (tinker:// checkpoints, their lifetimes and files, training runs). Answers, errors,
// lookups. Not installed.
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "server/api_impl.hpp"
#include "server/tinker.hpp"
#include "wire/read.hpp"

namespace rlloop::server::tinker_routes {

inline Response json_ok(const json& j) { return Response{200, "application/json", {}, j.dump()}; }
// The SDK raises a 4xx's {"error", "category": "user"} with its message (api.cpp's error_response writes it).
[[noreturn]] inline void user_error(const std::string& message) { throw api_error("BadRequest", 400, message); }
[[noreturn]] inline void not_found(const std::string& message) { throw api_error("NotFound", 404, message); }

// A request's JSON body ({} when empty).
inline json parse_body(const sigv4::HttpRequest& req) {
  try {
    return req.body.empty() ? json::object() : json::parse(req.body);
  } catch (const json::exception& e) {
    user_error(std::string("request body is not valid JSON: ") + e.what());
  }
}

// A string member the request needs.
inline std::string need_string(const json& body, const char* key) {
  return wire::read::string(wire::read::need(body, "", key), key);
}

// "2026-12-06T15:25:00Z": a time as the SDK's pydantic models read a datetime.
std::string iso_time(double seconds);

inline std::string tinker_path(const std::string& model_id, const char* segment, const std::string& name) {
  return "tinker://" + model_id + "/" + segment + "/" + name;
}

// The tenant's record under `id` in `map`, copied out (404 naming `what` otherwise).
template <class Map>
typename Map::mapped_type find_owned(TinkerRoutes& r, Map& map, const std::string& id, const std::string& tenant,
                                     const char* what) {
  std::lock_guard lock(r.mu);
  const auto it = map.find(id);
  if (it == map.end() || it->second.tenant != tenant) not_found(std::string(what) + " '" + id + "' does not exist");
  return it->second;
}

// ---- tinker_checkpoints.cpp ------------------------------------------------------------------------------------

// A save request's ttl_seconds: 0 when absent or null (never expires), else 3600 (an hour) to ten years.
std::int64_t ttl_of(const json& body);

// Registers the checkpoint a finished save future `f` made (its model package `package`, of `type` "training",
// "sampler" or "external") at its tinker:// path, journaled; returns the path.
std::string register_checkpoint(TinkerRoutes& r, const TinkerRoutes::Future& f, const std::string& package,
                                const std::string& type);

// POST weights_info.
json weights_info(TinkerRoutes& r, const json& body, const std::shared_ptr<TenantState>& t);

// The GET routes of checkpoints and training runs (`seg`: the path's segments after /api/v1/), or nothing.
std::optional<json> checkpoint_get_route(Api::Impl& im, const sigv4::HttpRequest& req,
                                         const std::vector<std::string>& seg, const std::shared_ptr<TenantState>& t);

// The RestClient's changes to one checkpoint, training_runs/{model}/checkpoints/{kind}/{name}[/...]: DELETE it,
// PUT .../ttl, and .../publish (refused by name), or nothing for another route.
std::optional<json> checkpoint_change(Api::Impl& im, const sigv4::HttpRequest& req,
                                      const std::vector<std::string>& seg, const std::shared_ptr<TenantState>& t);

// The checkpoints whose time to live ran out by `now` (r.mu held): (tenant, tinker:// path).
std::vector<std::pair<std::string, std::string>> expired_checkpoints_locked(const TinkerRoutes& r, double now);

// Deletes checkpoint `path` of `tenant` (r.mu not held): its record and its model package go, in one journal
// record, then its files (a crash in between leaves files nothing refers to, never a record without its files).
// Throws api_error 404 when the tenant has no such checkpoint.
void delete_checkpoint(Api::Impl& im, const std::string& tenant, const std::string& path);

}  // namespace rlloop::server::tinker_routes
