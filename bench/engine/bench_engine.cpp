// Engine throughput on this machine, CPU fp32, a fixed number of intra-op threads (default 2):
//   BM_MatmulPeak          a large fp32 torch::matmul (the machine's practical peak, same library and threads)
//   BM_ForwardBackward/M   LocalSession::forward_backward, cross_entropy, on a fixed batch (public API)
//   BM_DecodeProduct       the decoding step's matrix product alone: 16 rows x 600 MB of [2048, 768] weights,
//                          streamed from memory as the sampler streams rlloop-100m's (its ceiling)
//   BM_ReadBandwidth       a threaded sum over the same 600 MB: the read bandwidth that product could use
//   BM_DecodeProductBf16   the same product with operands rounded to bf16 (bf16_gemm.hpp, the "bf16" sampling
//                          precision; AVX512_BF16 dot products where the CPU has them)
//   BM_Sample/M            engine::sample: 16 samples x 128 new tokens from one 16-token prompt, temperature 1
//   BM_SampleBf16/M        the same with bf16 decoding steps (LocalServiceOptions::sampling_precision = bf16)
//   BM_PrefillTogether/M/C 8 requests of 2 samples x 16 new tokens from their own 128-token prompts, admitted at
//                          once and decoded together (decode_step), as the engine loop runs them: C 0 each prompt
//                          prefilled alone as its run is made, C 1 the prompts prefilled as rows of the steps
//                          (chunked prefill, 512 tokens per step). tokens_per_s counts prompt and new tokens.
//   BM_DecodeBesideLongPrompt/M/C  a request of 16 samples x 48 tokens decoding when another arrives with a 960-token
//                          prompt (after its 8th step): C 0 that prompt prefilled whole as its run is made, C 1 in
//                          chunks of 256 tokens as rows of the steps. Counters: the longest wait between two of the
//                          decoding request's tokens (max_gap_ms) and its median (median_gap_ms).
//   BM_DecodeExperts/K/S   a mixture of experts against a dense model of the same active parameters (rlloop-100m's
//                          attention; 8 experts of width 1024 with top 2 against one MLP of width 2048): S samples x
//                          32 new tokens; K 0 dense (CPU decoder), 1 dense on the ATen step, 2 the experts (which
//                          take the ATen step). Counters: ms per step, and the weight bytes a step reads (at 16
//                          rows every parameter: an upper bound, ~99% of experts are hit) with the bandwidth that
//                          makes
// Counters: tokens_per_s, GFLOPs (achieved), peak_frac (achieved / BM_MatmulPeak of the same run).
// FLOPs: forward_backward 6 * params * tokens, sampling 2 * params * new tokens; params = every parameter
// (the tied embedding counted once: it is the unembedding matmul). Attention score/value FLOPs not counted.
// Models start from init_model's seeded random weights (the engine's built-in starting point).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <rlloop/local.hpp>

#include "kernels/bf16_gemm.hpp"
#include "model/builtin_models.hpp"
#include "kernels/device.hpp"
#include "io/model_io.hpp"
#include "runtime/sampler.hpp"
#include "kernels/small_gemm.hpp"
#include "synthetic_tokens.hpp"

namespace {

using Clock = std::chrono::steady_clock;

int threads() {
  if (const char* env = std::getenv("RLLOOP_BENCH_THREADS")) return std::atoi(env);
  return 2;
}

double g_peak_flops = 0.0;  // filled by BM_MatmulPeak; later benchmarks report a fraction of it

struct Shape {
  const char* model;
  int batch, seq;  // forward_backward batch
};
const Shape kShapes[] = {{"rlloop-small", 64, 32}, {"rlloop-100m", 8, 256}};
constexpr int kSamples = 16, kNewTokens = 128, kPromptTokens = 16;

std::int64_t count_params(rlloop::engine::Transformer& m) {
  std::int64_t n = 0;
  for (const auto& p : m.parameters()) n += p.numel();
  return n;
}

// Every benchmark runs in the process configuration of `rlloop serve`: threads() threads and the caching CPU
// allocator (without it each call page-faults its activations, KV cache and bf16 weights in afresh).
void configure_process() { rlloop::configure_engine_process({.num_threads = threads()}); }

rlloop::LocalService& service() {
  static rlloop::LocalService svc(rlloop::LocalServiceOptions{.device = "cpu"});
  return svc;
}

// One session per model for the whole run (building rlloop-100m's 110M random weights takes seconds).
rlloop::LocalSession& session(const std::string& model) {
  static std::map<std::string, std::shared_ptr<rlloop::LocalSession>> sessions;
  auto& s = sessions[model];
  if (!s) s = service().create_session(rlloop::SessionOptions{.base_model = model});
  return *s;
}

std::shared_ptr<rlloop::engine::Transformer> sampler_model(const std::string& model) {
  static std::map<std::string, std::shared_ptr<rlloop::engine::Transformer>> models;
  auto& m = models[model];
  if (!m) m = rlloop::engine::init_model(*rlloop::engine::builtin_model(model), 0, torch::kCPU, torch::kFloat32);
  return m;
}

std::vector<rlloop::token_id> tokens(int n, std::uint32_t seed) { return rlloop::bench::synthetic_tokens(n, seed); }

void report(benchmark::State& state, double seconds, double tokens, double flops) {
  state.counters["tokens_per_s"] = tokens / seconds;
  state.counters["GFLOPs"] = flops / seconds / 1e9;
  if (g_peak_flops > 0) state.counters["peak_frac"] = flops / seconds / g_peak_flops;
}

void BM_MatmulPeak(benchmark::State& state) {
  configure_process();
  const std::int64_t n = state.range(0);
  auto a = torch::randn({n, n}), b = torch::randn({n, n});
  torch::Tensor c = torch::matmul(a, b);  // warm-up
  double best = 0.0;
  for (auto _ : state) {
    auto t0 = Clock::now();
    c = torch::matmul(a, b);
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    best = std::max(best, 2.0 * n * n * n / s);
    benchmark::DoNotOptimize(c.data_ptr<float>());
  }
  g_peak_flops = std::max(g_peak_flops, best);
  state.counters["GFLOPs"] = best / 1e9;  // best iteration: the peak
}

void BM_ForwardBackward(benchmark::State& state) {
  configure_process();
  const Shape& shape = kShapes[state.range(0)];
  auto& s = session(shape.model);
  std::vector<rlloop::Datum> data;
  for (int i = 0; i < shape.batch; ++i) {
    auto seq = tokens(shape.seq + 1, 7 + i);
    std::vector<rlloop::token_id> input(seq.begin(), seq.end() - 1), target(seq.begin() + 1, seq.end());
    data.push_back({rlloop::ModelInput::from_tokens(input),
                    {{"target_tokens", rlloop::TensorData::from_tokens(target)},
                     {"weights", rlloop::TensorData::from_floats(std::vector<float>(shape.seq, 1.0f))}}});
  }
  const auto loss = rlloop::LossSpec::cross_entropy();
  const double params = static_cast<double>(s.info().num_parameters);
  s.forward_backward(data, loss).get();  // warm-up (allocator, gradient buffers)
  double seconds = 0.0;
  for (auto _ : state) {
    auto t0 = Clock::now();
    auto out = s.forward_backward(data, loss).get();
    seconds += std::chrono::duration<double>(Clock::now() - t0).count();
    benchmark::DoNotOptimize(out.metrics);
  }
  const double tok = static_cast<double>(shape.batch) * shape.seq * state.iterations();
  report(state, seconds, tok, 6.0 * params * tok);
  state.SetLabel(std::string(shape.model) + " " + std::to_string(shape.batch) + "x" + std::to_string(shape.seq));
}

// `samples` samples of up to `max_tokens` new tokens from the benchmarks' 16-token prompt, temperature 1.
rlloop::SampleRequest sample_request(int samples, int max_tokens) {
  rlloop::SampleRequest req;
  req.prompt = rlloop::ModelInput::from_tokens(tokens(kPromptTokens, 3));
  req.num_samples = samples;
  req.params.max_tokens = max_tokens;
  req.params.temperature = 1.0;
  return req;
}

void run_sample(benchmark::State& state, rlloop::engine::DecodePrecision precision) {
  const Shape& shape = kShapes[state.range(0)];
  configure_process();
  auto model = sampler_model(shape.model);
  const double params = static_cast<double>(count_params(*model));
  const rlloop::SampleRequest req = sample_request(kSamples, kNewTokens);
  const rlloop::engine::SampleStream gen(1234);
  rlloop::engine::sample(*model, req, {}, gen, precision);  // warm-up
  double seconds = 0.0, generated = 0.0;
  for (auto _ : state) {
    auto t0 = Clock::now();
    auto out = rlloop::engine::sample(*model, req, {}, gen, precision);
    seconds += std::chrono::duration<double>(Clock::now() - t0).count();
    for (const auto& seq : out.sequences) generated += static_cast<double>(seq.tokens.size());
  }
  report(state, seconds, generated, 2.0 * params * generated);
  state.SetLabel(std::string(shape.model) + " " + std::to_string(kSamples) + "x" + std::to_string(kNewTokens));
}

void BM_Sample(benchmark::State& state) { run_sample(state, rlloop::engine::DecodePrecision::fp32); }

void BM_SampleBf16(benchmark::State& state) { run_sample(state, rlloop::engine::DecodePrecision::bf16); }

void BM_PrefillTogether(benchmark::State& state) {
  const Shape& shape = kShapes[state.range(0)];
  const auto prefill = state.range(1) == 0 ? rlloop::engine::Prefill::at_start : rlloop::engine::Prefill::in_steps;
  constexpr int kRequests = 8, kPrompt = 128, kNew = 16;
  configure_process();
  auto model = sampler_model(shape.model);
  const double params = static_cast<double>(count_params(*model));
  std::vector<rlloop::SampleRequest> requests;
  for (int i = 0; i < kRequests; ++i) {
    rlloop::SampleRequest req = sample_request(2, kNew);
    req.prompt = rlloop::ModelInput::from_tokens(tokens(kPrompt, 100 + i));
    requests.push_back(req);
  }
  auto run_all = [&] {
    std::vector<std::unique_ptr<rlloop::engine::DecodeRun>> runs;
    for (int i = 0; i < kRequests; ++i)
      runs.push_back(std::make_unique<rlloop::engine::DecodeRun>(*model, requests[i], nullptr,
                                                                  rlloop::engine::SampleStream(i),
                                                                  rlloop::engine::DecodePrecision::fp32, nullptr,
                                                                  prefill));
    double generated = 0.0;
    for (;;) {
      std::vector<rlloop::engine::DecodeRun*> live;
      for (auto& r : runs)
        if (!r->done()) live.push_back(r.get());
      if (live.empty()) break;
      rlloop::engine::decode_step(live);
    }
    for (auto& r : runs)
      for (const auto& seq : r->take().sequences) generated += static_cast<double>(seq.tokens.size());
    return generated;
  };
  run_all();  // warm-up
  double seconds = 0.0, processed = 0.0;
  for (auto _ : state) {
    auto t0 = Clock::now();
    const double generated = run_all();
    seconds += std::chrono::duration<double>(Clock::now() - t0).count();
    processed += generated + kRequests * kPrompt;
  }
  report(state, seconds, processed, 2.0 * params * processed);
  state.SetLabel(std::string(shape.model) + (state.range(1) == 0 ? ", prefills alone" : ", chunked prefill"));
}

void BM_DecodeBesideLongPrompt(benchmark::State& state) {
  const Shape& shape = kShapes[state.range(0)];
  const bool chunked = state.range(1) == 1;
  constexpr int kPrompt = 960, kChunk = 256;
  configure_process();
  auto model = sampler_model(shape.model);
  rlloop::SampleRequest decoding = sample_request(kSamples, 48), arriving = sample_request(2, 8);
  arriving.prompt = rlloop::ModelInput::from_tokens(tokens(kPrompt, 5));
  std::vector<double> gaps;
  for (auto _ : state) {
    using rlloop::engine::DecodeRun;
    std::vector<std::unique_ptr<DecodeRun>> runs;
    runs.push_back(std::make_unique<DecodeRun>(*model, decoding, nullptr, rlloop::engine::SampleStream(1),
                                               rlloop::engine::DecodePrecision::fp32, nullptr));
    auto last = Clock::now();
    for (int step = 0; !runs.front()->done(); ++step) {
      if (step == 8)  // the engine loop makes an admitted request's run between two steps
        runs.push_back(std::make_unique<DecodeRun>(
            *model, arriving, nullptr, rlloop::engine::SampleStream(2), rlloop::engine::DecodePrecision::fp32,
            nullptr, chunked ? rlloop::engine::Prefill::in_steps : rlloop::engine::Prefill::at_start));
      std::vector<DecodeRun*> live;
      for (auto& r : runs)
        if (!r->done()) live.push_back(r.get());
      rlloop::engine::decode_step(live, kChunk);
      const auto now = Clock::now();
      gaps.push_back(std::chrono::duration<double, std::milli>(now - last).count());
      last = now;
    }
  }
  std::sort(gaps.begin(), gaps.end());
  state.counters["max_gap_ms"] = gaps.back();
  state.counters["median_gap_ms"] = gaps[gaps.size() / 2];
  state.SetLabel(std::string(shape.model) + (chunked ? ", chunked prefill" : ", prompt prefilled whole"));
}

// rlloop-100m's shape with 8 experts of width 1024, two per token: the MLP a token runs is as wide as the dense one
// (2 x 1024 = 2048), so both models have the same active parameters (the router's 8 x 768 per layer aside).
std::shared_ptr<rlloop::engine::Transformer> experts_model(bool experts) {
  static std::map<bool, std::shared_ptr<rlloop::engine::Transformer>> models;
  auto& m = models[experts];
  if (m) return m;
  rlloop::engine::ModelConfig cfg = *rlloop::engine::builtin_model("rlloop-100m");
  if (experts) {
    cfg = rlloop::engine::with_experts(cfg, 8, 2, 1024);
  } else {
    cfg.model_type = "qwen3";  // the same attention (q/k norms) as the experts' family
    cfg.qk_norm = true;
  }
  m = rlloop::engine::init_model(cfg, 0, torch::kCPU, torch::kFloat32);
  return m;
}

void BM_DecodeExperts(benchmark::State& state) {
  configure_process();
  const int kind = static_cast<int>(state.range(0));
  const int samples = static_cast<int>(state.range(1));
  constexpr int kSteps = 32;
  auto model = experts_model(kind == 2);
  const auto& cfg = model->config();
  // The decoder choice is the environment's (sampler.cpp reads RLLOOP_DECODER per run): set for the ATen case,
  // cleared for the others, and what the caller had put back at the end.
  const char* caller = std::getenv("RLLOOP_DECODER");
  const std::string saved = caller ? caller : "";
  if (kind == 1)
    setenv("RLLOOP_DECODER", "aten", 1);
  else
    unsetenv("RLLOOP_DECODER");
  const rlloop::SampleRequest req = sample_request(samples, kSteps);
  const rlloop::engine::SampleStream gen(1234);
  rlloop::engine::sample(*model, req, {}, gen);  // warm-up
  double seconds = 0.0, steps = 0.0;
  for (auto _ : state) {
    auto t0 = Clock::now();
    auto out = rlloop::engine::sample(*model, req, {}, gen);
    seconds += std::chrono::duration<double>(Clock::now() - t0).count();
    std::size_t longest = 0;
    for (const auto& seq : out.sequences) longest = std::max(longest, seq.tokens.size());
    steps += static_cast<double>(longest);
  }
  if (caller)
    setenv("RLLOOP_DECODER", saved.c_str(), 1);
  else
    unsetenv("RLLOOP_DECODER");
  // One row reads its two experts per layer. At 16 rows every parameter counts: an upper bound, as an expert misses
  // all 16 tokens' routes with probability (6/8)^16 = 1% (so about 99% of the experts' weights are read).
  const double read = static_cast<double>(samples == 1 ? cfg.active_parameters() : cfg.num_parameters()) * 4.0;
  state.counters["ms_per_step"] = 1e3 * seconds / steps;
  state.counters["weight_MB_per_step"] = read / 1e6;
  state.counters["GBps"] = read * steps / seconds / 1e9;
  state.SetLabel(std::string(kind == 0 ? "dense, CPU decoder" : kind == 1 ? "dense, ATen step" : "8 experts top 2") +
                 ", " + std::to_string(samples) + " x " + std::to_string(kSteps));
}

// 16 rows times [2048, 768] weights, cycling through 96 distinct matrices (600 MB, far beyond the caches, like
// rlloop-100m's 110M weights): the product a decoding step of 16 samples is made of.
void BM_DecodeProduct(benchmark::State& state) {
  configure_process();
  constexpr std::int64_t M = kSamples, N = 2048, K = 768, kMatrices = 96;
  auto weights = torch::randn({kMatrices, N, K});
  auto x = torch::randn({M, K}), y = torch::empty({M, N});
  double seconds = 0.0, flops = 0.0;
  for (auto _ : state) {
    auto t0 = Clock::now();
    for (std::int64_t i = 0; i < kMatrices; ++i)
      rlloop::engine::linear_rows(x.data_ptr<float>(), M, weights[i].data_ptr<float>(), N, K, y.data_ptr<float>(),
                                  false);
    seconds += std::chrono::duration<double>(Clock::now() - t0).count();
    flops += 2.0 * M * N * K * kMatrices;
  }
  state.counters["GFLOPs"] = flops / seconds / 1e9;
  if (g_peak_flops > 0) state.counters["peak_frac"] = flops / seconds / g_peak_flops;
}

// BM_DecodeProduct with the weights rounded to bf16 (300 MB) and the rows rounded per call, as the bf16
// decoding step runs them.
void BM_DecodeProductBf16(benchmark::State& state) {
  configure_process();
  constexpr std::int64_t M = kSamples, N = 2048, K = 768, kMatrices = 96;
  std::vector<rlloop::engine::Bf16Weight> weights;
  for (std::int64_t i = 0; i < kMatrices; ++i) weights.emplace_back(torch::randn({N, K}).data_ptr<float>(), N, K);
  auto x = torch::randn({M, K}), y = torch::empty({M, N});
  double seconds = 0.0, flops = 0.0;
  for (auto _ : state) {
    auto t0 = Clock::now();
    for (const auto& w : weights) w.multiply(x.data_ptr<float>(), M, y.data_ptr<float>(), false);
    seconds += std::chrono::duration<double>(Clock::now() - t0).count();
    flops += 2.0 * M * N * K * kMatrices;
  }
  state.counters["GFLOPs"] = flops / seconds / 1e9;
  if (g_peak_flops > 0) state.counters["peak_frac"] = flops / seconds / g_peak_flops;
  state.SetLabel(weights.front().stored_as_bf16() ? "avx512_bf16" : "rounded fp32 (no AVX512_BF16)");
}

// Reading the same 600 MB with LibTorch's vectorised, threaded sum: the memory bandwidth BM_DecodeProduct
// would hit if it were bandwidth-bound (it streams 8 FLOP per weight byte).
void BM_ReadBandwidth(benchmark::State& state) {
  configure_process();
  auto weights = torch::randn({96, 2048, 768});
  double seconds = 0.0, bytes = 0.0;
  for (auto _ : state) {
    auto t0 = Clock::now();
    benchmark::DoNotOptimize(weights.sum().item<float>());
    seconds += std::chrono::duration<double>(Clock::now() - t0).count();
    bytes += static_cast<double>(weights.nbytes());
  }
  state.counters["GBps"] = bytes / seconds / 1e9;
}

}  // namespace

BENCHMARK(BM_MatmulPeak)->Arg(2048)->Arg(4096)->Iterations(3)->Unit(benchmark::kMillisecond)->UseRealTime();
// Arg = index into kShapes: 0 rlloop-small, 1 rlloop-100m. One warm-up call precedes the timed ones;
// iteration counts keep the whole run short (one rlloop-100m forward_backward step is ~20-60 s here).
BENCHMARK(BM_ForwardBackward)->Arg(0)->MinTime(2.0)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_ForwardBackward)->Arg(1)->Iterations(1)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_DecodeProduct)->Iterations(10)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_ReadBandwidth)->Iterations(10)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_DecodeProductBf16)->Iterations(10)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_Sample)->Arg(0)->MinTime(2.0)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_Sample)->Arg(1)->Iterations(1)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_SampleBf16)->Arg(0)->MinTime(2.0)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_SampleBf16)->Arg(1)->Iterations(1)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_PrefillTogether)
    ->Args({1, 0})
    ->Args({1, 1})
    ->Iterations(2)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_DecodeBesideLongPrompt)
    ->Args({1, 0})
    ->Args({1, 1})
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_DecodeExperts)
    ->ArgsProduct({{0, 1, 2}, {1, 16}})
    ->Iterations(3)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

BENCHMARK_MAIN();
