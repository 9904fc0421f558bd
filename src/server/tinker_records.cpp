// Tinker's records in the server's journal (tinker.hpp): each session, model, sampler and checkpoint as one
// {"t": "tinker", "kind", "id", "tenant", ...} record, appended whenever it changes; the journal keeps the latest
// of each kind and id (DurableState::tinker) and a restarted server reloads them.
#include <stdexcept>

#include "server/journal.hpp"
#include "server/tinker.hpp"

namespace rlloop::server {

namespace {

json record_of(const TinkerRoutes::Session& s) {
  return {{"tenant", s.tenant}, {"finished", s.finished}, {"models", s.models}};
}
json record_of(const TinkerRoutes::Model& m) {
  return {{"tenant", m.tenant}, {"session", m.session_id},        {"host", m.host},      {"baseModel", m.base_model},
          {"rank", m.rank},     {"targetModules", m.target_modules}, {"created", m.created}};
}
json record_of(const TinkerRoutes::Sampler& s) {
  return {{"tenant", s.tenant},
          {"model", s.model_id},
          {"package", s.model_package},
          {"baseModel", s.base_model},
          {"path", s.model_path}};
}
json record_of(const TinkerRoutes::Checkpoint& c) {
  return {{"tenant", c.tenant},       {"package", c.model_package}, {"model", c.model_id},
          {"type", c.type},           {"baseModel", c.base_model},  {"rank", c.rank},
          {"targetModules", c.target_modules}, {"time", c.time},        {"expires", c.expires}};
}

// The record `id` of `map` as a journal record of `kind`.
template <class Map>
json journal_record(const Map& map, const std::string& kind, const std::string& id) {
  json rec = record_of(map.at(id));
  rec["t"] = "tinker";
  rec["kind"] = kind;
  rec["id"] = id;
  return rec;
}

}  // namespace

void TinkerRoutes::persist_locked(const std::string& kind, const std::string& id) {
  if (!journal) return;
  json rec;
  if (kind == "session") {
    rec = journal_record(sessions, kind, id);
  } else if (kind == "model") {
    rec = journal_record(models, kind, id);
  } else if (kind == "sampler") {
    rec = journal_record(samplers, kind, id);
  } else if (kind == "checkpoint") {
    rec = journal_record(checkpoints, kind, id);
  } else {
    throw std::logic_error("TinkerRoutes::persist_locked: no record kind '" + kind + "'");
  }
  try {
    journal->append(rec);
  } catch (const std::exception& e) {
    if (report) report("the journal did not take Tinker's " + kind + " record '" + id + "': " + e.what());
  }
}

void TinkerRoutes::reload(const std::map<std::pair<std::string, std::string>, json>& records, double now) {
  std::lock_guard lock(mu);
  for (const auto& [key, r] : records) {
    const auto& [kind, id] = key;
    const std::string tenant = r.at("tenant").get<std::string>();
    if (kind == "session") {
      sessions[id] = Session{tenant, now, r.at("finished").get<bool>(), r.at("models").get<std::vector<std::string>>()};
    } else if (kind == "model") {
      models[id] = Model{tenant,
                         r.at("session").get<std::string>(),
                         r.at("host").get<std::string>(),
                         r.at("baseModel").get<std::string>(),
                         r.at("rank").get<int>(),
                         r.at("targetModules").get<std::vector<std::string>>(),
                         {},
                         r.at("created").get<double>()};
    } else if (kind == "sampler") {
      samplers[id] = Sampler{tenant, r.at("model").get<std::string>(), r.at("package").get<std::string>(),
                             r.at("baseModel").get<std::string>(), r.at("path").get<std::string>()};
    } else if (kind == "checkpoint") {
      checkpoints[id] = Checkpoint{tenant,
                                   r.at("package").get<std::string>(),
                                   r.at("model").get<std::string>(),
                                   r.at("type").get<std::string>(),
                                   r.at("baseModel").get<std::string>(),
                                   r.at("rank").get<int>(),
                                   r.at("targetModules").get<std::vector<std::string>>(),
                                   r.at("time").get<double>(),
                                   r.value("expires", 0.0)};  // absent in records written before TTLs
    } else {
      throw std::invalid_argument("journal: a Tinker record of unknown kind '" + kind + "'");
    }
  }
}

}  // namespace rlloop::server
