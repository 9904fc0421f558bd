// Tinker's tinker:// checkpoints (docs/tinker_protocol.md): registered as save futures finish, listed with the
// training runs they belong to, given a time to live (save requests' ttl_seconds, PUT .../ttl) after which the
// reaper deletes them, deleted on request, and for external weights their files signed for download.
#include <algorithm>
#include <ctime>
#include <filesystem>

#include "server/journal.hpp"
#include "server/tinker_internal.hpp"

namespace rlloop::server::tinker_routes {

namespace {

namespace rd = wire::read;

// Tinker's bounds on a checkpoint's time to live: an hour to ten years.
constexpr std::int64_t kMinTtl = 3600;
constexpr std::int64_t kMaxTtl = std::int64_t{10} * 36525 * 864;

// A checkpoint as the SDK's Checkpoint reads it.
json checkpoint_json(const std::string& path, const TinkerRoutes::Checkpoint& c) {
  const auto slash = path.find('/', std::string("tinker://").size());
  return {{"checkpoint_id", path.substr(slash + 1)},
          {"checkpoint_type", c.type},
          {"time", iso_time(c.time)},
          {"tinker_path", path},
          {"expires_at", c.expires > 0 ? json(iso_time(c.expires)) : json(nullptr)}};
}

json list_checkpoints(TinkerRoutes& r, const std::string& model_id, const std::shared_ptr<TenantState>& t) {
  json rows = json::array();
  std::lock_guard lock(r.mu);
  for (const auto& [path, c] : r.checkpoints)
    if (c.tenant == t->config.id && (model_id.empty() || c.model_id == model_id))
      rows.push_back(checkpoint_json(path, c));
  return {{"checkpoints", rows}};
}

// The LoRA settings of a model or checkpoint under Tinker's names (lora_config's flags).
json lora_settings(int rank, const std::vector<std::string>& targets) {
  auto has = [&](const char* module) { return std::find(targets.begin(), targets.end(), module) != targets.end(); };
  return {{"is_lora", true},
          {"lora_rank", rank},
          {"train_attn", has("q_proj")},
          {"train_mlp", has("gate_proj")},
          {"train_unembed", has("lm_head")}};
}

// A training model as the SDK's TrainingRun reads it (r.mu held): its last request is its latest checkpoint, or its
// creation.
json training_run_locked(const TinkerRoutes& r, const std::string& model_id, const TinkerRoutes::Model& m) {
  json run = lora_settings(m.rank, m.target_modules);
  run.update({{"training_run_id", model_id}, {"base_model", m.base_model}, {"model_owner", m.tenant},
              {"corrupted", false}, {"last_checkpoint", nullptr}, {"last_sampler_checkpoint", nullptr}});
  double last = m.created, training = -1, sampler = -1;
  for (const auto& [path, c] : r.checkpoints) {
    if (c.model_id != model_id) continue;
    last = std::max(last, c.time);
    if (c.type != "training" && c.type != "sampler") continue;  // external weights are neither
    double& latest = c.type == "training" ? training : sampler;
    if (c.time < latest) continue;
    latest = c.time;
    run[c.type == "training" ? "last_checkpoint" : "last_sampler_checkpoint"] = checkpoint_json(path, c);
  }
  run["last_request_time"] = iso_time(last);
  return run;
}

// A query parameter of a request target ("/api/v1/training_runs?limit=20&offset=0"), when it is a whole number.
std::optional<std::int64_t> query_number(const std::string& target, const std::string& key) {
  const auto v = query_value(target, key);
  if (!v) return std::nullopt;
  if (v->empty() || v->size() > 9 || !std::all_of(v->begin(), v->end(), [](char c) { return c >= '0' && c <= '9'; }))
    user_error(key + " must be a whole number, got '" + *v + "'");
  return std::stoll(*v);
}

// training_runs?limit=&offset=: the tenant's training models, oldest first.
json list_training_runs(TinkerRoutes& r, const std::string& target, const std::shared_ptr<TenantState>& t) {
  const std::int64_t limit = query_number(target, "limit").value_or(20);
  const std::int64_t offset = query_number(target, "offset").value_or(0);
  std::lock_guard lock(r.mu);
  std::vector<std::pair<double, std::string>> owned;
  for (const auto& [id, m] : r.models)
    if (m.tenant == t->config.id) owned.emplace_back(m.created, id);
  std::sort(owned.begin(), owned.end());
  json runs = json::array();
  const auto last = std::min(owned.size(), static_cast<std::size_t>(offset + limit));
  for (std::size_t i = static_cast<std::size_t>(offset); i < last; ++i)
    runs.push_back(training_run_locked(r, owned[i].second, r.models.at(owned[i].second)));
  return {{"training_runs", runs},
          {"cursor", {{"offset", offset}, {"limit", limit}, {"total_count", owned.size()}}}};
}

// training_runs/{model_id}/checkpoints/external_weights/{name}/external_weights_urls: signed URLs of the
// checkpoint's files, on the host and port the client reached this server by.
json external_weights_urls(Api::Impl& im, const sigv4::HttpRequest& req, const std::vector<std::string>& seg,
                           const std::shared_ptr<TenantState>& t) {
  const std::string path = tinker_path(seg[1], "external_weights", seg[4]);
  const auto checkpoint = find_owned(*im.tinker, im.tinker->checkpoints, path, t->config.id, "checkpoint");
  std::string directory;
  {
    std::lock_guard lock(t->mu);
    const auto it = t->checkpoints.find(checkpoint.model_package);
    if (it == t->checkpoints.end()) not_found("the files of " + path + " are gone");
    directory = it->second.path;
  }
  const double now = now_seconds();
  const json urls = im.tinker->downloads.sign(directory, "http://" + req.header("Host").value_or("127.0.0.1"), now);
  return {{"urls", urls}, {"expires", iso_time(now + ExternalDownloads::kValidSeconds)}};
}

// PUT .../ttl {"ttl_seconds": n | null}: the checkpoint expires n seconds from now, or never.
json set_ttl(TinkerRoutes& r, const std::string& path, const json& body, const std::shared_ptr<TenantState>& t) {
  const std::int64_t ttl = ttl_of(body);
  std::lock_guard lock(r.mu);
  const auto it = r.checkpoints.find(path);
  if (it == r.checkpoints.end() || it->second.tenant != t->config.id)
    not_found("checkpoint '" + path + "' does not exist");
  it->second.expires = ttl > 0 ? now_seconds() + static_cast<double>(ttl) : 0.0;
  r.persist_locked("checkpoint", path);
  return json::object();
}

}  // namespace

// "2026-12-06T15:25:00Z"
std::string iso_time(double seconds) {
  const std::time_t whole = static_cast<std::time_t>(seconds);
  std::tm utc{};
  gmtime_r(&whole, &utc);
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%dT%H:%M:%SZ", &utc);
  return text;
}

std::int64_t ttl_of(const json& body) {
  const json* v = rd::find(body, "ttl_seconds");
  if (!v || v->is_null()) return 0;
  return rd::integer(*v, "ttl_seconds", kMinTtl, kMaxTtl);
}

std::string register_checkpoint(TinkerRoutes& r, const TinkerRoutes::Future& f, const std::string& package,
                                const std::string& type) {
  std::lock_guard lock(r.mu);
  const auto& model = r.models.at(f.model_id);
  const char* segment = type == "training" ? "weights" : type == "sampler" ? "sampler_weights" : "external_weights";
  const std::string path = tinker_path(f.model_id, segment, f.name);
  // A future retrieved again answers the same path without registering it again: its time to live keeps running,
  // and a checkpoint deleted since stays deleted.
  const auto it = r.checkpoints.find(path);
  if ((it != r.checkpoints.end() && it->second.model_package == package) || r.deleted_packages.count(package))
    return path;
  const double now = now_seconds();
  r.checkpoints[path] = {f.tenant,         package,    f.model_id,           type,
                         model.base_model, model.rank, model.target_modules, now,
                         f.ttl_seconds > 0 ? now + static_cast<double>(f.ttl_seconds) : 0.0};
  r.persist_locked("checkpoint", path);
  return path;
}

// weights_info: what loading a checkpoint needs to know (the RestClient's get_weights_info_by_tinker_path).
json weights_info(TinkerRoutes& r, const json& body, const std::shared_ptr<TenantState>& t) {
  const auto c = find_owned(r, r.checkpoints, need_string(body, "tinker_path"), t->config.id, "checkpoint");
  json info = lora_settings(c.rank, c.target_modules);
  info["base_model"] = c.base_model;
  return info;
}

std::optional<json> checkpoint_get_route(Api::Impl& im, const sigv4::HttpRequest& req,
                                         const std::vector<std::string>& seg, const std::shared_ptr<TenantState>& t) {
  TinkerRoutes& r = *im.tinker;
  if (seg.size() == 3 && seg[0] == "training_runs" && seg[2] == "checkpoints") return list_checkpoints(r, seg[1], t);
  if (seg.size() == 6 && seg[0] == "training_runs" && seg[2] == "checkpoints" && seg[3] == "external_weights" &&
      seg[5] == "external_weights_urls")
    return external_weights_urls(im, req, seg, t);
  if (seg.size() == 1 && seg[0] == "checkpoints") return list_checkpoints(r, "", t);
  if (seg.size() == 1 && seg[0] == "training_runs") return list_training_runs(r, req.target, t);
  if (seg.size() == 2 && seg[0] == "training_runs") {
    const auto model = find_owned(r, r.models, seg[1], t->config.id, "training run");
    std::lock_guard lock(r.mu);
    return training_run_locked(r, seg[1], model);
  }
  return std::nullopt;
}

std::optional<json> checkpoint_change(Api::Impl& im, const sigv4::HttpRequest& req,
                                      const std::vector<std::string>& seg, const std::shared_ptr<TenantState>& t) {
  if (seg.size() < 5 || seg[0] != "training_runs" || seg[2] != "checkpoints") return std::nullopt;
  const std::string path = "tinker://" + seg[1] + "/" + seg[3] + "/" + seg[4];
  if (seg.size() == 5 && req.method == "DELETE") {
    delete_checkpoint(im, t->config.id, path);
    return json::object();
  }
  if (seg.size() == 6 && seg[5] == "ttl" && req.method == "PUT") {
    const json body = parse_body(req);
    rd::only_keys(rd::object(body, ""), "", {"ttl_seconds"});
    return set_ttl(*im.tinker, path, body, t);
  }
  if (seg.size() == 6 && seg[5] == "publish")
    user_error("publishing checkpoints is not supported by this server: a checkpoint is its tenant's only");
  return std::nullopt;
}

std::vector<std::pair<std::string, std::string>> expired_checkpoints_locked(const TinkerRoutes& r, double now) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& [path, c] : r.checkpoints)
    if (c.expires > 0 && c.expires <= now) out.emplace_back(c.tenant, path);
  return out;
}

void delete_checkpoint(Api::Impl& im, const std::string& tenant, const std::string& path) {
  TinkerRoutes& r = *im.tinker;
  const auto checkpoint = find_owned(r, r.checkpoints, path, tenant, "checkpoint");
  const auto owner = im.tenants.find(tenant);
  std::string directory;
  if (owner != im.tenants.end()) {
    std::lock_guard lock(owner->second->mu);
    if (const auto it = owner->second->checkpoints.find(checkpoint.model_package);
        it != owner->second->checkpoints.end())
      directory = it->second.path;
  }
  // One record drops both (DurableState::apply): a restart finds neither.
  if (im.journal)
    im.journal->append({{"t", "checkpoint_deleted"}, {"tenant", tenant}, {"arn", checkpoint.model_package},
                        {"tinkerPath", path}});
  {
    std::lock_guard lock(r.mu);
    r.checkpoints.erase(path);
    r.deleted_packages.insert(checkpoint.model_package);
  }
  if (owner != im.tenants.end()) {
    std::lock_guard lock(owner->second->mu);
    owner->second->checkpoints.erase(checkpoint.model_package);
  }
  std::error_code ec;
  if (!directory.empty()) std::filesystem::remove_all(directory, ec);
}

}  // namespace rlloop::server::tinker_routes
