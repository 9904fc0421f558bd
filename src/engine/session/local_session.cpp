// LocalSession: adapters over a shared base model (or a private full model), operations run in submission order
// by the base model's engine loop. The session checks, bills and keeps state alike in every parallel mode
// (SessionCore); how an operation's tensors meet the ranks is its executor's (executor.hpp).
#include <rlloop/local.hpp>

#include <chrono>
#include <filesystem>
#include <mutex>

#include <rlloop/limits.hpp>

#include "dist/coordinator.hpp"
#include "dist/replica_ops.hpp"
#include "io/checkpoint.hpp"
#include "io/gguf_export.hpp"
#include "io/gguf_model.hpp"
#include "io/model_io.hpp"
#include "model/builtin_models.hpp"
#include "runtime/pass_metrics.hpp"
#include "session/executor.hpp"
#include "session/session_core.hpp"

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

struct LocalSession::Impl : SessionCore {
  using SessionCore::SessionCore;

  ForwardBackwardOutput run_loss(const std::vector<Datum>& data, const LossSpec& loss, bool backward) {
    const auto started = std::chrono::steady_clock::now();
    gradients_pending = gradients_pending || backward;  // before: a pass that fails midway may have added some
    auto out = executor->forward(data, loss, backward);
    if (backward) optimizer->absorb_gradients();  // bf16 parameters: into their fp32 sums before the next pass
    add_usage({0, 0, out.training_tokens});
    add_service_metrics(out, data, &loss, model->config(), backward, cost_since(started));
    if (backward) add_grad_norm(out);
    return out;
  }

  ForwardBackwardOutput run_custom(const std::vector<Datum>& data, const CustomLossFn& fn) {
    const auto started = std::chrono::steady_clock::now();
    gradients_pending = true;
    auto out = executor->forward_custom(data, fn);
    optimizer->absorb_gradients();
    add_usage({0, 0, out.training_tokens});
    add_service_metrics(out, data, nullptr, model->config(), /*backward=*/true, cost_since(started));
    add_grad_norm(out);
    return out;
  }

  // actor/grad_norm: the norm of the gradient accumulated since the last step, this pass included (what the next
  // optim_step reports as grad_norm before clipping), which the SageMaker SDK takes from a split batch's last
  // chunk. Where each rank holds only its share until the step sums them (data parallelism), it is left out.
  void add_grad_norm(ForwardBackwardOutput& out) const {
    if (executor->holds_whole_gradient() && optimizer) out.metrics["actor/grad_norm"] = optimizer->grad_norm();
  }

  // The pass that began at `started`, against the peak of every rank's device.
  PassCost cost_since(std::chrono::steady_clock::time_point started) const {
    PassCost cost;
    cost.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    cost.peak_flops = peak_flops(dev.device, dev.dtype) * executor->ranks();
    cost.base_frozen = options.lora.has_value();
    return cost;
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
    executor->collect_gradients();
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
    dist::NamedState state{.weights = trainable_weights()};
    if (with_optimizer) {
      for (auto& [k, v] : optimizer->state_tensors()) state.optimizer[k] = v;
      state.gradients = pending_gradients();
    }
    // What other ranks hold (an expert-parallel model's other experts): the checkpoint holds the whole model.
    executor->gather_state(state, with_optimizer, with_optimizer && gradients_pending);
    write_state_dir(dir, state.weights, with_optimizer ? &state.optimizer : nullptr, meta(),
                    state.gradients.empty() ? nullptr : &state.gradients);
    const std::string path = fs::absolute(dir).lexically_normal().string();
    // A model loaded from this path before holds the old weights; the next use reloads.
    if (auto it = samplers.find(path); it != samplers.end()) drop_sampler(it);
    return {path};
  }

  void restore_generator(const CheckpointMeta& m) {
    auto rng = m.rng_state;
    auto t = torch::from_blob(rng.data(), {static_cast<std::int64_t>(rng.size())}, torch::kUInt8).clone();
    generator.set_state(t);
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
    // A fully sharded session's ranks each load their part of every tensor (gradients included) themselves.
    if (executor->load_parts(state, with_optimizer)) {
      if (with_optimizer) restore_generator(m);
      gradients_pending = with_optimizer && !state.gradients.empty();
      return;
    }
    load_trainable(*model, state.weights);
    if (with_optimizer) {
      optimizer->load_state_tensors(state.optimizer, m.step);
      restore_generator(m);
    } else {
      // Weights only: moments and gradients of the old weights mean nothing for the new ones; start fresh.
      optimizer->zero_grad();
      build_optimizer();
    }
    optimizer->zero_grad();
    gradients_pending = false;
    executor->distribute_state(state, with_optimizer);
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
  impl_->executor->close();
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
    OptimStepOutput out{impl_->executor->optim_step(params)};
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

// How the samples are shared out over the ranks is the executor's (executor.hpp); the checks and billing are
// SessionCore's.
Future<SampleResponse> LocalSession::sample(const SampleRequest& request, SampleProgress on_step) {
  return impl_->executor->sample(request, std::move(on_step));
}

Future<std::vector<double>> LocalSession::compute_logprobs(const ComputeLogprobsRequest& request) {
  return impl_->executor->compute_logprobs(request);
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
        impl_->executor->count_other_ranks(i);
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
    impl_->executor->require_whole_model("export_merged_model");
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
    impl_->executor->require_whole_model("export_gguf_model");
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

DataParallelStats LocalService::data_parallel_stats() const { return data_parallel_stats_of(*bases_); }

std::string LocalService::data_parallel_failure() const { return data_parallel_failure_of(*bases_); }

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
  for (const LossInfo& row : kLosses) c.loss_functions.emplace_back(row.name);
  c.supports_full_finetune = true;
  c.max_lora_rank = limits::lora_rank_max;
  return c;
}

}  // namespace rlloop
