// Tinker's protocol (docs/tinker_protocol.md) over the server's sessions: what it keeps beside them. A Tinker
// session groups training models and samplers under one heartbeat; each training model is one hosted session
// (SessionHost, named after the model id), each future one of its operations (or its creation). Everything is
// per tenant: a lookup by another tenant's key finds nothing (404). With a data directory the sessions, models,
// samplers and checkpoints are journaled as they change ({"t": "tinker"} records, tinker_records.cpp) and a restarted
// server reloads them beside its hosted sessions; futures are not kept (a request in flight then is sent again).
#pragma once
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "server/tinker_downloads.hpp"
#include "server/tinker_stability.hpp"

namespace rlloop::server {

class Journal;

struct TinkerRoutes {
  struct Session {
    std::string tenant;
    double last_heartbeat = 0;
    bool finished = false;
    std::vector<std::string> models;  // model ids
  };
  struct Model {
    std::string tenant;
    std::string session_id;
    std::string host;  // the hosted session's name
    std::string base_model;
    int rank = 0;
    std::vector<std::string> target_modules;
    std::map<std::int64_t, std::string> requests;  // seq_id -> request id: a retried submission is not run twice
    double created = 0;  // seconds since the epoch
  };
  // A sampler: the training model whose session decodes for it, and the saved weights it samples.
  struct Sampler {
    std::string tenant;
    std::string model_id;
    std::string model_package;  // the checkpoint's ARN
    std::string base_model;
    std::string model_path;  // tinker:// path, when it was created from one
  };
  enum class Kind {
    created,
    forward,
    optim_step,
    save_state,
    save_sampler,
    save_external,
    sampler_session,
    load_weights,
    sample
  };
  struct Future {
    std::string tenant;
    Kind kind = Kind::created;
    std::string host;
    std::string operation;  // the operation's id (not for `created`)
    std::string model_id;
    std::string name;        // save_*: the checkpoint's name; sampler_session: the sampler id
    std::string error;       // create-by-load: why its load could not be queued
    std::int64_t ttl_seconds = 0;  // save_*: the checkpoint's time to live (0: none)
  };
  struct Checkpoint {
    std::string tenant;
    std::string model_package;  // ARN
    std::string model_id;
    std::string type;  // "training", "sampler" or "external" (a PEFT adapter directory)
    std::string base_model;
    int rank = 0;
    std::vector<std::string> target_modules;
    double time = 0;
    double expires = 0;  // seconds since the epoch when the reaper deletes it; 0: never
  };

  std::mutex mu;  // guards everything below; may be taken with a SessionHost's mu held, never the other way
  std::map<std::string, Session> sessions;
  std::map<std::string, Model> models;
  std::map<std::string, Sampler> samplers;
  std::map<std::string, Future> futures;          // by request id
  std::map<std::string, Checkpoint> checkpoints;  // by tinker:// path
  std::set<std::string> deleted_packages;         // of checkpoints deleted since the start (register_checkpoint)
  std::uint64_t next_id = 1;
  StabilityRecords stability;  // stable_reinforce's records of sampled sequences (locked on its own)
  ExternalDownloads downloads;  // signed URLs of external weights' files (locked on its own)
  Journal* journal = nullptr;  // the server's, when it has a data directory
  std::function<void(const std::string&)> report;  // where a record the journal could not take is reported

  // Journals record `id` of `kind` ("session", "model", "sampler" or "checkpoint") as it is now (mu held): the
  // latest record of a kind and id is what a restart reloads. Nothing without a journal. Never throws (the reaper
  // thread calls it): a journal that fails is reported, and the record lives on in memory only.
  void persist_locked(const std::string& kind, const std::string& id);
  // The records the journal kept (DurableState::tinker, by kind and id), at start-up: each session's heartbeat
  // counted from `now`, so that its client has a whole timeout to come back.
  void reload(const std::map<std::pair<std::string, std::string>, nlohmann::json>& records, double now);

  // The reaper: a thread that finishes the sessions whose heartbeats stopped (Options::tinker_session_timeout) and
  // deletes the checkpoints whose time to live ran out.
  std::condition_variable wake;  // with mu: stop_tinker_reaper
  bool stopping = false;
  std::thread reaper;

  // Stops and joins the reaper; again is a no-op. Api::shutdown calls it; so does the destructor, for an Api torn
  // down another way.
  void stop_reaper();
  ~TinkerRoutes() { stop_reaper(); }
};

}  // namespace rlloop::server
