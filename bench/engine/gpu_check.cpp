// The prepared GPU check (scripts/gpu_bundle.sh packs it; the bundle's run.sh runs it, docs/gpu_check.md): the
// engine on one device and dtype, stage by stage, one JSON line per stage on stdout, so that a machine lent for
// minutes answers every question at once. With --dry-run it runs the same stages on the CPU in bf16 at toy sizes
// (CI runs it that way, so the program cannot rot).
//   gpu_check [--dry-run] [--device D] [--out DIR] [--stage NAME]... [--inject FAULT]
// Every stage can fail: each compares against a reference with a bound docs/gpu_check.md derives, or checks that
// what it measured is well formed. Each runs in its own try, so one stage's exception is that stage's line only.
// --inject plants the fault a stage exists to catch (tests: gpu_check_faults), so that CI sees each stage fail:
//   rope       the device models' RoPE base 1.5 times too large, as a misread rope_theta gives (logits, bf16)
//   skip-save  the checkpoint taken after the step instead of before it (save_load)
//   leak       a tensor kept alive per request (memory)
//   item       an .item() inside the counted steps (sync)
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <ATen/record_function.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <rlloop/local.hpp>

#include "model/builtin_models.hpp"
#include "io/checkpoint.hpp"
#include "kernels/cpu_allocator.hpp"
#include "kernels/device.hpp"
#include "io/model_io.hpp"
#include "runtime/sampler.hpp"

// CMake defines RLLOOP_GPU_CHECK_CUDA when the LibTorch is a CUDA build (bench/engine/CMakeLists.txt): CUDA's own
// allocator statistics and its synchronisation debug mode.
#ifdef RLLOOP_GPU_CHECK_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

using namespace rlloop;
using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

struct Settings {
  bool dry_run = false;
  std::string device = "cuda";
  std::string dtype = "bf16";
  fs::path out = "gpu-check";
  std::string model = "rlloop-100m";  // dry run: rlloop-tiny
  std::string inject;                 // a fault to plant (see the header), or empty
  bool on_cuda() const { return device.rfind("cuda", 0) == 0; }
};

// bf16 keeps 8 significant bits: one rounding moves a value by at most 2^-9 of it (docs/gpu_check.md).
constexpr double kBf16Unit = 1.0 / 512;

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

double max_of(const torch::Tensor& t) { return t.max().item<double>(); }
double mean_of(const torch::Tensor& t) { return t.mean().item<double>(); }

std::vector<Datum> sft_batch(int rows, int tokens, std::int64_t vocab, int salt) {
  std::vector<Datum> out;
  for (int r = 0; r < rows; ++r) {
    std::vector<token_id> ids(static_cast<std::size_t>(tokens)), targets(ids.size());
    for (int t = 0; t < tokens; ++t) {
      ids[t] = static_cast<token_id>((r * 131 + t * 7 + salt) % vocab);
      targets[t] = static_cast<token_id>((r * 131 + (t + 1) * 7 + salt) % vocab);
    }
    Datum d;
    d.model_input = ModelInput::from_tokens(ids);
    d.loss_fn_inputs["target_tokens"] = TensorData::from_tokens(targets);
    d.loss_fn_inputs["weights"] = TensorData::from_floats(std::vector<float>(ids.size(), 1.0f));
    out.push_back(std::move(d));
  }
  return out;
}

LocalServiceOptions service(const Settings& s, const std::string& name) {
  LocalServiceOptions o;
  o.device = s.device;
  o.dtype = s.dtype;
  o.checkpoint_dir = (s.out / name).string();
  return o;
}

std::shared_ptr<LocalSession> lora_session(LocalService& svc, const Settings& s, std::int64_t seed) {
  SessionOptions o;
  o.base_model = s.model;
  o.seed = seed;
  o.lora = LoraOptions{16, 32, {"all-linear"}};
  return svc.create_session(o);
}

SampleRequest sample_request(int rows, int tokens, std::uint64_t seed) {
  SampleRequest req;
  req.prompt = ModelInput::from_tokens(std::vector<token_id>(32, 7));
  req.num_samples = rows;
  req.params.max_tokens = tokens;
  req.params.seed = seed;
  return req;
}

// Whether every sequence has between 1 and max_tokens tokens, each with a finite logprob <= 0.
bool well_formed(const SampleResponse& r, int max_tokens) {
  for (const auto& seq : r.sequences) {
    if (seq.tokens.empty() || static_cast<int>(seq.tokens.size()) > max_tokens) return false;
    if (seq.logprobs.size() != seq.tokens.size()) return false;
    for (const double lp : seq.logprobs)
      if (!std::isfinite(lp) || lp > 1e-6) return false;
  }
  return !r.sequences.empty();
}

// Device memory: what tensors hold now and the most they held since the last reset_peak, in bytes (CUDA's caching
// allocator on a GPU, rlloop's caching CPU allocator, blocks of 1 MiB and more, on the CPU).
void reset_peak([[maybe_unused]] const Settings& s) {
#ifdef RLLOOP_GPU_CHECK_CUDA
  if (s.on_cuda()) return c10::cuda::CUDACachingAllocator::resetPeakStats(c10::cuda::current_device());
#endif
  if (auto* a = engine::installed_caching_cpu_allocator()) a->reset_peak();
}
struct MemoryUse {
  std::int64_t in_use = 0, peak = 0;
  const char* source = "none";
};
MemoryUse memory_use([[maybe_unused]] const Settings& s) {
#ifdef RLLOOP_GPU_CHECK_CUDA
  if (s.on_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(c10::cuda::current_device());
    return {stats.allocated_bytes[0].current, stats.allocated_bytes[0].peak, "cuda_caching_allocator"};
  }
#endif
  if (auto* a = engine::installed_caching_cpu_allocator())
    return {static_cast<std::int64_t>(a->stats().in_use_bytes),
            static_cast<std::int64_t>(a->stats().peak_in_use_bytes), "rlloop_caching_cpu_allocator"};
  return {};
}

// A model whose attention and logits are sharp, as a trained model's are: a random model's q and k are small (its
// attention is almost uniform) and its logits near-uniform, so a wrong rotary position or a stale cache entry moves
// its outputs less than bf16's rounding does. Here q and k are scaled to a root mean square of 1.7 per component
// (attention scores of about 3 nats spread: each head looks at a few positions) and the final norm so that the logits
// spread over about 4 nats, whatever the model's width.
std::shared_ptr<engine::Transformer> sharp_model(engine::ModelConfig cfg, torch::Device device, torch::ScalarType dtype,
                                                 bool perturbed_rope) {
  if (perturbed_rope) cfg.rope_theta *= 1.5;
  engine::TensorMap weights = engine::init_model(cfg, 1, torch::kCPU, torch::kFloat32)->hf_state_dict();
  auto ends_with = [](const std::string& name, const std::string& tail) {
    return name.size() >= tail.size() && name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
  };
  auto rms = [](const torch::Tensor& t) { return t.square().mean().sqrt().item<double>(); };
  // A projection's outputs have a root mean square of rms(W) * sqrt(hidden) on the unit-rms output of a norm.
  const double width = std::sqrt(static_cast<double>(cfg.hidden_size));
  const bool qk_norm = weights.count("model.layers.0.self_attn.q_norm.weight") > 0;
  const auto out = weights.count("lm_head.weight") ? weights.at("lm_head.weight")
                                                   : weights.at("model.embed_tokens.weight");
  for (auto& [name, w] : weights) {
    if (qk_norm && (ends_with(name, "q_norm.weight") || ends_with(name, "k_norm.weight"))) w = w * 1.7;
    if (!qk_norm && (ends_with(name, "q_proj.weight") || ends_with(name, "k_proj.weight")))
      w = w * (1.7 / (rms(w) * width));
    if (name == "model.norm.weight") w = w * (4.0 / (rms(out) * width));
  }
  auto model = engine::init_model(cfg, 1, device, dtype);
  model->load_hf_state_dict(weights);
  return model;
}

torch::Tensor token_batch(std::int64_t vocab, int rows, int tokens) {
  torch::manual_seed(7);
  return torch::randint(0, vocab, {rows, tokens}, torch::kLong);
}

json device_stage(const Settings& s) {
  const auto dev = engine::choose_device(s.device, s.dtype);
  const bool cuda = torch::cuda::is_available();
  return {{"device", engine::device_name(dev.device)}, {"dtype", s.dtype}, {"libtorch", TORCH_VERSION},
          {"cuda_available", cuda}, {"dry_run", s.dry_run}, {"model", s.model},
          {"ok", s.dry_run || (cuda && s.on_cuda())}};
}

// The device's fp32 logits against the CPU's, same weights and tokens. fp32 sums of a few hundred products in
// another order differ by ~1e-6 of the logits' size; 1e-4 of the largest logit leaves room for the GPU's own
// reduction orders and nothing for a wrong position or head.
json logits_stage(const Settings& s) {
  const engine::ModelConfig cfg = *engine::builtin_model(s.model);
  const auto device = engine::choose_device(s.device, "fp32").device;
  const auto ids = token_batch(cfg.vocab_size, 4, 64);
  auto cpu = sharp_model(cfg, torch::kCPU, torch::kFloat32, false);
  auto dev = sharp_model(cfg, device, torch::kFloat32, s.inject == "rope");
  torch::NoGradGuard no_grad;
  const auto l_cpu = cpu->forward(ids);
  const auto l_dev = dev->forward(ids.to(device)).to(torch::kCPU);
  const double diff = max_of((l_dev - l_cpu).abs()), scale = max_of(l_cpu.abs());
  const double bound = 1e-4 * std::max(1.0, scale);
  return {{"max_abs_diff", diff}, {"max_abs_logit", scale}, {"bound", bound}, {"ok", diff <= bound}};
}

// The device's bf16 model against its fp32 one (the same weights rounded). What bf16 may move: every rounding
// changes a value by at most kBf16Unit of it, and a logit's error grows as the square root of the roundings it
// passes through (independent errors), about 4 per layer on the residual path; so the typical logit moves by
// kBf16Unit * sqrt(4 * layers) of the logits' root mean square. The bound is 4 times that, on the mean over
// positions and vocabulary of the absolute logit difference (a wrong rotary position moves it by tens of times more:
// tests gpu_check_faults).
json bf16_stage(const Settings& s) {
  const engine::ModelConfig cfg = *engine::builtin_model(s.model);
  const auto device = engine::choose_device(s.device, "fp32").device;
  const auto ids = token_batch(cfg.vocab_size, 4, 64).to(device);
  auto m32 = sharp_model(cfg, device, torch::kFloat32, false);
  auto m16 = sharp_model(cfg, device, torch::kBFloat16, s.inject == "rope");
  torch::NoGradGuard no_grad;
  const auto l32 = m32->forward(ids).to(torch::kCPU);
  const auto l16 = m16->forward(ids).to(torch::kCPU, torch::kFloat32);
  const double rms = std::sqrt(mean_of(l32.square()));
  const double mean_diff = mean_of((l16 - l32).abs());
  const double bound = 4 * kBf16Unit * std::sqrt(4.0 * static_cast<double>(cfg.num_hidden_layers)) * rms;
  const double argmax_agree = mean_of(l16.argmax(-1).eq(l32.argmax(-1)).to(torch::kFloat64));
  const double lp_diff = mean_of((torch::log_softmax(l16, -1) - torch::log_softmax(l32, -1)).abs());
  return {{"mean_abs_logit_diff", mean_diff}, {"rms_logit", rms}, {"bound", bound},
          {"mean_abs_logprob_diff", lp_diff}, {"argmax_agreement", argmax_agree}, {"ok", mean_diff <= bound}};
}

// A session trains (the loss falls, one step at lr 1e-5 moves more than half its trained values, fp32 masters of
// bf16 weights included) and its sampled logprobs are the ones compute_logprobs gives the same tokens. The two paths
// (KV-cached steps, one forward) round differently: in fp32 by ~1e-6; in bf16 each logprob by up to
// 8 * kBf16Unit of its size plus the same of the logits' spread, hence the bound below.
json session_stage(const Settings& s, bool lora) {
  LocalService svc(service(s, lora ? "session_lora" : "session_full"));
  SessionOptions o;
  o.base_model = s.model;
  o.seed = 3;
  if (lora) o.lora = LoraOptions{16, 32, {"all-linear"}};
  auto session = svc.create_session(o);
  const std::int64_t vocab = session->info().vocab_size;
  const auto batch = sft_batch(8, s.dry_run ? 32 : 256, vocab, 1);
  std::vector<double> losses;
  const double lr = lora ? 1e-3 : 1e-4;
  for (int step = 0; step < 8; ++step) {
    losses.push_back(session->forward_backward(batch, LossSpec::cross_entropy()).get().metrics.at("loss:sum"));
    session->optim_step(AdamParams{.learning_rate = lr}).get();
  }
  const auto before = engine::read_state_dir(session->save_state("before").get().path, true);
  session->forward_backward(batch, LossSpec::cross_entropy()).get();
  session->optim_step(AdamParams{.learning_rate = 1e-5}).get();
  const auto after = engine::read_state_dir(session->save_state("after").get().path, true);
  std::int64_t moved = 0, total = 0;
  for (const auto& [weight, w] : after.weights) {
    const auto master = after.optimizer.find(weight + ".master");
    const torch::Tensor now = master != after.optimizer.end() ? master->second : w.to(torch::kFloat32);
    const auto was = before.optimizer.count(weight + ".master") ? before.optimizer.at(weight + ".master")
                                                                 : before.weights.at(weight).to(torch::kFloat32);
    moved += now.ne(was).sum().item<std::int64_t>();
    total += now.numel();
  }
  SampleRequest req = sample_request(4, 16, 5);
  req.prompt = ModelInput::from_tokens({1, 2, 3, 4, 5, 6, 7, 8});
  const auto sampled = session->sample(req).get();
  double worst = 0;
  for (const auto& seq : sampled.sequences) {
    std::vector<token_id> all{1, 2, 3, 4, 5, 6, 7, 8};
    all.insert(all.end(), seq.tokens.begin(), seq.tokens.end());
    const auto lp = session->compute_logprobs({ModelInput::from_tokens(all), std::nullopt}).get();
    for (std::size_t j = 0; j < seq.logprobs.size(); ++j)
      worst = std::max(worst, std::abs(seq.logprobs[j] - lp[8 + j]) / (1.0 + std::abs(lp[8 + j])));
  }
  const double bound = s.dtype == "bf16" ? 8 * kBf16Unit : 1e-4;
  const double moved_fraction = static_cast<double>(moved) / static_cast<double>(std::max<std::int64_t>(total, 1));
  return {{"losses", losses}, {"moved_fraction_at_lr_1e-5", moved_fraction},
          {"max_sampled_vs_computed_relative_diff", worst}, {"bound", bound},
          {"ok", losses.back() < losses.front() && moved_fraction > 0.5 && worst <= bound && well_formed(sampled, 16)}};
}

// save_state -> one step -> load_state restores the loss before the step exactly, and the same step after the load
// gives the same loss as the first time (weights, both Adam moments and the step count all came back).
json save_load_stage(const Settings& s) {
  LocalService svc(service(s, "save_load"));
  auto session = lora_session(svc, s, 4);
  const auto batch = sft_batch(4, s.dry_run ? 32 : 256, session->info().vocab_size, 2);
  auto loss = [&] { return session->forward(batch, LossSpec::cross_entropy()).get().metrics.at("loss:sum"); };
  auto step = [&] {
    session->forward_backward(batch, LossSpec::cross_entropy()).get();
    session->optim_step(AdamParams{.learning_rate = 1e-3}).get();
  };
  step();
  step();
  std::string path;
  if (s.inject != "skip-save") path = session->save_state("pre-step").get().path;
  const double before = loss();
  step();
  const double stepped = loss();
  if (s.inject == "skip-save") path = session->save_state("pre-step").get().path;  // the save that came too late
  session->load_state(path, true).get();
  const double restored = loss();
  step();
  const double stepped_again = loss();
  auto same = [](double a, double b) { return std::abs(a - b) <= 1e-6 * std::abs(b); };
  return {{"loss_before_step", before}, {"loss_after_step", stepped}, {"loss_after_load", restored},
          {"loss_after_step_again", stepped_again},
          {"ok", !same(stepped, before) && same(restored, before) && same(stepped_again, stepped)}};
}

// The memory tensors hold is the same after 50 more sampling requests as before them (after warm-ups that fill
// the caches a session keeps): nothing a request allocates outlives it.
json memory_stage(const Settings& s) {
  LocalService svc(service(s, "memory"));
  auto session = lora_session(svc, s, 5);
  const torch::Device device = engine::choose_device(s.device, s.dtype).device;
  static std::vector<torch::Tensor> leaked;  // --inject leak: what a leaking request would keep
  auto request = [&](int i) {
    const auto out = session->sample(sample_request(4, 8, static_cast<std::uint64_t>(i))).get();
    if (s.inject == "leak") leaked.push_back(torch::empty({1 << 18}, torch::TensorOptions(device)));
    return well_formed(out, 8);
  };
  bool formed = true;
  for (int i = 0; i < 5; ++i) formed = request(i) && formed;
  const MemoryUse start = memory_use(s);
  for (int i = 0; i < 50; ++i) formed = request(100 + i) && formed;
  const MemoryUse end = memory_use(s);
  return {{"requests", 50}, {"in_use_bytes_before", start.in_use}, {"in_use_bytes_after", end.in_use},
          {"source", start.source},
          {"ok", formed && end.in_use == start.in_use && std::string(start.source) != "none"}};
}

// Counts, while it exists, the ATen calls that make a CUDA host wait for the device: .item() and the operators
// whose output size depends on data, and copies from a device to the host outside engine::to_host (the one
// sanctioned copy of a decode step: its sampled tokens). On the CPU no copy crosses a device, so there it sees
// the operators only; tests/engine_model/host_sync_test.cpp holds the finer count per operator.
class SyncCounter {
 public:
  SyncCounter() {
    counts().clear();
    at::enableRecordFunction(true);
    handle_ = at::addGlobalCallback(at::RecordFunctionCallback(&SyncCounter::on_enter, &SyncCounter::on_exit)
                                        .needsInputs(true)
                                        .scopes({at::RecordScope::FUNCTION, at::RecordScope::USER_SCOPE}));
  }
  ~SyncCounter() { at::removeCallback(handle_); }
  SyncCounter(const SyncCounter&) = delete;
  SyncCounter& operator=(const SyncCounter&) = delete;

  // The syncs seen since the last take(), by name ("copy_to_host" for a copy outside to_host).
  static std::map<std::string, int> take() {
    std::lock_guard lock(mutex_);
    return std::exchange(counts(), {});
  }
  // Whether the calling thread is inside an engine::to_host.
  static bool in_to_host() { return to_host_depth_ > 0; }

 private:
  static std::map<std::string, int>& counts() {
    static std::map<std::string, int> c;
    return c;
  }
  static std::unique_ptr<at::ObserverContext> on_enter(const at::RecordFunction& fn) {
    static const std::set<std::string> syncing = {
        "aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::masked_select", "aten::_unique",
        "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive", "aten::is_nonzero", "aten::equal",
        "aten::bincount"};
    const std::string name = fn.name();
    if (fn.scope() == at::RecordScope::USER_SCOPE) {
      if (name == engine::kToHostScope) ++to_host_depth_;
      return nullptr;
    }
    std::lock_guard lock(mutex_);
    if (to_host_depth_ == 0 && syncing.count(name)) ++counts()[name];
    const auto inputs = fn.inputs();
    if (to_host_depth_ == 0 && name == "aten::copy_" && inputs.size() >= 2 && inputs[0].isTensor() &&
        inputs[1].isTensor() && inputs[0].toTensor().device().is_cpu() && !inputs[1].toTensor().device().is_cpu())
      ++counts()["copy_to_host"];
    return nullptr;
  }
  static void on_exit(const at::RecordFunction& fn, at::ObserverContext*) {
    if (fn.scope() == at::RecordScope::USER_SCOPE && std::string(fn.name()) == engine::kToHostScope) --to_host_depth_;
  }

  at::CallbackHandle handle_;
  static inline thread_local int to_host_depth_ = 0;
  static inline std::mutex mutex_;
};

#ifdef RLLOOP_GPU_CHECK_CUDA
// CUDA's synchronisation debug mode (torch.cuda.set_sync_debug_mode) at "warn" while it exists, its warnings
// counted instead of printed: each is a host wait LibTorch's CUDA code saw, whatever operator caused it. Those
// inside engine::to_host (the decode step's one copy back) are allowed and not counted.
class CudaSyncWarnings : public c10::WarningHandler {
 public:
  CudaSyncWarnings() : guard_(this) {
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_WARN);
  }
  ~CudaSyncWarnings() override {
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
  }
  void process(const c10::Warning& w) override {
    if (!SyncCounter::in_to_host()) {
      ++outside_to_host;
      if (first.empty()) first = w.msg();
    }
  }
  int outside_to_host = 0;
  std::string first;

 private:
  c10::WarningUtils::WarningHandlerGuard guard_;
};
#endif

// Decode steps, a chunked prefill and training steps on the device, dense and with routed experts: no host wait
// but each decode step's one copy of its sampled tokens (RecordFunction's count on any device; on CUDA also
// CUDA's own synchronisation debug mode).
json sync_stage(const Settings& s) {
  const auto dev = engine::choose_device(s.device, s.dtype);
  json models = json::object();
  bool ok = true;
  for (const std::string& name : {s.model, std::string("rlloop-tiny-moe")}) {
    auto model = engine::init_model(*engine::builtin_model(name), 5, dev.device, dev.dtype);
    const auto long_options = torch::TensorOptions(dev.device).dtype(torch::kLong);
    SampleRequest req = sample_request(4, 12, 11);
    req.params.temperature = 1.0;
    std::map<std::string, std::map<std::string, int>> seen;
    int cuda_waits = 0;
    std::string cuda_first;
    {
      SyncCounter counter;
#ifdef RLLOOP_GPU_CHECK_CUDA
      std::optional<CudaSyncWarnings> cuda;
      if (s.on_cuda()) cuda.emplace();
#endif
      {
        // Decoding: past the first two steps (the prefill and one-time set-up), five steps.
        c10::InferenceMode inference;
        engine::DecodeRun run(*model, req, nullptr, engine::SampleStream(11), engine::DecodePrecision::fp32, nullptr);
        engine::DecodeRun* const runs[] = {&run};
        engine::decode_step(runs);
        engine::decode_step(runs);
        SyncCounter::take();
        for (int i = 0; i < 5; ++i) engine::decode_step(runs);
        seen["decode"] = SyncCounter::take();
        // A prompt prefilled into a cache in two chunks (the second attends over the first's cache).
        engine::KVCache cache(model->kv_pools(), dev.dtype, 1, 64);
        model->hidden_states(torch::full({1, 24}, 3, long_options), &cache);
        model->hidden_states(torch::full({1, 24}, 5, long_options), &cache);
        seen["prefill"] = SyncCounter::take();
      }
      // Training: forward, the targets' logprobs, backward.
      const auto ids = torch::randint(0, 200, {2, 32}, long_options);
      const auto logits = model->forward(ids.slice(1, 0, 31));
      const auto lp = torch::log_softmax(logits.to(torch::kFloat32), -1).gather(-1, ids.slice(1, 1).unsqueeze(-1));
      if (s.inject == "item") {
        const volatile double planted = lp.sum().item<double>();
        (void)planted;
      }
      (-lp.sum()).backward();
      seen["train"] = SyncCounter::take();
#ifdef RLLOOP_GPU_CHECK_CUDA
      if (cuda) cuda_waits = cuda->outside_to_host, cuda_first = cuda->first;
#endif
    }
    json line = json::object();
    for (const auto& [what, counts] : seen) {
      line[what] = counts;
      ok = ok && counts.empty();
    }
    if (s.on_cuda()) line["cuda_sync_warnings"] = {{"outside_to_host", cuda_waits}, {"first", cuda_first}};
    ok = ok && cuda_waits == 0;
    models[name] = line;
  }
  return {{"syncs_outside_to_host", models}, {"ok", ok}};
}

// Sampling throughput: one request of `rows` samples.
json decode_stage(const Settings& s) {
  LocalService svc(service(s, "decode"));
  SessionOptions o;
  o.base_model = s.model;
  auto session = svc.create_session(o);
  json rates;
  const int new_tokens = s.dry_run ? 8 : 128;
  bool formed = true;
  for (const int rows : {1, 8, 64}) {
    const SampleRequest req = sample_request(rows, new_tokens, 1);
    session->sample(req).get();  // warm-up
    const auto t = std::chrono::steady_clock::now();
    const auto out = session->sample(req).get();
    std::int64_t tokens = 0;
    for (const auto& seq : out.sequences) tokens += static_cast<std::int64_t>(seq.tokens.size());
    rates[std::to_string(rows)] = static_cast<double>(tokens) / seconds_since(t);
    formed = formed && well_formed(out, new_tokens) && static_cast<int>(out.sequences.size()) == rows;
  }
  // The same weights in Hugging Face's layout, for the hf_generate stage (the bundle's run.sh runs
  // hf_generate.py on them: transformers' generate at 64 rows, against the decode figures above).
  const std::string hf_dir = (s.out / "decode-hf").string();
  session->export_merged_model(hf_dir).get();
  return {{"tokens_per_s_by_rows", rates}, {"new_tokens", new_tokens}, {"hf_model", hf_dir},
          {"ok", formed && fs::exists(fs::path(hf_dir) / "config.json")}};
}

// 16 LoRA sessions on one base sampling at once (the requests of every session decode in one step:
// Transformer::decode_step), against one of them asking for the same rows in one request, in the same run (issue 26:
// the ratio should reach 0.75). Each session's samples are the ones it gets alone, token for token in fp32 (the
// draws depend on a request's own stream only); in bf16 the logits round differently in another batch, so there
// at least 3 in 4 sequences must match.
json tenants_stage(const Settings& s) {
  LocalService svc(service(s, "tenants"));
  const int sessions = s.dry_run ? 2 : 16, new_tokens = s.dry_run ? 8 : 128, samples = 4;
  std::vector<std::shared_ptr<LocalSession>> all;
  for (int i = 0; i < sessions; ++i) all.push_back(lora_session(svc, s, i));
  using Requests = std::vector<std::pair<std::shared_ptr<LocalSession>, SampleRequest>>;
  auto run = [&](const Requests& requests, std::vector<SampleResponse>* out) {
    const auto t = std::chrono::steady_clock::now();
    std::vector<Future<SampleResponse>> pending;
    for (const auto& [session, req] : requests) pending.push_back(session->sample(req));
    std::int64_t tokens = 0;
    for (auto& f : pending) {
      SampleResponse r = f.get();
      for (const auto& seq : r.sequences) tokens += static_cast<std::int64_t>(seq.tokens.size());
      if (out) out->push_back(std::move(r));
    }
    return static_cast<double>(tokens) / seconds_since(t);
  };
  Requests warm, each, one;
  for (auto& session : all) {
    warm.emplace_back(session, sample_request(samples, 2, 1));  // loads every session's model and the kernels
    each.emplace_back(session, sample_request(samples, new_tokens, 1));
  }
  one.emplace_back(all.front(), sample_request(samples * sessions, new_tokens, 1));
  run(warm, nullptr);
  std::vector<SampleResponse> together_out, alone_out;
  const double together = run(each, &together_out), alone = run(one, nullptr);
  run({each.back()}, &alone_out);  // the last session alone: the same request as in the batch
  std::size_t same = 0, formed = 0;
  const auto& batched = together_out.back().sequences;
  for (std::size_t i = 0; i < batched.size(); ++i) same += batched[i].tokens == alone_out[0].sequences[i].tokens;
  for (const auto& r : together_out) formed += well_formed(r, new_tokens);
  const double need = s.dtype == "bf16" ? 0.75 : 1.0;
  return {{"sessions", sessions}, {"samples_each", samples}, {"new_tokens", new_tokens}, {"tokens_per_s", together},
          {"one_request_tokens_per_s", alone}, {"ratio", together / alone},
          {"same_as_alone", same}, {"of", batched.size()},
          {"ok", formed == together_out.size() &&
                     static_cast<double>(same) >= need * static_cast<double>(batched.size())}};
}

// 8 LoRA sessions each asking for 2 x 16 tokens after a long prompt of its own (1,024 tokens), at once: the prompts
// prefill as rows of the decoding steps, 512 tokens per step (chunked prefill, the default), against the same with
// every prompt whole in one step. Prompt and new tokens per second, and whether both gave the same greedy tokens
// (bf16 may move a near-tie: at least 3 in 4 must match).
json prefill_stage(const Settings& s) {
  const int sessions = 8, prompt = s.dry_run ? 48 : 1024, new_tokens = 16;
  const std::int64_t chunk = s.dry_run ? 16 : 512;
  auto run = [&](const std::string& name, std::int64_t chunk_tokens, std::vector<std::vector<token_id>>& tokens) {
    LocalServiceOptions options = service(s, name);
    options.prefill_chunk_tokens = chunk_tokens;
    LocalService svc(options);
    std::vector<std::shared_ptr<LocalSession>> all;
    for (int i = 0; i < sessions; ++i) all.push_back(lora_session(svc, s, i));
    auto request = [&](int i, int length, int max_tokens) {
      SampleRequest req;
      std::vector<token_id> ids(static_cast<std::size_t>(length));
      for (int t = 0; t < length; ++t) ids[t] = static_cast<token_id>(1 + (i * 37 + t * 11) % 200);
      req.prompt = ModelInput::from_tokens(ids);
      req.num_samples = 2;
      req.params.max_tokens = max_tokens;
      req.params.temperature = 0.0;
      return req;
    };
    for (int i = 0; i < sessions; ++i) all[i]->sample(request(i, 8, 2)).get();  // loads the models and kernels
    const auto t = std::chrono::steady_clock::now();
    std::vector<Future<SampleResponse>> pending;
    for (int i = 0; i < sessions; ++i) pending.push_back(all[i]->sample(request(i, prompt, new_tokens)));
    std::int64_t processed = 0;
    tokens.clear();
    for (auto& f : pending)
      for (const auto& seq : f.get().sequences) {
        processed += prompt + static_cast<std::int64_t>(seq.tokens.size());
        tokens.push_back(seq.tokens);
      }
    return static_cast<double>(processed) / seconds_since(t);
  };
  std::vector<std::vector<token_id>> chunked_tokens, whole_tokens;
  const double chunked = run("prefill-chunked", chunk, chunked_tokens);
  const double whole = run("prefill-whole", static_cast<std::int64_t>(sessions) * prompt, whole_tokens);
  std::size_t same = 0;
  for (std::size_t i = 0; i < chunked_tokens.size(); ++i) same += chunked_tokens[i] == whole_tokens[i] ? 1 : 0;
  const double need = s.dtype == "bf16" ? 0.75 : 1.0;
  return {{"sessions", sessions}, {"prompt_tokens", prompt}, {"chunk_tokens", chunk},
          {"tokens_per_s_chunked", chunked}, {"tokens_per_s_whole", whole}, {"ratio", chunked / whole},
          {"same_greedy_sequences", same}, {"sequences", chunked_tokens.size()},
          {"ok", chunked_tokens.size() == 2u * sessions &&
                     static_cast<double>(same) >= need * static_cast<double>(chunked_tokens.size())}};
}

// LoRA r16 training throughput, MFU and peak memory at two lengths; ok when the figures are real (a finite loss,
// an MFU in (0, 1], on a GPU a peak from CUDA's own allocator).
json train_stage(const Settings& s) {
  LocalService svc(service(s, "train"));
  auto session = lora_session(svc, s, 0);
  const std::int64_t vocab = session->info().vocab_size;
  json cases = json::array();
  bool ok = true;
  for (const int tokens : s.dry_run ? std::vector<int>{32, 64} : std::vector<int>{1024, 2048}) {
    const auto batch = sft_batch(8, tokens, vocab, 2);
    session->forward_backward(batch, LossSpec::cross_entropy()).get();  // warm-up
    reset_peak(s);
    const auto t = std::chrono::steady_clock::now();
    const auto out = session->forward_backward(batch, LossSpec::cross_entropy()).get();
    const double secs = seconds_since(t);
    session->optim_step(AdamParams{.learning_rate = 1e-4}).get();
    const double mfu = out.metrics.count("mfu") ? out.metrics.at("mfu") : 0.0;
    const MemoryUse mem = memory_use(s);
    const double loss = out.metrics.at("loss:sum");
    cases.push_back({{"rows", 8}, {"tokens", tokens}, {"tokens_per_s", 8.0 * tokens / secs}, {"mfu", mfu},
                     {"loss", loss}, {"peak_mib", static_cast<double>(mem.peak) / (1 << 20)},
                     {"memory_source", mem.source}});
    // The CPU's caching allocator sees blocks of 1 MiB and more only: a toy model's dry run may have none.
    ok = ok && std::isfinite(loss) && mfu > 0 && mfu <= 1 && (mem.peak > 0 || !s.on_cuda());
  }
  return {{"cases", cases}, {"ok", ok}};
}

using Stage = std::function<json(const Settings&)>;
const std::vector<std::pair<std::string, Stage>>& stages() {
  static const std::vector<std::pair<std::string, Stage>> all = {
      {"device", device_stage},
      {"logits", logits_stage},
      {"bf16", bf16_stage},
      {"session_lora", [](const Settings& s) { return session_stage(s, true); }},
      {"session_full", [](const Settings& s) { return session_stage(s, false); }},
      {"save_load", save_load_stage},
      {"memory", memory_stage},
      {"sync", sync_stage},
      {"decode", decode_stage},
      {"tenants", tenants_stage},
      {"prefill", prefill_stage},
      {"train", train_stage},
  };
  return all;
}

// Runs one stage and prints its line: its figures and "ok", or its error.
bool run_stage(const std::string& name, const Stage& stage, const Settings& s) {
  json line;
  const auto t = std::chrono::steady_clock::now();
  try {
    line = stage(s);
  } catch (const std::exception& e) {
    line = {{"error", e.what()}, {"ok", false}};
  }
  line["stage"] = name;
  line["seconds"] = seconds_since(t);
  if (!s.inject.empty()) line["inject"] = s.inject;
  std::printf("%s\n", line.dump().c_str());
  std::fflush(stdout);
  return line.value("ok", false);
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  std::vector<std::string> only;
  const std::set<std::string> faults = {"rope", "skip-save", "leak", "item"};
  auto usage = [] {
    std::fprintf(stderr, "usage: gpu_check [--dry-run] [--device D] [--out DIR] [--stage NAME]... "
                         "[--inject rope|skip-save|leak|item] | --list\n");
    return 2;
  };
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--dry-run") {
      s.dry_run = true;
    } else if (a == "--device" && i + 1 < argc) {
      s.device = argv[++i];
    } else if (a == "--out" && i + 1 < argc) {
      s.out = argv[++i];
    } else if (a == "--stage" && i + 1 < argc) {
      only.emplace_back(argv[++i]);
    } else if (a == "--inject" && i + 1 < argc && faults.count(argv[i + 1])) {
      s.inject = argv[++i];
    } else if (a == "--list") {
      for (const auto& [name, stage] : stages()) std::printf("%s\n", name.c_str());
      return 0;
    } else {
      return usage();
    }
  }
  for (const auto& name : only) {
    bool known = false;
    for (const auto& [n, stage] : stages()) known = known || n == name;
    if (!known) {
      std::fprintf(stderr, "gpu_check: unknown stage '%s' (gpu_check --list names them)\n", name.c_str());
      return 2;
    }
  }
  if (s.dry_run) {
    s.device = "cpu";
    s.model = "rlloop-tiny";
  }
  configure_engine_process({});
  fs::create_directories(s.out);
  bool all_ok = true;
  for (const auto& [name, stage] : stages())
    if (only.empty() || std::find(only.begin(), only.end(), name) != only.end())
      all_ok = run_stage(name, stage, s) && all_ok;
  return all_ok ? 0 : 1;
}
