// Start-up of a durable server: the journal's state (its snapshot and log, folded) goes into tenants (checkpoint
// ARNs, billing) and sessions (unfinished operations, retained results and client tokens, sequence numbers), then
// the live sessions come back and are waited for, so the listener opens on the state the server had when it stopped.
#include "server/api_impl.hpp"
#include "server/journal.hpp"
#include "server/tinker.hpp"

namespace rlloop::server {

namespace {

std::shared_ptr<OperationRecord> operation_from(const json& accept) {
  auto op = std::make_shared<OperationRecord>();
  op->id = accept.at("id").get<std::string>();
  op->sampling = accept.at("sampling").get<bool>();
  op->retrievable = true;
  op->body = accept.at("body");
  if (op->sampling)
    op->op = wire::execute_sampling_request_from_json(op->body);
  else
    op->op = wire::execute_training_request_from_json(op->body).operation;
  return op;
}

// Whether a session the journal holds was live when the server stopped (so it comes back up).
bool live_status(wire::SessionStatus status) {
  using enum wire::SessionStatus;
  return status != stopped && status != failed && status != expired;
}

// Each tenant's billing and checkpoints as the journal holds them; a tenant no longer in the tenants file is left.
void restore_tenants(const DurableState& state, const std::map<std::string, std::shared_ptr<TenantState>>& tenants) {
  for (const auto& [id, durable] : state.tenants) {
    auto it = tenants.find(id);
    if (it == tenants.end()) continue;
    TenantState& t = *it->second;
    t.usage = durable.usage;
    t.next_checkpoint = durable.next_checkpoint;
    t.checkpoints = durable.checkpoints;
  }
}

}  // namespace

void Api::Impl::recover() {
  const DurableState& state = journal->state();
  auto report = [&](const std::exception& e) {
    options.log(json{{"ts", now_seconds()}, {"level", "error"}, {"event", "journal"}, {"message", e.what()}}.dump());
  };
  restore_tenants(state, tenants);

  std::vector<std::shared_ptr<SessionHost>> starting;
  std::size_t replayed = 0;  // operations the live sessions run again on top of their autosaves
  for (const auto& [key, s] : state.sessions) {
    auto tenant_it = tenants.find(key.first);
    if (tenant_it == tenants.end()) continue;
    const auto& tenant = tenant_it->second;
    try {
      SessionOptions opts;
      opts.base_model = s.created.at("baseModel").get<std::string>();
      opts.lora = LoraOptions{s.created.at("rank").get<int>(), s.created.at("alpha").get<int>(),
                              s.created.value("targetModules", std::vector<std::string>{"all-linear"})};
      opts.name = key.second;
      Recovery r;
      r.autosave = s.autosave;
      r.last_sequence_number = s.last_sequence;
      r.next_operation = s.next_operation;
      r.usage = s.usage;
      r.error_details = s.error;
      r.end_time = s.end_time;
      // A request that no longer parses is reported and left out, not the whole session.
      auto parse_into = [&](const std::vector<json>& accepts, std::vector<std::shared_ptr<OperationRecord>>& out) {
        for (const json& accept : accepts) try {
            out.push_back(operation_from(accept));
          } catch (const std::exception& e) {
            report(e);
          }
      };
      parse_into(s.replay, r.replay);
      parse_into(s.pending, r.pending);
      s.results.for_each([&](const std::string& id, const DurableState::Result& result, double time) {
        auto op = std::make_shared<OperationRecord>();
        op->id = id;
        op->sampling = result.sampling;
        op->retrievable = true;
        op->state = result.state;
        r.finished.emplace_back(std::move(op), time);
      });
      s.tokens.for_each([&](const std::string& token, const ClientTokenRecord& record, double time) {
        r.client_tokens.emplace_back(token, record, time);
      });
      if (s.sampler_arn) {
        std::lock_guard lock(tenant->mu);
        auto c = tenant->checkpoints.find(*s.sampler_arn);
        if (c != tenant->checkpoints.end()) r.sampler_path = c->second.path;
      }
      const bool live = live_status(s.status);
      if (live) replayed += r.replay.size();
      auto host = std::make_shared<SessionHost>(tenant, key.second, s.created.at("arn").get<std::string>(), opts,
                                                s.created.at("echo"), backend, host_config(),
                                                s.created.at("creationTime").get<double>(), std::move(r),
                                                live ? wire::SessionStatus::created : s.status);
      sessions[key] = host;
      if (live) starting.push_back(host);
    } catch (const std::exception& e) {
      report(e);
    }
  }
  for (auto& h : starting) h->wait_started();
  // Tinker's sessions, models, samplers and checkpoints over the hosted sessions just recovered.
  try {
    tinker->reload(state.tinker, now_seconds());
  } catch (const std::exception& e) {
    report(e);
  }
  options.log(json{{"ts", now_seconds()},
                   {"level", "info"},
                   {"event", "recovered"},
                   {"sessions", sessions.size()},
                   {"tinkerRecords", state.tinker.size()},
                   {"replayed", replayed},
                   {"generation", journal->generation()}}
                  .dump());
}

}  // namespace rlloop::server
