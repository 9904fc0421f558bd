// A data-parallel worker: the replicas of rank 0's sessions, and the loop that runs rank 0's commands on them.
// Training commands run here, in order, in step with the other ranks; sampling and logprobs shares run on the
// replica's lane of the worker's own engine loop (batched with the other sessions' shares, as on rank 0) and
// answer through replies, so later commands for other sessions go on meanwhile. Rank 0 sends a session's next
// command only once its shares have replied, so a replica is never trained while it decodes.
#include <map>

#include <rlloop/error.hpp>
#include <rlloop/local.hpp>
#include <rlloop/tokenizer.hpp>

#include "runtime/base_models.hpp"
#include "runtime/batch.hpp"
#include "comm/codec.hpp"
#include "dist/coordinator.hpp"
#include "dist/replica_ops.hpp"
#include "runtime/sample_stream.hpp"
#include "runtime/sampler.hpp"
#include "runtime/session_model.hpp"

namespace rlloop {

namespace {

// A model to sample from: the session's, or sampler weights rank 0 loaded from a checkpoint.
struct SamplingModel {
  std::shared_ptr<engine::Transformer> model;
  std::shared_ptr<const engine::RoundedWeights> rounded;  // bf16 snapshot of a private model (as LocalSession's)
  engine::dist::TensorParallelSlice slice;                // the live model's tensor-parallel slice, as rank 0's
};

struct Replica {
  engine::SessionModel model;
  std::unique_ptr<engine::AdamW> optimizer;
  SessionOptions options;
  std::string resolved_base;
  std::map<std::string, SamplingModel> samplers;   // what rank 0's sampler cache holds, by its key
  std::shared_ptr<const Tokenizer> tokenizer;      // for stop strings, loaded at the first that needs it
  SamplingModel live;                              // the session's model, for sampling
  std::unique_ptr<engine::EngineLoop::Lane> lane;  // last: destroying it waits for the replica's shares
};

// The reply of a share that failed, whatever it threw.
std::string failed_reply(std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& ex) {
    return engine::dist::failure_reply(ex);
  } catch (...) {
    return engine::dist::failure_reply(std::runtime_error("unknown error"));
  }
}

class Worker {
 public:
  Worker(const DataParallelWorkerOptions& options, engine::DeviceChoice dev, std::unique_ptr<engine::dist::Group> group)
      : options_(options),
        dev_(dev),
        group_(std::move(group)),
        bases_(engine::EngineLoopOptions{options.service.max_batch_rows, options.service.kv_cache_mb << 20,
                                         options.service.prefill_chunk_tokens}) {}

  // Runs commands until the shutdown command.
  void run() {
    using engine::dist::Command;
    for (;;) {
      const std::string bytes = group_->next_command();
      engine::dist::ByteReader r(bytes);
      const auto command = r.get<Command>();
      const auto id = r.get<std::uint64_t>();
      switch (command) {
        case Command::open:
          open(id, r.get_session_options());
          break;
        case Command::close:
          replicas_.erase(id);
          engine::dist::acknowledge(*group_);
          break;
        case Command::forward: {
          const bool backward = r.get<bool>();
          const LossSpec loss = r.get_loss_spec();
          const auto share = engine::dist::decode_share(group_->take_share());
          engine::dist::forward_share(*group_, *replica(id).model.model, share.data, loss, backward);
          if (backward) replica(id).optimizer->absorb_gradients();  // as rank 0 does after its share
          break;
        }
        case Command::forward_custom:
          engine::dist::custom_share(*group_, *replica(id).model.model,
                                     engine::dist::decode_share(group_->take_share()), nullptr, nullptr);
          replica(id).optimizer->absorb_gradients();
          break;
        case Command::optim_step: {
          Replica& rep = replica(id);
          engine::dist::optim_step_share(*group_, *rep.model.model, *rep.optimizer, r.get_adam_params());
          break;
        }
        case Command::sync_state:
        case Command::fold_gradients:
        case Command::gather_experts:
        case Command::gather_shards:
        case Command::load_shards:
        case Command::load_state:
          state_command(command, replica(id), r);
          break;
        case Command::sample:
          sample(id, r);
          break;
        case Command::logprobs:
          logprobs(id, r);
          break;
        case Command::sample_lockstep:
          sample_in_lockstep(id, r);
          break;
        case Command::logprobs_lockstep:
          engine::dist::logprobs_lockstep_share(*group_, *sampling_model(replica(id), r.get_string()).model, {});
          break;
        case Command::load_sampler:
          load_sampler(id, r.get_string());
          break;
        case Command::drop_sampler:
          replica(id).samplers.erase(r.get_string());
          break;
        case Command::shutdown:
          engine::dist::acknowledge(*group_);
          return;
      }
    }
  }

 private:
  // The commands of save_state and load_state: rank 0's checkpoint to this replica, or this replica's part to rank 0.
  void state_command(engine::dist::Command command, Replica& rep, engine::dist::ByteReader& r) {
    using engine::dist::Command;
    engine::Transformer& model = *rep.model.model;
    if (command == Command::fold_gradients) return engine::dist::fold_gradients_share(*group_, model, *rep.optimizer);
    if (command == Command::gather_experts || command == Command::gather_shards) {
      const bool with_optimizer = r.get<bool>(), with_gradients = r.get<bool>();
      if (command == Command::gather_experts)
        engine::dist::gather_experts_share(*group_, model, *rep.optimizer, with_optimizer, with_gradients);
      else
        engine::dist::gather_shards_share(*group_, model, *rep.optimizer, with_optimizer, with_gradients);
      return;
    }
    const bool with_optimizer = r.get<bool>();
    if (command == Command::sync_state)
      engine::dist::sync_state_share(*group_, model, rep.optimizer, with_optimizer);
    else if (command == Command::load_shards)
      engine::dist::load_shards_share(*group_, model, rep.optimizer, with_optimizer, nullptr, 0);
    else
      engine::dist::load_state_share(*group_, model, rep.optimizer, with_optimizer, nullptr, 0);
  }

  void open(std::uint64_t id, const SessionOptions& options) {
    Replica rep;
    std::string error;
    try {
      rep.resolved_base = resolve_base_model(options_.service, options.base_model);
      rep.model = engine::make_session_model(bases_, rep.resolved_base, dev_, options, expert_group(), shard_group());
      rep.model.model->kv_pools()->set_capacity_bytes(options_.service.kv_cache_mb << 20);  // as rank 0's sessions
      rep.optimizer = engine::make_optimizer(*rep.model.model);
    } catch (const std::exception& e) {
      error = e.what();
    }
    const bool shard = engine::dist::shards_sessions(options_.service.data_parallel.shard);
    try {
      engine::dist::open_replica(*group_, rep.model.model ? &rep.model : nullptr, error, options.base_model, shard);
    } catch (const invalid_argument&) {
      return;  // some rank could not hold it: rank 0 reports why, and no rank keeps it
    }
    if (shard) rep.optimizer = engine::make_optimizer(*rep.model.model);  // over the shards
    rep.options = options;
    rep.live.model = rep.model.model;
    rep.lane = engine::EngineLoop::open_lane(bases_.loop(engine::base_key(rep.resolved_base, dev_)));
    replicas_.emplace(id, std::move(rep));
  }

  // This rank's samples of a request, decoded on the replica's lane; the reply carries their sequences.
  void sample(std::uint64_t id, engine::dist::ByteReader& r) {
    const std::uint64_t tag = group_->command_number();
    const std::string sampler = r.get_string();
    const auto seed = r.get<std::uint64_t>();
    const auto precision = r.get<engine::DecodePrecision>();
    const auto firsts = r.get_vector<int>();
    const auto counts = r.get_vector<int>();
    SampleRequest share = r.get_sample_request();
    const auto rank = static_cast<std::size_t>(group_->rank());
    if (rank >= counts.size() || rank >= firsts.size() || counts[rank] <= 0) return;  // none of its samples
    share.num_samples = counts[rank];
    Replica& rep = replica(id);
    SamplingModel& target = sampling_model(rep, sampler);
    auto reply_failure = [this, tag](std::exception_ptr e) { group_->post_reply(tag, failed_reply(e)); };
    auto start = [this, &rep, &target, share, seed, precision, first = firsts[rank]]() {
      engine::StopStringCheck stop_check;
      if (!share.params.stop.empty()) stop_check = engine::make_stop_string_check(tokenizer(rep), share.params.stop);
      auto* rounded = rep.model.shared_base ? &rep.model.shared_base->rounded : &target.rounded;
      return std::make_unique<engine::DecodeRun>(*target.model, share, stop_check, engine::SampleStream(seed, first),
                                                 precision, rounded, engine::Prefill::in_steps);
    };
    auto finish = [this, tag](engine::DecodeRun& run) {
      SampleResponse out = run.take();
      engine::dist::ByteWriter w;
      w.put(out.sequences);
      group_->post_reply(tag, engine::dist::ok_reply(w.take()));
      return SampleResponse{};
    };
    rep.lane->submit_sample(share.num_samples, engine::kv_bytes_needed(*target.model, share, precision), start, finish,
                            nullptr, reply_failure);
  }

  // This rank's samples of a batch of an expert-parallel session's requests, decoded in step with every other
  // rank's (in this command, not on the lane: the sparse layers exchange rows at every step); they go to rank 0 in
  // the command's gather.
  void sample_in_lockstep(std::uint64_t id, engine::dist::ByteReader& r) {
    Replica& rep = replica(id);
    const std::string sampler = r.get_string();
    SamplingModel& target = sampling_model(rep, sampler);
    engine::dist::LockstepBatch mine;
    mine.model = target.model.get();
    mine.precision = r.get<engine::DecodePrecision>();
    mine.prefill_tokens = r.get<std::int64_t>();
    mine.tensor_parallel = r.get<bool>();
    mine.kv_capacity_bytes = options_.service.kv_cache_mb << 20;
    if (sampler.empty()) mine.slice = &target.slice;  // the live model's, as rank 0 keeps its own
    mine.rounded = rep.model.shared_base ? &rep.model.shared_base->rounded : &target.rounded;
    const auto rank = static_cast<std::size_t>(group_->rank());
    for (std::size_t n = r.get<std::uint64_t>(), i = 0; i < n; ++i) {
      engine::dist::LockstepShare& share = mine.shares.emplace_back();
      share.seed = r.get<std::uint64_t>();
      share.at_once = r.get<bool>();
      const engine::dist::SamplePlacement& placement =
          mine.placements.emplace_back(engine::dist::SamplePlacement{r.get_vector<int>(), r.get_vector<int>()});
      share.req = r.get_sample_request();
      const bool has_share = rank < placement.count.size() && rank < placement.first.size();
      share.req.num_samples = has_share ? placement.count[rank] : 0;
      share.stream = engine::SampleStream(share.seed, has_share ? placement.first[rank] : 0);
      try {
        if (share.req.num_samples > 0 && !share.req.params.stop.empty())
          share.stop_check = engine::make_stop_string_check(tokenizer(rep), share.req.params.stop);
      } catch (const std::exception& e) {
        share.error = e.what();  // this rank still takes part in every step
      }
    }
    engine::dist::sample_lockstep_share(*group_, mine);
  }

  void logprobs(std::uint64_t id, engine::dist::ByteReader& r) {
    const std::uint64_t tag = group_->command_number();
    const std::string sampler = r.get_string();
    const int rank = r.get<int>();
    auto tokens = r.get_vector<token_id>();
    if (rank != group_->rank()) return;
    Replica& rep = replica(id);
    auto model = sampling_model(rep, sampler).model;
    rep.lane->submit<bool>([this, model, tag, tokens = std::move(tokens)] {
      std::string reply;
      try {
        engine::dist::ByteWriter w;
        w.put(engine::compute_logprobs(*model, tokens));
        reply = engine::dist::ok_reply(w.take());
      } catch (...) {
        reply = failed_reply(std::current_exception());
      }
      group_->post_reply(tag, reply);
      return true;
    });
  }

  // A sampler model as rank 0 loaded it: made as the session's model is, with rank 0's trainable weights.
  void load_sampler(std::uint64_t id, const std::string& key) {
    Replica& rep = replica(id);
    SamplingModel loaded{
        engine::make_session_model(bases_, rep.resolved_base, dev_, rep.options, expert_group(), shard_group(),
                                   /*sampler=*/true)
            .model,
        nullptr};
    engine::dist::load_sampler_share(*group_, *loaded.model, nullptr);
    rep.samplers[key] = std::move(loaded);
  }

  // Rank 0 names only the samplers it loaded on every rank (and, while their shares run, does not drop them).
  SamplingModel& sampling_model(Replica& rep, const std::string& key) {
    if (key.empty()) return rep.live;
    auto it = rep.samplers.find(key);
    if (it == rep.samplers.end())
      throw group_failure("data-parallel worker " + std::to_string(group_->rank()) +
                          ": rank 0 named sampler weights '" + key + "', which this rank does not hold");
    return it->second;
  }

  const Tokenizer& tokenizer(Replica& rep) {
    if (!rep.tokenizer)
      rep.tokenizer = load_tokenizer(engine::tokenizer_spec(rep.model.model->config(), rep.resolved_base));
    return *rep.tokenizer;
  }

  // The group the models' experts are spread over (make_session_model's expert_group), null without expert
  // parallelism: the replicas and sampler models are made as rank 0 makes them.
  engine::dist::Group* expert_group() const {
    return options_.service.data_parallel.expert_parallel ? group_.get() : nullptr;
  }
  // The group a LoRA model's base is sharded over (make_session_model's shard_group), null unless sessions are.
  engine::dist::Group* shard_group() const {
    return engine::dist::shards_sessions(options_.service.data_parallel.shard) ? group_.get() : nullptr;
  }

  // Rank 0 only sends commands for sessions it opened on every rank.
  Replica& replica(std::uint64_t id) {
    auto it = replicas_.find(id);
    if (it == replicas_.end())
      throw group_failure("data-parallel worker " + std::to_string(group_->rank()) + ": rank 0 named session " +
                          std::to_string(id) + ", which this rank does not hold");
    return it->second;
  }

  DataParallelWorkerOptions options_;
  engine::DeviceChoice dev_;
  std::unique_ptr<engine::dist::Group> group_;
  engine::BaseModelRegistry bases_;  // the frozen bases the replicas share, and the engine loops that decode them
  std::map<std::uint64_t, Replica> replicas_;
};

}  // namespace

void run_data_parallel_worker(const DataParallelWorkerOptions& options) {
  engine::dist::check_shard_mode(options.service.data_parallel.shard);
  auto dev = engine::choose_device(options.service.device, options.service.dtype);
  dev.quantized_base = options.service.quantized_base;
  dev.activation_checkpointing = options.service.activation_checkpointing;
  engine::dist::GroupOptions go;
  std::tie(go.host, go.port) = engine::dist::parse_host_port(options.rendezvous, "worker --rendezvous");
  if (go.port == 0) throw invalid_argument("worker --rendezvous: port 0 is for rank 0 alone; give rank 0's port");
  go.rank = options.rank;
  go.world_size = options.world_size;
  go.timeout = engine::dist::timeout_of(options.timeout_s, "worker --timeout-s");
  // As rank 0 resolved it for the workers it starts (--backend); "auto" on a host of its own knows of this rank
  // alone. A choice other than rank 0's is refused at the rendezvous (the fingerprints name both).
  const std::string backend =
      engine::dist::tensor_backend_here(options.service.data_parallel.backend, dev, go.host, options.world_size, 1);
  go.fingerprint = engine::dist::group_fingerprint(dev, backend, options.service);
  go.nccl = backend == "nccl";
  go.store_prefix = options.service.data_parallel.store_prefix;
  Worker worker(options, dev, engine::dist::Group::join(go));
  worker.run();
}

}  // namespace rlloop
