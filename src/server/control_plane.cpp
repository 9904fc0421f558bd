// SageMaker JSON 1.1 control plane: Create / Describe / List / Stop / Delete TrainingSession (docs/wire.md). The bodies
// are read and written by the wire module (wire/control_plane.hpp); this is what the service does with them.
#include <algorithm>
#include <tuple>

#include <boost/asio/steady_timer.hpp>

#include "server/api_impl.hpp"
#include "wire/control_plane.hpp"
#include "wire/model_registry.hpp"

namespace rlloop::server {

namespace {

[[noreturn]] void validation(const std::string& message) { throw api_error("ValidationException", 400, message); }

wire::TrainingSessionSummary summary(const SessionHost& s) {
  return {s.arn, s.status, s.creation_time, s.last_modified};
}

wire::ModelPackageInfo package_info(const std::string& arn, const ModelPackage& p) {
  const auto group = p.group.substr(p.group.rfind('/') + 1);
  return {arn, p.session, group, p.version, p.creation_time, p.base_model, p.is_checkpoint};
}

// A page of `rows` from `offset`, and where the next one starts.
template <class Row>
std::pair<std::vector<Row>, std::optional<std::int64_t>> page(const std::vector<Row>& rows, std::int64_t offset,
                                                              std::int64_t max_results) {
  std::vector<Row> out;
  const auto count = static_cast<std::int64_t>(rows.size());
  for (std::int64_t i = offset; i < count && i < offset + max_results; ++i) out.push_back(rows[i]);
  std::optional<std::int64_t> next;
  if (offset + max_results < count) next = offset + max_results;
  return {std::move(out), next};
}

}  // namespace

Handled Api::Impl::control_plane_call(const std::string& target, const json& body,
                                      const std::shared_ptr<TenantState>& t, const Reply& reply) {
  auto answer = [this, target, body, t] {
    return Response{200, "application/x-amz-json-1.1", {}, control_plane(target, body, t).dump()};
  };
  if (target != "SageMaker.DescribeTrainingSession" || options.default_result_wait.count() <= 0) return answer();
  std::shared_ptr<SessionHost> s;
  try {
    s = find_session(*t, wire::training_session_name_request_from_json(body));
  } catch (const std::exception&) {
    return answer();  // its error, as without waiting
  }
  {
    std::lock_guard lock(s->mu);
    if (s->status == wire::SessionStatus::created) {
      // As a long-poll on an operation (runtime.cpp): the first of the session's start, the deadline and the
      // server closing answers; no thread waits.
      auto timer = std::make_shared<boost::asio::steady_timer>(reply.executor(), options.default_result_wait);
      auto respond = [answer, weak = std::weak_ptr(timer)] {
        if (auto tm = weak.lock()) tm->cancel();
        return answer();
      };
      auto wake = [reply, respond] { reply.post(respond); };
      timer->async_wait([timer, wake](const boost::system::error_code&) { wake(); });
      s->on_started_locked(wake);
      if (!add_poll(timer, wake)) wake();  // the server is closing: answer now
      return std::nullopt;
    }
  }
  return answer();
}

json Api::Impl::create_training_session(const json& body, const std::shared_ptr<TenantState>& t) {
  const auto req = wire::create_training_session_request_from_json(body);
  if (req.base_model_is_arn) {
    // A Hub ARN names a catalogue model: one this server does not serve is the model's ResourceNotFound, at
    // once, not a session that fails later.
    const auto served = backend.list_base_models();
    if (std::find(served.begin(), served.end(), req.base_model) == served.end())
      throw api_error("ResourceNotFound", 400,
                      "base model " + req.base_model + " (ModelConfig.BaseModelArn) is not served here");
  }
  SessionOptions opts;
  opts.base_model = req.base_model;
  opts.lora = req.lora;
  opts.name = req.name;
  const std::string arn =
      "arn:aws:sagemaker:" + options.region + ":" + t->config.account_id + ":training-session/" + req.name;
  host_session(t, req.name, arn, opts, req.echo);
  return wire::create_training_session_response_to_json(arn);
}

std::shared_ptr<SessionHost> Api::Impl::host_session(const std::shared_ptr<TenantState>& t, const std::string& name,
                                                     const std::string& arn, const SessionOptions& opts,
                                                     const json& echo) {
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
  json record{{"t", "session"},         {"arn", arn},   {"baseModel", opts.base_model},
              {"rank", opts.lora->rank}, {"alpha", opts.lora->alpha}, {"echo", echo},
              {"creationTime", host->creation_time}};
  if (opts.lora->target_modules != std::vector<std::string>{"all-linear"})
    record["targetModules"] = opts.lora->target_modules;
  host->journal(std::move(record));
  sessions[{t->config.id, name}] = host;
  return host;
}

json Api::Impl::list_training_sessions(const json& body, const TenantState& t) {
  const auto req = wire::list_training_sessions_request_from_json(body);
  std::vector<std::shared_ptr<SessionHost>> mine;
  {
    std::lock_guard lock(mu);
    for (const auto& [key, s] : sessions)
      if (key.first == t.config.id) mine.push_back(s);
  }
  std::vector<wire::TrainingSessionSummary> rows;
  for (auto& s : mine) {
    std::lock_guard lock(s->mu);
    if (s->name.find(req.name_contains) == std::string::npos) continue;
    if (req.status_equals && s->status != *req.status_equals) continue;
    if (s->creation_time <= req.creation_time_after || s->creation_time >= req.creation_time_before) continue;
    rows.push_back(summary(*s));
  }
  std::stable_sort(rows.begin(), rows.end(),
                   [](const auto& a, const auto& b) { return a.creation_time > b.creation_time; });
  auto [summaries, next] = page(rows, req.offset, req.max_results);
  return wire::to_json(wire::ListTrainingSessionsResponse{std::move(summaries), next});
}

json Api::Impl::control_plane(const std::string& target, const json& body, const std::shared_ptr<TenantState>& t) {
  const std::string prefix = "SageMaker.";
  const std::string op = target.rfind(prefix, 0) == 0 ? target.substr(prefix.size()) : "";
  try {
    wire::read::object(body, "");
    if (op == "CreateTrainingSession") return create_training_session(body, t);
    if (op == "DescribeTrainingSession") {
      auto s = find_session(*t, wire::training_session_name_request_from_json(body));
      std::lock_guard lock(s->mu);
      return wire::describe_training_session_response_to_json(
          {summary(*s), s->name, s->echo, s->end_time, s->error_details, s->last_sequence_number, s->usage});
    }
    if (op == "ListTrainingSessions") return list_training_sessions(body, *t);
    if (op == "StopTrainingSession") {
      auto s = find_session(*t, wire::training_session_name_request_from_json(body));
      s->stop();
      return json::object();
    }
    if (op == "DeleteTrainingSession") {
      const std::string name = wire::training_session_name_request_from_json(body);
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
    if (op == "DescribeModelPackage" || op == "ListModelPackages" || op == "ListHubContents" ||
        op == "DescribeHubContent")
      return model_registry(op, body, *t);
  } catch (const invalid_argument& e) {
    validation(e.what());
  }
  throw api_error("UnknownOperationException", 400, "unknown operation '" + target + "'");
}

// The model registry and the Hub, as far as the SageMaker SDK uses them: the tenant's checkpoints are its model
// packages (each session's group is the one it was created with), and the Hub lists the base models served.
json Api::Impl::model_registry(const std::string& op, const json& body, TenantState& t) {
  if (op == "DescribeModelPackage") {
    const std::string name = wire::describe_model_package_request_from_json(body);
    std::lock_guard lock(t.mu);
    auto it = t.checkpoints.find(name);
    // AWS answers an unknown package with a ValidationException ("... does not exist"); so do we, for any package
    // of another account too.
    if (it == t.checkpoints.end()) validation("Model package " + name + " does not exist.");
    return wire::describe_model_package_response_to_json(package_info(it->first, it->second));
  }
  if (op == "ListModelPackages") {
    const auto req = wire::list_model_packages_request_from_json(body);
    std::vector<wire::ModelPackageInfo> rows;
    {
      std::lock_guard lock(t.mu);
      for (const auto& [arn, p] : t.checkpoints) {
        auto info = package_info(arn, p);
        if (!req.group.empty() && info.group != req.group) continue;
        if (info.session.find(req.name_contains) == std::string::npos) continue;
        if (info.creation_time <= req.creation_time_after || info.creation_time >= req.creation_time_before) continue;
        rows.push_back(std::move(info));
      }
    }
    // By name or creation time, then version; descending unless asked otherwise.
    auto before = [&](const wire::ModelPackageInfo& a, const wire::ModelPackageInfo& b) {
      return req.sort_by_name ? std::tie(a.session, a.version) < std::tie(b.session, b.version)
                              : std::tie(a.creation_time, a.version) < std::tie(b.creation_time, b.version);
    };
    std::stable_sort(rows.begin(), rows.end(),
                     [&](const auto& a, const auto& b) { return req.ascending ? before(a, b) : before(b, a); });
    const auto [rows_page, next] = page(rows, req.offset, req.max_results);
    return wire::list_model_packages_response_to_json(rows_page, next);
  }
  // The Hub: its listing time is this server's start.
  static const double listed_at = now_seconds();
  const bool list = op == "ListHubContents";
  const auto req =
      list ? wire::list_hub_contents_request_from_json(body) : wire::describe_hub_content_request_from_json(body);
  if (req.hub != wire::public_hub_name)
    throw api_error("ResourceNotFound", 400, "Hub " + req.hub + " does not exist (this service serves " +
                                                 std::string(wire::public_hub_name) + ")");
  std::vector<std::string> models;
  if (req.content_type == "Model")
    for (const auto& m : backend.list_base_models())
      if (wire::is_hub_content_name(m)) models.push_back(m);
  if (list) {
    std::vector<json> rows;
    for (const auto& m : models)
      if (m.find(req.name_contains) != std::string::npos)
        rows.push_back(wire::hub_content_summary_to_json(m, options.region, listed_at));
    const auto [rows_page, next] = page(rows, req.offset, req.max_results);
    return wire::list_hub_contents_response_to_json(rows_page, next);
  }
  if (std::find(models.begin(), models.end(), req.name) == models.end())
    throw api_error("ResourceNotFound", 400,
                    "Hub content " + req.name + " (" + req.content_type + ") does not exist in " + req.hub);
  return wire::describe_hub_content_response_to_json(req.name, options.region, listed_at);
}

std::shared_ptr<SessionHost> Api::Impl::find_session(const TenantState& t, const std::string& name) {
  std::lock_guard lock(mu);
  auto it = sessions.find({t.config.id, name});
  if (it == sessions.end()) throw api_error("ResourceNotFound", 400, "Training session " + name + " does not exist");
  return it->second;
}

}  // namespace rlloop::server
