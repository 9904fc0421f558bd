// LocalSession: adapters over a shared base model (or a private full model), operations run in submission order
// by the base model's engine loop.
#include <rlloop/local.hpp>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <mutex>
#include <numeric>

#include <ATen/CPUGeneratorImpl.h>

#include <rlloop/limits.hpp>
#include <rlloop/tokenizer.hpp>

#include "runtime/base_models.hpp"
#include "runtime/batch.hpp"
#include "model/builtin_models.hpp"
#include "io/checkpoint.hpp"
#include "kernels/cpu_allocator.hpp"
#include "kernels/device.hpp"
#include "comm/codec.hpp"
#include "dist/coordinator.hpp"
#include "dist/replica_ops.hpp"
#include "io/gguf_export.hpp"
#include "io/gguf_model.hpp"
#include "runtime/lockstep_batches.hpp"
#include "runtime/loss.hpp"
#include "io/model_io.hpp"
#include "runtime/optimizer.hpp"
#include "runtime/pass_metrics.hpp"
#include "runtime/sampler.hpp"
#include "runtime/session_model.hpp"

namespace rlloop {
namespace fs = std::filesystem;
using namespace rlloop::engine;

namespace {

engine::EngineLoopOptions loop_options(const LocalServiceOptions& service) {
  if (service.max_batch_rows < 1)
    throw invalid_argument("LocalServiceOptions.max_batch_rows must be at least 1, got " +
                           std::to_string(service.max_batch_rows));
  if (service.kv_cache_mb < 0)
    throw invalid_argument("LocalServiceOptions.kv_cache_mb must not be negative, got " +
                           std::to_string(service.kv_cache_mb));
  if (service.prefill_chunk_tokens < 1)
    throw invalid_argument("LocalServiceOptions.prefill_chunk_tokens must be at least 1, got " +
                           std::to_string(service.prefill_chunk_tokens));
  return {service.max_batch_rows, service.kv_cache_mb << 20, service.prefill_chunk_tokens};
}

// The base models of one service, and with data parallelism the group its sessions train on (formed here: the
// constructor returns once every rank has joined).
std::shared_ptr<BaseModelRegistry> make_registry(const LocalServiceOptions& service) {
  auto registry = std::make_shared<BaseModelRegistry>(loop_options(service));
  if (service.data_parallel.world_size < 1)
    throw invalid_argument("LocalServiceOptions.data_parallel.world_size must be at least 1, got " +
                           std::to_string(service.data_parallel.world_size));
  if (service.data_parallel.world_size > 1)
    registry->set_data_parallel(
        std::make_shared<dist::Coordinator>(service, choose_device(service.device, service.dtype)));
  return registry;
}

DecodePrecision decode_precision_of(SamplingPrecision p) {
  switch (p) {
    case SamplingPrecision::fp32: return DecodePrecision::fp32;
    case SamplingPrecision::bf16: return DecodePrecision::bf16;
    case SamplingPrecision::int8: return DecodePrecision::int8;
  }
  return DecodePrecision::fp32;
}

}  // namespace

std::string resolve_base_model(const LocalServiceOptions& service, const std::string& name) {
  for (const auto& [n, dir] : service.base_models)
    if (n == name) return dir;
  if (builtin_model(name)) return "builtin:" + name;
  if (fs::exists(fs::path(name) / "config.json") || is_gguf_path(name)) return name;
  std::string known;
  for (const auto& n : builtin_model_names()) known += " " + n;
  for (const auto& [n, dir] : service.base_models) known += " " + n;
  throw not_found("unknown base model '" + name + "': not in the catalogue (" + known +
                  " ) and not a directory holding config.json or a .gguf file");
}

// Blocks cached for a closed session's shapes would sit unused in a long-lived process (a server whose tenants
// come and go); the next step of another session refills the cache with its own.
namespace {
struct ReleaseCachedCpuBlocks {
  ~ReleaseCachedCpuBlocks() {
    if (auto* allocator = installed_caching_cpu_allocator()) allocator->release_cached();
  }
};
}  // namespace

struct LocalSession::Impl {
  ReleaseCachedCpuBlocks release_cache;  // first member: destroyed last, after the lane, model and gradients
  SessionOptions options;
  LocalServiceOptions service;
  std::shared_ptr<BaseModelRegistry> bases;
  std::string resolved_base;
  std::string key;  // of the base in `bases`
  DeviceChoice dev;
  engine::DecodePrecision decode_precision = engine::DecodePrecision::fp32;
  std::shared_ptr<SharedBase> shared_base;  // LoRA sessions: the weights they share; null with a private model
  std::shared_ptr<Transformer> model;
  std::unique_ptr<AdamW> optimizer;
  // A forward_backward ran since the last optimizer step or load: the parameters' .grad() hold an accumulation
  // that save_state keeps (on every rank with data parallelism).
  bool gradients_pending = false;
  std::shared_ptr<const Tokenizer> tokenizer;  // for stop strings; null if the model has none we can load
  at::Generator generator;
  // A model sample() can decode from, with its bf16 weight snapshot kept across calls (bf16 precision only;
  // sample() re-rounds when the weights changed since). Models over the shared base use its one snapshot.
  struct SamplingModel {
    std::shared_ptr<Transformer> model;
    std::shared_ptr<const RoundedWeights> rounded;
    std::uint64_t last_used = 0;
    int decoding = 0;  // this session's sampling requests reading it now (they run side by side): never dropped
  };
  SamplingModel live;  // the training model
  // Sampler weights saved by this session or opened from disk, by checkpoint path. At most
  // kLoadedSamplerModels stay loaded, the least recently used dropped first (and read again from disk when
  // asked for): a loop that saves sampler weights under a new name every step would otherwise keep every
  // step's model in memory. With LoRA each holds only its adapters.
  static constexpr std::size_t kLoadedSamplerModels = 4;
  std::map<std::string, SamplingModel> samplers;
  std::uint64_t sampler_clock = 0;

  std::mutex usage_mu;
  TokenUsage usage;

  // With data parallelism: the group that holds this session's replicas on the other ranks, and its id there.
  // Training runs through it (and so on every rank), and so do samples and logprobs; the workers also hold what
  // `samplers` holds.
  std::shared_ptr<dist::Coordinator> group;
  std::uint64_t replica = 0;

  // An expert-parallel session's sampling requests, batched (sample_in_lockstep runs each batch).
  LockstepBatches lockstep{service.max_batch_rows, service.kv_cache_mb << 20,
                           [this](const std::vector<LockstepBatches::Entry>& batch) {
                             return sample_in_lockstep(batch);
                           }};

  // Last member: destroying it waits for the session's queued operations, before the rest is destroyed.
  std::unique_ptr<EngineLoop::Lane> lane;

  Impl(const SessionOptions& opts, const LocalServiceOptions& svc, std::shared_ptr<BaseModelRegistry> registry)
      : options(opts), service(svc), bases(std::move(registry)) {
    decode_precision = decode_precision_of(service.sampling_precision);
    dev = choose_device(service.device, service.dtype);
    dev.quantized_base = service.quantized_base;
    dev.activation_checkpointing = service.activation_checkpointing;
    resolved_base = resolve_base_model(service, options.base_model);
    key = base_key(resolved_base, dev);
    group = bases->data_parallel();
    model = make_model();
    // The KV pool is allocated for the whole budget at its first request (shared with the base's other sessions),
    // so that it does not grow step by step leaving each smaller storage behind.
    model->kv_pools()->set_capacity_bytes(service.kv_cache_mb << 20);
    live.model = model;
    build_optimizer();
    generator = at::detail::createCPUGenerator(static_cast<std::uint64_t>(options.seed));
    try {
      tokenizer = load_tokenizer(tokenizer_spec(model->config(), resolved_base));
    } catch (const error&) {
      tokenizer = nullptr;  // stop strings then need a tokenizer: sample() says so
    }
    if (group) replica = group->open(options, {shared_base, model});
    lane = EngineLoop::open_lane(bases->loop(key));
  }

  ForwardBackwardOutput run_loss(const std::vector<Datum>& data, const LossSpec& loss, bool backward) {
    const auto started = std::chrono::steady_clock::now();
    gradients_pending = gradients_pending || backward;  // before: a pass that fails midway may have added some
    auto out =
        group ? group->forward(replica, *model, data, loss, backward) : run_builtin_loss(*model, data, loss, backward);
    if (backward) optimizer->absorb_gradients();  // bf16 parameters: into their fp32 sums before the next pass
    add_usage({0, 0, out.training_tokens});
    add_service_metrics(out, data, &loss, model->config(), backward, cost_since(started));
    if (backward) add_grad_norm(out);
    return out;
  }

  ForwardBackwardOutput run_custom(const std::vector<Datum>& data, const CustomLossFn& fn) {
    const auto started = std::chrono::steady_clock::now();
    gradients_pending = true;
    auto out = group ? group->forward_custom(replica, *model, data, fn) : run_custom_loss(*model, data, fn);
    optimizer->absorb_gradients();
    add_usage({0, 0, out.training_tokens});
    add_service_metrics(out, data, nullptr, model->config(), /*backward=*/true, cost_since(started));
    add_grad_norm(out);
    return out;
  }

  // actor/grad_norm: the norm of the gradient accumulated since the last step, this pass included (what the next
  // optim_step reports as grad_norm before clipping), which the SageMaker SDK takes from a split batch's last
  // chunk. With data parallelism each rank holds only its share until the step sums them, so it is left out.
  void add_grad_norm(ForwardBackwardOutput& out) const {
    if (!group && optimizer) out.metrics["actor/grad_norm"] = optimizer->grad_norm();
  }

  // The pass that began at `started`, against the peak of every rank's device.
  PassCost cost_since(std::chrono::steady_clock::time_point started) const {
    PassCost cost;
    cost.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    cost.peak_flops = peak_flops(dev.device, dev.dtype) * (group ? group->world_size() : 1);
    cost.base_frozen = options.lora.has_value();
    return cost;
  }

  // The session's model as created (session_model.hpp). Sampler models from checkpoints are made the same way.
  std::shared_ptr<Transformer> make_model() {
    dist::Group* experts = group ? group->expert_group() : nullptr;
    SessionModel made = make_session_model(*bases, resolved_base, dev, options, experts);
    if (made.shared_base) shared_base = made.shared_base;
    return made.model;
  }

  // An expert-parallel model holds this rank's experts only: an export, which needs every expert on one rank, is
  // refused.
  void refuse_if_expert_parallel(const std::string& operation) const {
    if (model->expert_parallel())
      throw unsupported(operation + ": this session's experts are spread over the data-parallel ranks (expert "
                        "parallelism); save_state gathers them: load that checkpoint into a session without expert "
                        "parallelism to export");
  }

  // An expert-parallel session's samples: every rank decodes its share in step with the others (its sparse layers
  // exchange rows at every step), inside one command of the group, run on this session's lane (its base's engine
  // loop waits meanwhile) a batch of requests at a time (`lockstep`). The shares are placed as for any data-parallel
  // request; streamed requests and prompt logprobs stay on rank 0, the others then taking part with no rows.
  std::vector<LockstepBatches::Outcome> sample_in_lockstep(const std::vector<LockstepBatches::Entry>& batch) {
    std::vector<LockstepBatches::Outcome> out(batch.size());
    const std::optional<std::string>& model_path = batch.front().request.model_path;  // the same for all
    SamplingModel& target = sampling_model(model_path);
    const ModelConfig& cfg = target.model->config();
    dist::LockstepBatch mine;
    mine.model = target.model.get();
    mine.precision = decode_precision;
    mine.rounded = rounded_slot(target);
    mine.prefill_tokens = service.prefill_chunk_tokens;
    std::vector<std::size_t> entry_of;  // the batch entry of each share
    for (std::size_t i = 0; i < batch.size(); ++i) {
      const LockstepBatches::Entry& entry = batch[i];
      try {
        validate_sample_request(entry.request, cfg, tokenizer != nullptr);
        SampleRequest req = entry.request;
        if (auto eos = cfg.eos_token_id) req.params.stop_token_ids.push_back(static_cast<token_id>(*eos));
        dist::LockstepShare share;
        if (!req.params.stop.empty()) share.stop_check = make_stop_string_check(*tokenizer, req.params.stop);
        share.seed = req.params.seed ? static_cast<std::uint64_t>(*req.params.seed) : next_seed();
        const int ranks = group->world_size();
        const bool spread = !entry.on_step && !req.include_prompt_logprobs && req.topk_prompt_logprobs == 0;
        dist::SamplePlacement placement{std::vector<int>(ranks, 0), std::vector<int>(ranks, 0)};
        if (spread)
          placement = dist::place_samples(req.num_samples, ranks, group->next_turn());
        else
          placement.count[0] = req.num_samples;
        share.at_once = prefills_at_once(req);
        share.req = std::move(req);
        share.req.num_samples = placement.count[0];
        share.stream = SampleStream(share.seed, placement.first[0]);
        share.on_step = entry.on_step;
        mine.shares.push_back(std::move(share));
        mine.placements.push_back(std::move(placement));
        entry_of.push_back(i);
      } catch (...) {
        out[i].error = std::current_exception();  // this request alone
      }
    }
    if (mine.shares.empty()) return out;
    std::vector<dist::LockstepOutcome> outcomes;
    try {
      outcomes = group->sample_in_lockstep(replica, sampler_key(model_path), mine);
    } catch (...) {
      for (std::size_t i : entry_of) out[i].error = std::current_exception();
      return out;
    }
    for (std::size_t k = 0; k < outcomes.size(); ++k) {
      LockstepBatches::Outcome& o = out[entry_of[k]];
      if (!outcomes[k].error.empty()) {
        o.error = std::make_exception_ptr(io_error("data-parallel sample failed on " + outcomes[k].error));
        continue;
      }
      o.response = std::move(outcomes[k].response);
      TokenUsage u;  // the prompt once, every sample's new tokens
      u.prefill = static_cast<std::int64_t>(mine.shares[k].req.prompt.length());
      for (const auto& s : o.response.sequences) u.sample += s.decode_tokens;
      add_usage(u);
    }
    return out;
  }

  std::shared_ptr<const RoundedWeights>* rounded_slot(SamplingModel& target) {
    return shared_base ? &shared_base->rounded : &target.rounded;  // a LoRA session's every model shares the base
  }

  void build_optimizer() { optimizer = make_optimizer(*model); }

  // An unseeded request's seed: the next number of the session's generator (saved with its state), so a session
  // restored from save_state samples what the saved one would have.
  std::uint64_t next_seed() {
    std::lock_guard lock(generator.mutex());
    return at::check_generator<at::CPUGeneratorImpl>(generator)->random64();
  }

  void add_usage(const TokenUsage& u) {
    std::lock_guard lock(usage_mu);
    usage += u;
  }

  // The key of a sampling request's model: empty for the live model, else the checkpoint's normalized path (as
  // save() returns paths).
  static std::string sampler_key(const std::optional<std::string>& path) {
    return path && !path->empty() ? fs::absolute(*path).lexically_normal().string() : std::string();
  }

  SamplingModel& sampling_model(const std::optional<std::string>& path) {
    const std::string key = sampler_key(path);
    if (key.empty()) return live;
    auto it = samplers.find(key);
    if (it != samplers.end()) {
      it->second.last_used = ++sampler_clock;
      return it->second;
    }
    auto state = read_state_dir(*path, false);
    check_same_base(state.meta, *path);
    auto m = make_model();
    load_trainable(*m, state.weights);
    if (samplers.size() >= kLoadedSamplerModels) {
      // The least recently used of those no request is decoding with (while all are, the cache holds one more).
      auto oldest = samplers.end();
      for (auto i = samplers.begin(); i != samplers.end(); ++i)
        if (i->second.decoding == 0 && (oldest == samplers.end() || i->second.last_used < oldest->second.last_used))
          oldest = i;
      if (oldest != samplers.end()) drop_sampler(oldest);
    }
    // The workers hold what this cache holds, so that they can decode its models' samples too.
    if (group && group->failure().empty()) group->load_sampler(replica, key, *m, state.weights);
    return samplers.emplace(key, SamplingModel{m, nullptr, ++sampler_clock}).first->second;
  }

  void drop_sampler(std::map<std::string, SamplingModel>::iterator it) {
    try {
      if (group) group->drop_sampler(replica, it->first);
    } catch (const group_failure&) {
      // The group is gone, and its copies with it.
    }
    samplers.erase(it);
  }

  // A checkpoint holds what its session trained (with LoRA, the adapters only), so it is only meaningful over
  // the base it was trained on.
  void check_same_base(const CheckpointMeta& meta, const std::string& path) const {
    const std::string& saved = meta.base_model;
    std::string saved_resolved;
    try {
      saved_resolved = resolve_base_model(service, saved);
    } catch (const not_found&) {
      // No longer served here: it cannot be this session's base.
    }
    if (saved_resolved != resolved_base)
      throw invalid_argument("checkpoint '" + path + "' was trained on base model '" + saved +
                             "', this session's base model is '" + options.base_model + "'");
  }

  TensorMap trainable_weights() {
    TensorMap out;
    for (auto& [name, t] : model->named_trainable_parameters()) out[name] = t.detach().to(torch::kCPU).clone();
    return out;
  }

  CheckpointMeta meta() {
    auto state = generator.get_state();
    return {.base_model = options.base_model,
            .lora = options.lora,
            .value_head = options.value_head,
            .seed = options.seed,
            .step = optimizer->step_count(),
            .rng_state = {state.data_ptr<std::uint8_t>(), state.data_ptr<std::uint8_t>() + state.numel()}};
  }

  // The gradients accumulated since the last optimizer step (empty when none are pending), as CPU fp32 tensors
  // by parameter name. With data parallelism each rank holds its share: they are folded into rank 0's first.
  TensorMap pending_gradients() {
    TensorMap out;
    if (!gradients_pending) return out;
    if (group) group->fold_gradients(replica, *model, *optimizer);
    const auto& ps = optimizer->parameters();
    for (std::size_t i = 0; i < ps.size(); ++i)
      if (const torch::Tensor g = optimizer->gradient(i); g.defined())
        out[ps[i].name] = g.detach().to(torch::kCPU, torch::kFloat32, /*non_blocking=*/false, /*copy=*/true);
    return out;
  }

  // Gradients saved by pending_gradients() back into the optimizer's accumulation (after its zero_grad).
  void restore_gradients(const TensorMap& saved) {
    const auto& ps = optimizer->parameters();
    for (std::size_t i = 0; i < ps.size(); ++i) {
      const auto it = saved.find(ps[i].name);
      if (it == saved.end()) continue;
      if (it->second.sizes() != ps[i].tensor.sizes())
        throw invalid_argument("checkpoint gradient '" + ps[i].name + "' has another shape than the parameter");
      optimizer->set_gradient(i, it->second);
    }
    gradients_pending = !saved.empty();
  }

  CheckpointRef save(const std::string& name, bool with_optimizer) {
    if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..")
      throw invalid_argument("checkpoint name '" + name + "' must be a non-empty file name without '/'");
    const std::string dir = (fs::path(service.checkpoint_dir) / name).string();
    auto weights = trainable_weights();
    TensorMap opt, gradients;
    if (with_optimizer) {
      for (auto& [k, v] : optimizer->state_tensors()) opt[k] = v;
      gradients = pending_gradients();
    }
    if (model->expert_parallel()) {
      // The other ranks' experts: the checkpoint holds the whole model, as one rank's would.
      const bool with_gradients = with_optimizer && gradients_pending;
      auto others = group->gather_experts(replica, *model, *optimizer, with_optimizer, with_gradients);
      weights.merge(others.weights);
      opt.merge(others.optimizer);
      gradients.merge(others.gradients);
    }
    write_state_dir(dir, weights, with_optimizer ? &opt : nullptr, meta(), gradients.empty() ? nullptr : &gradients);
    const std::string path = fs::absolute(dir).lexically_normal().string();
    // A model loaded from this path before holds the old weights; the next use reloads.
    if (auto it = samplers.find(path); it != samplers.end()) drop_sampler(it);
    return {path};
  }

  void load(const std::string& path, bool with_optimizer) {
    auto state = read_state_dir(path, with_optimizer);
    const CheckpointMeta& m = state.meta;
    check_same_base(m, path);
    if (m.lora != options.lora)
      throw invalid_argument("checkpoint '" + path + "' was saved with different LoRA settings than this session");
    if (m.value_head != options.value_head)
      throw invalid_argument("checkpoint '" + path + "' was saved " + (options.value_head ? "without" : "with") +
                             " a value head, unlike this session");
    load_trainable(*model, state.weights);
    if (with_optimizer) {
      optimizer->load_state_tensors(state.optimizer, m.step);
      auto rng = m.rng_state;
      auto t = torch::from_blob(rng.data(), {static_cast<std::int64_t>(rng.size())}, torch::kUInt8).clone();
      generator.set_state(t);
    } else {
      // Weights only: moments and gradients of the old weights mean nothing for the new ones; start fresh.
      optimizer->zero_grad();
      build_optimizer();
    }
    optimizer->zero_grad();
    gradients_pending = false;
    if (model->expert_parallel())
      group->load_state(replica, *model, optimizer, with_optimizer, {state.weights, state.optimizer, state.gradients},
                        m.step);
    else if (group)
      group->sync_state(replica, *model, optimizer, with_optimizer);
    // An accumulation saved between forward_backward and optim_step resumes (on rank 0, which the next step's
    // sum over the ranks includes).
    if (with_optimizer) restore_gradients(state.gradients);
  }
};

LocalSession::LocalSession(const SessionOptions& options, const LocalServiceOptions& service)
    : LocalSession(options, service, make_registry(service)) {}
LocalSession::LocalSession(const SessionOptions& options, const LocalServiceOptions& service,
                           std::shared_ptr<BaseModelRegistry> bases)
    : impl_(std::make_unique<Impl>(options, service, std::move(bases))) {}
LocalSession::~LocalSession() {
  impl_->lane.reset();  // the queued operations run first
  try {
    if (impl_->group) impl_->group->close(impl_->replica);
  } catch (const group_failure&) {
    // The group failed while closing: its replicas are gone with it.
  }
}

Future<ForwardBackwardOutput> LocalSession::forward(const std::vector<Datum>& data, const LossSpec& loss) {
  return impl_->lane->submit<ForwardBackwardOutput>(
      [this, data, loss] { return impl_->run_loss(data, loss, /*backward=*/false); });
}

Future<ForwardBackwardOutput> LocalSession::forward_backward(const std::vector<Datum>& data, const LossSpec& loss) {
  return impl_->lane->submit<ForwardBackwardOutput>(
      [this, data, loss] { return impl_->run_loss(data, loss, /*backward=*/true); });
}

Future<ForwardBackwardOutput> LocalSession::forward_backward_custom(const std::vector<Datum>& data,
                                                                    const CustomLossFn& fn) {
  return impl_->lane->submit<ForwardBackwardOutput>([this, data, fn] { return impl_->run_custom(data, fn); });
}

Future<OptimStepOutput> LocalSession::optim_step(const AdamParams& params) {
  return impl_->lane->submit<OptimStepOutput>([this, params] {
    auto& optimizer = *impl_->optimizer;
    OptimStepOutput out{impl_->group ? impl_->group->optim_step(impl_->replica, *impl_->model, optimizer, params)
                                     : optimizer.step(params)};
    impl_->gradients_pending = false;
    return out;
  });
}

Future<CheckpointRef> LocalSession::save_state(const std::string& name) {
  return impl_->lane->submit<CheckpointRef>([this, name] { return impl_->save(name, true); });
}

Future<LoadStateOutput> LocalSession::load_state(const std::string& path, bool with_optimizer) {
  return impl_->lane->submit<LoadStateOutput>([this, path, with_optimizer] {
    impl_->load(path, with_optimizer);
    return LoadStateOutput{};
  });
}

Future<CheckpointRef> LocalSession::save_weights_for_sampler(const std::string& name) {
  return impl_->lane->submit<CheckpointRef>([this, name] { return impl_->save(name, false); });
}

Future<SampleResponse> LocalSession::sample(const SampleRequest& request) { return sample(request, nullptr); }

Future<SampleResponse> LocalSession::sample(const SampleRequest& request, SampleProgress on_step) {
  if (impl_->model->expert_parallel())
    return impl_->lockstep.submit(*impl_->lane, request,
                                  kv_bytes_needed(*impl_->model, request, impl_->decode_precision), std::move(on_step));
  // With data parallelism the live model's samples are shared out over the ranks (place_samples; the ranks take
  // turns at the larger shares, so single samples go to each in turn), each rank decoding its own from the
  // request's streams: the tokens are those of one rank. Sampler weights from a checkpoint too: the workers hold
  // what rank 0's sampler cache holds. Staying on rank 0: streamed requests (their progress is rank 0's rows),
  // prompt logprobs, and everything once the group has failed.
  const auto& group = impl_->group;
  const bool spread = group && group->failure().empty() && !on_step && !request.include_prompt_logprobs &&
                      request.topk_prompt_logprobs == 0 && request.num_samples >= 1;
  const dist::SamplePlacement placement =
      spread ? dist::place_samples(request.num_samples, group->world_size(), group->next_turn())
             : dist::SamplePlacement{{0}, {request.num_samples}};
  auto others = std::make_shared<std::shared_ptr<dist::Replies>>();  // the workers' samples, once posted

  // Checks the request and posts the workers' samples (before this rank's prefill, so that they prefill theirs at
  // the same time); returns what this rank decodes.
  struct Prepared {
    SampleRequest mine;
    StopStringCheck stop_check;
    SampleStream stream{0};
    Impl::SamplingModel* target = nullptr;
  };
  auto prepare = [this, request, placement, spread, others] {
    Prepared p;
    p.target = &impl_->sampling_model(request.model_path);
    const ModelConfig& cfg = p.target->model->config();
    validate_sample_request(request, cfg, impl_->tokenizer != nullptr);
    p.mine = request;
    if (auto eos = cfg.eos_token_id) p.mine.params.stop_token_ids.push_back(static_cast<token_id>(*eos));
    if (!p.mine.params.stop.empty()) p.stop_check = make_stop_string_check(*impl_->tokenizer, p.mine.params.stop);
    const std::uint64_t seed =
        p.mine.params.seed ? static_cast<std::uint64_t>(*p.mine.params.seed) : impl_->next_seed();
    if (spread)
      *others = impl_->group->post_sample(impl_->replica, Impl::sampler_key(request.model_path), p.mine, seed,
                                          impl_->decode_precision, placement);
    p.mine.num_samples = placement.count[0];
    p.stream = SampleStream(seed, placement.first[0]);
    return p;
  };
  // Every rank's samples in the request's order, billed: the prompt once, every sample's new tokens.
  auto finish = [this, others, placement,
                 prompt = static_cast<std::int64_t>(request.prompt.length())](SampleResponse out) {
    if (*others) {
      // Each rank decoded a contiguous run of the samples (placement): every sequence goes to its index.
      std::vector<SampledSequence> all(std::accumulate(placement.count.begin(), placement.count.end(), std::size_t{0}));
      auto put = [&](int rank, std::vector<SampledSequence> sequences) {
        for (std::size_t i = 0; i < sequences.size(); ++i) all.at(placement.first[rank] + i) = std::move(sequences[i]);
      };
      put(0, std::move(out.sequences));
      const auto replies = (*others)->take();  // in the order of the workers that have samples
      std::size_t next = 0;
      for (std::size_t r = 1; r < placement.count.size(); ++r)
        if (placement.count[r] > 0) put(static_cast<int>(r), dist::ByteReader(replies.at(next++)).get_sequences());
      out.sequences = std::move(all);
    }
    TokenUsage u;
    u.prefill = prompt;
    for (const auto& s : out.sequences) u.sample += s.decode_tokens;
    impl_->add_usage(u);
    return out;
  };

  auto ready = [others] { return !*others || (*others)->ready(); };
  if (placement.count[0] == 0) {  // every sample is a worker's: this rank only waits for them
    return impl_->lane->submit_deferred<SampleResponse>([prepare, finish, ready] {
      prepare();
      return EngineLoop::Deferred<SampleResponse>{ready, [finish] { return finish(SampleResponse{}); }};
    });
  }
  // The sampler model the run reads, counted in its `decoding` from the start of the run until its end, so that
  // another request of this session loading a checkpoint meanwhile does not drop it from the cache.
  auto reading = std::make_shared<Impl::SamplingModel*>(nullptr);
  auto done_reading = [reading] {
    if (*reading) --(*reading)->decoding;
    *reading = nullptr;
  };
  auto start = [this, prepare, reading, on_step = std::move(on_step)]() -> std::unique_ptr<DecodeRun> {
    Prepared p = prepare();
    // The run reads the model until it finishes: this session's later operations wait for it, and its sampling
    // requests, which run beside it, do not drop it from the sampler cache (`decoding`).
    // The prompt prefills in the engine loop's steps, a chunk at a time beside the other requests' rows (unless the
    // request asks for what only a whole prompt's forward gives: DecodeRun's Prefill).
    auto run = std::make_unique<DecodeRun>(*p.target->model, p.mine, p.stop_check, p.stream, impl_->decode_precision,
                                           impl_->rounded_slot(*p.target), Prefill::in_steps);
    ++p.target->decoding;
    *reading = p.target;
    if (on_step) {
      // Each step's tokens; the first token of every sample at once where the run prefilled as it was made.
      if (!run->prefilling()) on_step(run->progress());
      run->on_step = on_step;
    }
    return run;
  };
  // The KV cache this rank's samples may take (the session's model stands for its sampler models: one shape).
  SampleRequest mine = request;
  mine.num_samples = placement.count[0];
  const std::int64_t kv_bytes = kv_bytes_needed(*impl_->model, mine, impl_->decode_precision);
  return impl_->lane->submit_sample(
      placement.count[0], kv_bytes, std::move(start),
      [finish, done_reading](DecodeRun& run) {
        done_reading();
        return finish(run.take());
      },
      std::move(ready), [done_reading, others](std::exception_ptr) {
        // Other ranks may still decode their shares of a failed request (the lane waits for them): its sampler
        // then stays loaded, as dropping it would drop theirs under them.
        if (!*others) done_reading();
      });
}

Future<std::vector<double>> LocalSession::compute_logprobs(const ComputeLogprobsRequest& request) {
  if (impl_->model->expert_parallel())
    return impl_->lane->submit<std::vector<double>>([this, request] {
      Transformer& m = *impl_->sampling_model(request.model_path).model;
      validate_model_input(request.prompt, m.config().vocab_size, "compute_logprobs: ");
      const auto tokens = request.prompt.tokens();
      impl_->add_usage({static_cast<std::int64_t>(tokens.size()), 0, 0});
      if (tokens.size() < 2) return engine::compute_logprobs(m, tokens);  // no forward: nothing to exchange
      return impl_->group->logprobs_in_lockstep(impl_->replica, Impl::sampler_key(request.model_path), m, tokens);
    });
  // With data parallelism the prompts go to the ranks in turn (the workers hold the sampler models too).
  const auto& group = impl_->group;
  const int rank = group && group->failure().empty() ? group->next_turn() : 0;
  auto checked_tokens = [this, request](Transformer& m) {
    validate_model_input(request.prompt, m.config().vocab_size, "compute_logprobs: ");
    auto tokens = request.prompt.tokens();
    impl_->add_usage({static_cast<std::int64_t>(tokens.size()), 0, 0});
    return tokens;
  };
  if (rank != 0)
    return impl_->lane->submit_deferred<std::vector<double>>([this, request, rank, checked_tokens] {
      auto tokens = checked_tokens(*impl_->sampling_model(request.model_path).model);
      auto replies = impl_->group->post_logprobs(impl_->replica, Impl::sampler_key(request.model_path), tokens, rank);
      return EngineLoop::Deferred<std::vector<double>>{[replies] { return replies->ready(); },
                                                       [replies] {
                                                         const auto reply = replies->take();
                                                         dist::ByteReader r(reply[0]);
                                                         return r.get_vector<double>();
                                                       }};
    });
  return impl_->lane->submit<std::vector<double>>([this, request, checked_tokens] {
    Transformer& m = *impl_->sampling_model(request.model_path).model;
    return engine::compute_logprobs(m, checked_tokens(m));
  });
}

SessionInfo LocalSession::info() {
  // Runs on the worker so it never reads the model while an operation changes it.
  return impl_->lane
      ->submit<SessionInfo>([this] {
        SessionInfo i;
        const auto& cfg = impl_->model->config();
        i.name = impl_->options.name;
        i.base_model = impl_->options.base_model;
        i.model_type = cfg.model_type;
        i.chat_renderer = cfg.family().chat_renderer;
        i.lora = impl_->options.lora;
        i.vocab_size = cfg.vocab_size;
        i.max_position_embeddings = cfg.max_position_embeddings;
        i.num_parameters = impl_->model->quantized_values();
        for (const auto& p : impl_->model->parameters()) i.num_parameters += p.numel();
        for (auto& [n, t] : impl_->model->named_trainable_parameters()) i.num_trainable_parameters += t.numel();
        if (impl_->model->expert_parallel()) {
          // This rank holds 1/W of the experts, every other rank as many: the model's counts have W times this
          // rank's experts.
          const std::int64_t others = impl_->group->world_size() - 1;
          for (const auto& [n, t] : impl_->model->hf_state_dict())
            if (impl_->model->is_expert_tensor(n)) i.num_parameters += others * t.numel();
          for (auto& [n, t] : impl_->model->named_trainable_parameters())
            if (impl_->model->is_expert_tensor(n)) i.num_trainable_parameters += others * t.numel();
        }
        i.tokenizer = tokenizer_spec(cfg, impl_->resolved_base);
        if (cfg.eos_token_id) i.eos_token_id = static_cast<token_id>(*cfg.eos_token_id);
        i.device = device_name(impl_->dev.device);
        i.step = impl_->optimizer->step_count();
        i.value_head = impl_->options.value_head;
        i.experts = cfg.expert_shape();
        return i;
      })
      .get();
}

TokenUsage LocalSession::usage() {
  std::lock_guard lock(impl_->usage_mu);
  return impl_->usage;
}

Future<CheckpointRef> LocalSession::export_merged_model(const std::string& dir) {
  return impl_->lane->submit<CheckpointRef>([this, dir] {
    impl_->refuse_if_expert_parallel("export_merged_model");
    save_model(*impl_->model, dir);
    return CheckpointRef{dir};
  });
}

Future<CheckpointRef> LocalSession::export_peft_adapter(const std::string& dir) {
  return impl_->lane->submit<CheckpointRef>([this, dir] {
    save_peft_adapter(*impl_->model, dir, impl_->options.base_model);
    return CheckpointRef{dir};
  });
}

Future<CheckpointRef> LocalSession::export_gguf_adapter(const std::string& path) {
  return impl_->lane->submit<CheckpointRef>([this, path] {
    save_gguf_adapter(*impl_->model, path);
    return CheckpointRef{path};
  });
}

Future<CheckpointRef> LocalSession::export_gguf_model(const std::string& path, const std::string& type) {
  return impl_->lane->submit<CheckpointRef>([this, path, type] {
    impl_->refuse_if_expert_parallel("export_gguf_model");
    const auto stored = gguf_export_type(type);
    const std::string& base = impl_->resolved_base;
    if (!is_gguf_path(base))
      throw unsupported("export_gguf_model: the base model '" + impl_->options.base_model +
                        "' is not a GGUF file, so there is no tokenizer metadata to carry into one; export the "
                        "merged model in Hugging Face layout (export_merged_model) and convert it with llama.cpp's "
                        "convert_hf_to_gguf.py");
    save_gguf_model(*impl_->model, path, stored, gguf::File::open(base).metadata());
    return CheckpointRef{path};
  });
}

// --- LocalService ----------------------------------------------------------------------------------------

LocalService::LocalService(LocalServiceOptions options)
    : options_(std::move(options)), bases_(make_registry(options_)) {}

std::vector<BaseModelStats> LocalService::base_model_stats() const { return bases_->stats(); }

DataParallelStats LocalService::data_parallel_stats() const {
  auto group = bases_->data_parallel();
  return group ? group->stats() : DataParallelStats{};
}

std::string LocalService::data_parallel_failure() const {
  auto group = bases_->data_parallel();
  return group ? group->failure() : std::string();
}

std::shared_ptr<LocalSession> LocalService::create_session(const SessionOptions& options) {
  validate(options);  // rlloop/limits.hpp: the LoRA rank and alpha, the name
  return std::make_shared<LocalSession>(options, options_, bases_);
}

std::shared_ptr<LocalSession> LocalService::create_session_from_state(const std::string& path,
                                                                      const SessionOptions& options) {
  auto s = create_session(options);
  s->load_state(path, true).get();
  return s;
}

std::shared_ptr<LocalSession> LocalService::open_sampler(const std::string& path) {
  const CheckpointMeta meta = read_checkpoint_meta(path);
  auto s = create_session(
      {.base_model = meta.base_model, .lora = meta.lora, .seed = meta.seed, .value_head = meta.value_head});
  s->load_state(path, false).get();
  return s;
}

std::vector<std::string> LocalService::list_base_models() {
  std::vector<std::string> names = builtin_model_names();
  for (const auto& [n, dir] : options_.base_models) names.push_back(n);
  return names;
}

ServerCapabilities LocalService::capabilities() {
  ServerCapabilities c;
  c.base_models = list_base_models();
  c.loss_functions = {"cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "value"};
  c.supports_full_finetune = true;
  c.max_lora_rank = limits::lora_rank_max;
  return c;
}

}  // namespace rlloop
