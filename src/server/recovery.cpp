// Start-up of a durable server: replays the journal into tenants (checkpoint ARNs, billing) and sessions
// (operations, results, client tokens, sequence numbers), then brings the live sessions back and waits until they
// run, so the listener opens on the state the server had when it stopped.
#include <filesystem>

#include "server/api_impl.hpp"
#include "server/journal.hpp"

namespace rlloop::server {

namespace {

struct SessionRecord {
  std::string arn, status = "Running", error;
  SessionOptions options;
  json echo;
  double creation_time = 0, end_time = 0;
  std::vector<std::shared_ptr<OperationRecord>> accepted;  // in acceptance order
  std::map<std::string, std::shared_ptr<OperationRecord>> ops;
  std::map<std::string, std::string> tokens;
  std::int64_t last_sequence = -1;
  TokenUsage usage;
  std::string autosave;
  std::vector<std::shared_ptr<OperationRecord>> replay;  // completed, state-changing, since the autosave
  std::optional<std::string> sampler_path;
};

TokenUsage usage_from(const json& j) {
  return TokenUsage{j.value("prefill", std::int64_t{0}), j.value("sample", std::int64_t{0}),
                    j.value("training", std::int64_t{0})};
}

std::shared_ptr<OperationRecord> operation_from(const json& rec) {
  auto op = std::make_shared<OperationRecord>();
  op->id = rec.at("id").get<std::string>();
  op->sampling = rec.at("sampling").get<bool>();
  op->fingerprint = rec.value("fingerprint", "");
  op->body = rec.at("body");
  if (op->sampling)
    op->op = wire::execute_sampling_request_from_json(op->body);
  else
    op->op = wire::execute_training_request_from_json(op->body).operation;
  return op;
}

bool changes_state(const OperationRecord& op) {
  if (op.sampling) return false;
  const auto& t = std::get<wire::TrainingOperation>(op.op);
  return std::holds_alternative<wire::ForwardBackwardOp>(t) || std::holds_alternative<wire::LoadStateOp>(t);
}

}  // namespace

void Api::Impl::recover() {
  std::map<std::pair<std::string, std::string>, SessionRecord> found;
  for (const json& rec : journal->read_all()) {
    try {
      auto tenant_it = tenants.find(rec.value("tenant", ""));
      if (tenant_it == tenants.end()) continue;  // a tenant no longer in the tenants file
      TenantState& t = *tenant_it->second;
      const std::string type = rec.value("t", "");
      const auto key = std::make_pair(t.config.id, rec.value("session", ""));
      if (type == "checkpoint") {
        t.checkpoints[rec.at("arn").get<std::string>()] = rec.at("path").get<std::string>();
        t.next_checkpoint = std::max(t.next_checkpoint, rec.at("n").get<std::int64_t>() + 1);
        continue;
      }
      if (type == "session") {
        SessionRecord s;
        s.arn = rec.at("arn").get<std::string>();
        s.options.base_model = rec.at("baseModel").get<std::string>();
        s.options.lora = LoraOptions{rec.at("rank").get<int>(), rec.at("alpha").get<int>(), {"all-linear"}};
        s.options.name = key.second;
        s.echo = rec.at("echo");
        s.creation_time = rec.at("creationTime").get<double>();
        found[key] = std::move(s);
        continue;
      }
      auto it = found.find(key);
      if (it == found.end()) continue;
      SessionRecord& s = it->second;
      if (type == "status") {
        s.status = rec.at("status").get<std::string>();
        s.error = rec.value("error", "");
        s.end_time = rec.value("time", 0.0);
      } else if (type == "delete") {
        found.erase(it);
      } else if (type == "accept") {
        auto op = operation_from(rec);
        if (rec.contains("token")) s.tokens[rec["token"].get<std::string>()] = op->id;
        if (rec.contains("seq")) s.last_sequence = std::max(s.last_sequence, rec["seq"].get<std::int64_t>());
        s.ops[op->id] = op;
        s.accepted.push_back(op);
      } else if (type == "done") {
        const TokenUsage u = usage_from(rec.at("usage"));
        s.usage += u;
        t.usage += u;
        auto op_it = s.ops.find(rec.at("id").get<std::string>());
        if (op_it == s.ops.end()) continue;  // an OpenAI request: billed, never listed
        auto& op = op_it->second;
        op->state = rec.at("state");
        op->billed = u;
        if (op->state.value("status", "") != "Completed") continue;
        if (rec.contains("autosave")) {
          s.autosave = rec["autosave"].get<std::string>();
          s.replay.clear();
        } else if (changes_state(*op)) {
          s.replay.push_back(op);
        } else if (op->sampling &&
                   std::holds_alternative<wire::LoadWeightsForSamplingOp>(std::get<wire::SamplingOperation>(op->op))) {
          s.sampler_path =
              std::get<wire::LoadWeightsForSamplingOp>(std::get<wire::SamplingOperation>(op->op)).model_package_arn;
        }
      }
    } catch (const std::exception& e) {
      options.log(json{{"ts", now_seconds()}, {"level", "error"}, {"event", "journal"}, {"message", e.what()}}.dump());
    }
  }

  std::vector<std::shared_ptr<SessionHost>> starting;
  for (auto& [key, s] : found) {
    auto tenant = tenants.at(key.first);
    const bool live = s.status != "Stopped" && s.status != "Failed" && s.status != "Expired";
    std::optional<Recovery> recovery;
    if (live) {
      Recovery r;
      r.autosave = s.autosave;
      r.replay = s.replay;
      for (const auto& op : s.accepted)
        if (!terminal_state(op->state)) r.pending.push_back(op);
      if (s.sampler_path) {
        std::lock_guard lock(tenant->mu);
        auto c = tenant->checkpoints.find(*s.sampler_path);
        if (c != tenant->checkpoints.end()) r.sampler_path = c->second;
      }
      recovery = std::move(r);
    }
    auto host = std::make_shared<SessionHost>(tenant, key.second, s.arn, s.options, s.echo, backend, host_config(),
                                              s.creation_time, std::move(recovery), live ? "Created" : s.status);
    {
      std::lock_guard lock(host->mu);
      host->ops = std::move(s.ops);
      host->client_tokens = std::move(s.tokens);
      host->last_sequence_number = s.last_sequence;
      host->usage = s.usage;
      host->error_details = s.error;
      if (!live) host->end_time = s.end_time;
    }
    sessions[key] = host;
    if (live) starting.push_back(host);
  }
  for (auto& h : starting) h->wait_started();
  options.log(
      json{{"ts", now_seconds()}, {"level", "info"}, {"event", "recovered"}, {"sessions", found.size()}}.dump());
}

}  // namespace rlloop::server
