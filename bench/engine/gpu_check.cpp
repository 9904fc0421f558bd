// The prepared GPU check (scripts/gpu_check.sh): the engine on one device and dtype, stage by stage, one JSON line
// per stage on stdout, so that a machine lent for minutes answers every question at once. With --dry-run it runs
// the same stages on the CPU in bf16 at toy sizes (CI runs it that way, so the program cannot rot).
//   gpu_check [--dry-run] [--device D] [--out DIR]
// Stages (docs/gpu_check.md says what each line holds and what "ok" requires):
//   device         the device, dtype, LibTorch version, whether CUDA is available
//   logits         the model's fp32 logits on the device against the CPU's (same seed, same tokens)
//   bf16           the device's bf16 logits and target logprobs against its fp32 ones
//   session_lora   a LoRA session: losses over SFT steps, the adapters changed, sampled vs computed logprobs, a
//   session_full   full fine-tuning: the same, with one step at lr 1e-5 moving the fp32 masters
//                  save/load round trip giving the same loss
//   decode         sampling tokens/s at 1, 8 and 64 rows (one request of that many samples)
//   tenants        16 LoRA sessions sampling at once: tokens/s in all
//   train          LoRA r16 forward_backward tokens/s, MFU and peak memory at 8 x 1024 and 8 x 2048 tokens
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <rlloop/local.hpp>

#include "checkpoint.hpp"
#include "cpu_allocator.hpp"
#include "device.hpp"
#include "model_io.hpp"
#include "builtin_models.hpp"

#if __has_include(<c10/cuda/CUDACachingAllocator.h>) && defined(USE_CUDA)
#include <c10/cuda/CUDACachingAllocator.h>
#define RLLOOP_GPU_CHECK_CUDA_STATS 1
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
};

bool all_ok = true;  // every stage's "ok" so far

void emit(json line) {
  all_ok = all_ok && line.value("ok", false);
  std::printf("%s\n", line.dump().c_str());
  std::fflush(stdout);
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

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

// Peak device memory since the last reset, in MiB (the caching CPU allocator's on the CPU).
void reset_peak([[maybe_unused]] const Settings& s) {
#ifdef RLLOOP_GPU_CHECK_CUDA_STATS
  if (s.device != "cpu") return c10::cuda::CUDACachingAllocator::resetPeakStats(0);
#endif
  if (auto* a = engine::installed_caching_cpu_allocator()) a->reset_peak();
}
double peak_mib([[maybe_unused]] const Settings& s) {
#ifdef RLLOOP_GPU_CHECK_CUDA_STATS
  if (s.device != "cpu") {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(0);
    return static_cast<double>(stats.allocated_bytes[0].peak) / (1 << 20);
  }
#endif
  if (auto* a = engine::installed_caching_cpu_allocator())
    return static_cast<double>(a->stats().peak_in_use_bytes) / (1 << 20);
  return 0;
}

}  // namespace

namespace {

// The model's fp32 logits on the device against the CPU's, and the device's bf16 against its fp32.
void logits_stages(const Settings& s) {
  const engine::ModelConfig cfg = *engine::builtin_model(s.model);
  const auto device = engine::choose_device(s.device, "fp32").device;
  const auto ids = torch::randint(0, cfg.vocab_size, {4, 64}, torch::kLong);
  auto cpu = engine::init_model(cfg, 1, torch::kCPU, torch::kFloat32);
  auto dev32 = engine::init_model(cfg, 1, device, torch::kFloat32);
  auto dev16 = engine::init_model(cfg, 1, device, torch::kBFloat16);
  torch::NoGradGuard no_grad;
  const auto l_cpu = cpu->forward(ids);
  const auto l32 = dev32->forward(ids.to(device)).to(torch::kCPU);
  const auto l16 = dev16->forward(ids.to(device)).to(torch::kCPU, torch::kFloat32);
  const double fp32_diff = (l32 - l_cpu).abs().max().item<double>();
  emit({{"stage", "logits"}, {"max_abs_diff", fp32_diff}, {"max_abs_logit", l_cpu.abs().max().item<double>()},
        {"ok", fp32_diff < 1e-3}});
  const auto lp32 = torch::log_softmax(l32, -1), lp16 = torch::log_softmax(l16, -1);
  const double logit_diff = (l16 - l32).abs().max().item<double>();
  const double lp_diff = (lp16 - lp32).abs().mean().item<double>();
  // bf16 keeps 8 significant bits: logits of magnitude ~10 move by ~0.05 per rounding, a few roundings deep.
  emit({{"stage", "bf16"}, {"max_abs_logit_diff", logit_diff}, {"mean_abs_logprob_diff", lp_diff},
        {"ok", lp_diff < 0.1}});
}

// One session: SFT steps, what one step at lr 1e-5 moved, sampled vs computed logprobs, a save/load round trip.
void session_stage(const Settings& s, bool lora) {
  const std::string name = lora ? "session_lora" : "session_full";
  LocalService svc(service(s, name));
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
  // One step at lr 1e-5: the trained weights (the fp32 masters of bf16 ones) all move.
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
  // Sampled logprobs against compute_logprobs of the same tokens.
  SampleRequest req;
  req.prompt = ModelInput::from_tokens({1, 2, 3, 4, 5, 6, 7, 8});
  req.num_samples = 4;
  req.params.max_tokens = 16;
  req.params.seed = 5;
  const auto sampled = session->sample(req).get();
  double worst = 0;
  for (const auto& seq : sampled.sequences) {
    std::vector<token_id> all{1, 2, 3, 4, 5, 6, 7, 8};
    all.insert(all.end(), seq.tokens.begin(), seq.tokens.end());
    const auto lp = session->compute_logprobs({ModelInput::from_tokens(all), std::nullopt}).get();
    for (std::size_t j = 0; j < seq.logprobs.size(); ++j)
      worst = std::max(worst, std::abs(seq.logprobs[j] - lp[8 + j]));
  }
  // Save and load: the same loss after as before.
  const auto loss_before = session->forward(batch, LossSpec::cross_entropy()).get().metrics.at("loss:sum");
  session->load_state(session->save_state("roundtrip").get().path, true).get();
  const auto loss_after = session->forward(batch, LossSpec::cross_entropy()).get().metrics.at("loss:sum");
  const bool falls = losses.back() < losses.front();
  const double moved_fraction = static_cast<double>(moved) / static_cast<double>(std::max<std::int64_t>(total, 1));
  emit({{"stage", name}, {"losses", losses}, {"moved_fraction_at_lr_1e-5", moved_fraction},
        {"max_sampled_vs_computed_logprob_diff", worst}, {"loss_before_save", loss_before},
        {"loss_after_load", loss_after},
        {"ok", falls && moved_fraction > 0.5 && worst < 0.2 &&
                   std::abs(loss_after - loss_before) <= 1e-6 * std::abs(loss_before)}});
}

// Sampling throughput: one request of `rows` samples.
void decode_stage(const Settings& s) {
  LocalService svc(service(s, "decode"));
  SessionOptions o;
  o.base_model = s.model;
  auto session = svc.create_session(o);
  json rates;
  const int new_tokens = s.dry_run ? 8 : 128;
  for (const int rows : {1, 8, 64}) {
    SampleRequest req;
    req.prompt = ModelInput::from_tokens(std::vector<token_id>(32, 7));
    req.num_samples = rows;
    req.params.max_tokens = new_tokens;
    req.params.seed = 1;
    session->sample(req).get();  // warm-up
    const auto t = std::chrono::steady_clock::now();
    const auto out = session->sample(req).get();
    std::int64_t tokens = 0;
    for (const auto& seq : out.sequences) tokens += static_cast<std::int64_t>(seq.tokens.size());
    rates[std::to_string(rows)] = static_cast<double>(tokens) / seconds_since(t);
  }
  // The same weights in Hugging Face's layout, for the hf_generate stage (scripts/gpu_check.sh runs
  // bench/engine/hf_generate.py on them: transformers' generate at 64 rows, against the decode figures above).
  const std::string hf_dir = (s.out / "decode-hf").string();
  session->export_merged_model(hf_dir).get();
  emit({{"stage", "decode"}, {"tokens_per_s_by_rows", rates}, {"new_tokens", new_tokens}, {"hf_model", hf_dir},
        {"ok", true}});
}

// `count` LoRA sessions (r16 on every linear, seeds 0, 1, ...) of the check's model on `svc`.
std::vector<std::shared_ptr<LocalSession>> lora_sessions(LocalService& svc, const Settings& s, int count) {
  std::vector<std::shared_ptr<LocalSession>> all;
  for (int i = 0; i < count; ++i) {
    SessionOptions o;
    o.base_model = s.model;
    o.seed = i;
    o.lora = LoraOptions{16, 32, {"all-linear"}};
    all.push_back(svc.create_session(o));
  }
  return all;
}

// 16 LoRA sessions on one base sampling at once (the requests of every session decode in one step:
// Transformer::decode_step), against one of them asking for the same rows in one request, in the same run (issue 26:
// the ratio should reach 0.75).
void tenants_stage(const Settings& s) {
  LocalService svc(service(s, "tenants"));
  const int sessions = s.dry_run ? 2 : 16, new_tokens = s.dry_run ? 8 : 128, samples = 4;
  const std::vector<std::shared_ptr<LocalSession>> all = lora_sessions(svc, s, sessions);
  auto request = [&](int rows, int tokens) {
    SampleRequest req;
    req.prompt = ModelInput::from_tokens(std::vector<token_id>(32, 7));
    req.num_samples = rows;
    req.params.max_tokens = tokens;
    req.params.seed = 1;
    return req;
  };
  // Tokens per second of `requests` submitted at once, each to its session.
  auto rate = [&](const std::vector<std::pair<std::shared_ptr<LocalSession>, SampleRequest>>& requests) {
    const auto t = std::chrono::steady_clock::now();
    std::vector<Future<SampleResponse>> pending;
    for (const auto& [session, req] : requests) pending.push_back(session->sample(req));
    std::int64_t tokens = 0;
    for (auto& f : pending)
      for (const auto& seq : f.get().sequences) tokens += static_cast<std::int64_t>(seq.tokens.size());
    return static_cast<double>(tokens) / seconds_since(t);
  };
  std::vector<std::pair<std::shared_ptr<LocalSession>, SampleRequest>> warm, each, one;
  for (auto& session : all) {
    warm.emplace_back(session, request(samples, 2));  // loads every session's model and the kernels
    each.emplace_back(session, request(samples, new_tokens));
  }
  one.emplace_back(all.front(), request(samples * sessions, new_tokens));
  rate(warm);
  const double together = rate(each), alone = rate(one);
  emit({{"stage", "tenants"}, {"sessions", sessions}, {"samples_each", samples}, {"new_tokens", new_tokens},
        {"tokens_per_s", together}, {"one_request_tokens_per_s", alone}, {"ratio", together / alone}, {"ok", true}});
}

// 8 LoRA sessions each asking for 2 x 16 tokens after a long prompt of its own (1,024 tokens), at once: the prompts
// prefill as rows of the decoding steps, 512 tokens per step (chunked prefill, the default), against the same with
// every prompt whole in one step. Prompt and new tokens per second, and whether both gave the same greedy tokens.
void prefill_stage(const Settings& s) {
  const int sessions = 8, prompt = s.dry_run ? 48 : 1024, new_tokens = 16;
  const std::int64_t chunk = s.dry_run ? 16 : 512;
  auto run = [&](const std::string& name, std::int64_t chunk_tokens, std::vector<std::vector<token_id>>& tokens) {
    LocalServiceOptions options = service(s, name);
    options.prefill_chunk_tokens = chunk_tokens;
    LocalService svc(options);
    const std::vector<std::shared_ptr<LocalSession>> all = lora_sessions(svc, s, sessions);
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
  emit({{"stage", "prefill"}, {"sessions", sessions}, {"prompt_tokens", prompt}, {"chunk_tokens", chunk},
        {"tokens_per_s_chunked", chunked}, {"tokens_per_s_whole", whole}, {"ratio", chunked / whole},
        {"same_greedy_sequences", same}, {"sequences", chunked_tokens.size()}, {"ok", true}});
}

// LoRA r16 training throughput, MFU and peak memory at two lengths.
void train_stage(const Settings& s) {
  LocalService svc(service(s, "train"));
  SessionOptions o;
  o.base_model = s.model;
  o.lora = LoraOptions{16, 32, {"all-linear"}};
  auto session = svc.create_session(o);
  const std::int64_t vocab = session->info().vocab_size;
  json cases = json::array();
  for (const int tokens : s.dry_run ? std::vector<int>{32, 64} : std::vector<int>{1024, 2048}) {
    const auto batch = sft_batch(8, tokens, vocab, 2);
    session->forward_backward(batch, LossSpec::cross_entropy()).get();  // warm-up
    reset_peak(s);
    const auto t = std::chrono::steady_clock::now();
    const auto out = session->forward_backward(batch, LossSpec::cross_entropy()).get();
    const double secs = seconds_since(t);
    session->optim_step(AdamParams{.learning_rate = 1e-4}).get();
    cases.push_back({{"rows", 8}, {"tokens", tokens}, {"tokens_per_s", 8.0 * tokens / secs},
                     {"mfu", out.metrics.count("mfu") ? out.metrics.at("mfu") : 0.0}, {"peak_mib", peak_mib(s)}});
  }
  emit({{"stage", "train"}, {"cases", cases}, {"ok", true}});
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--dry-run") {
      s.dry_run = true;
    } else if (a == "--device" && i + 1 < argc) {
      s.device = argv[++i];
    } else if (a == "--out" && i + 1 < argc) {
      s.out = argv[++i];
    } else {
      std::fprintf(stderr, "usage: gpu_check [--dry-run] [--device D] [--out DIR]\n");
      return 2;
    }
  }
  if (s.dry_run) {
    s.device = "cpu";
    s.model = "rlloop-tiny";
  }
  configure_engine_process({});
  fs::create_directories(s.out);
  try {
    const auto dev = engine::choose_device(s.device, s.dtype);
    emit({{"stage", "device"}, {"device", engine::device_name(dev.device)}, {"dtype", s.dtype},
          {"libtorch", TORCH_VERSION}, {"cuda_available", torch::cuda::is_available()}, {"dry_run", s.dry_run},
          {"model", s.model}, {"ok", true}});
    logits_stages(s);
    session_stage(s, true);
    session_stage(s, false);
    decode_stage(s);
    tenants_stage(s);
    prefill_stage(s);
    train_stage(s);
  } catch (const std::exception& e) {
    emit({{"stage", "error"}, {"message", e.what()}, {"ok", false}});
  }
  return all_ok ? 0 : 1;
}
