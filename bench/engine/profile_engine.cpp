// Where the engine's time goes: runs one forward_backward (cross_entropy) or one sample() call on a built-in
// model under LibTorch's legacy autograd profiler and prints the operators by self time (time inside an op
// minus the ops it called), plus the wall time of the same call without the profiler.
//   profile_engine <rlloop-small|rlloop-100m> <forward_backward|sample> [threads=2] [top=25]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include <torch/csrc/autograd/profiler_legacy.h>
#include <torch/torch.h>

#include <rlloop/local.hpp>

#include "runtime/batch.hpp"
#include "model/builtin_models.hpp"
#include "io/model_io.hpp"
#include "runtime/sampler.hpp"
#include "synthetic_tokens.hpp"

namespace {
namespace prof = torch::autograd::profiler;
using namespace rlloop;

struct Stat {
  double self_us = 0, total_us = 0;
  long calls = 0;
};

std::vector<rlloop::token_id> tokens(int n, std::uint32_t seed) { return rlloop::bench::synthetic_tokens(n, seed); }

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s <model> <forward_backward|sample> [threads] [top]\n", argv[0]);
    return 2;
  }
  const std::string model_name = argv[1], op = argv[2];
  const int threads = argc > 3 ? std::atoi(argv[3]) : 2, top = argc > 4 ? std::atoi(argv[4]) : 25;
  configure_engine_process({.num_threads = threads});  // as the CLI does: no page faults on reused buffers
  auto model = engine::init_model(*engine::builtin_model(model_name), 0, torch::kCPU, torch::kFloat32);

  std::function<void()> call;
  std::vector<Datum> data;
  SampleRequest req;
  const engine::SampleStream gen(1);
  if (op == "forward_backward") {
    const int B = model_name == "rlloop-small" ? 64 : 8, T = model_name == "rlloop-small" ? 32 : 256;
    for (int i = 0; i < B; ++i) {
      auto seq = tokens(T + 1, 7 + i);
      data.push_back({ModelInput::from_tokens({seq.begin(), seq.end() - 1}),
                      {{"target_tokens", TensorData::from_tokens(std::vector<token_id>(seq.begin() + 1, seq.end()))},
                       {"weights", TensorData::from_floats(std::vector<float>(T, 1.0f))}}});
    }
    call = [&] { engine::run_builtin_loss(*model, data, LossSpec::cross_entropy(), true); };
  } else {
    req.prompt = ModelInput::from_tokens(tokens(16, 3));
    req.num_samples = 16;
    req.params.max_tokens = 128;
    call = [&] { engine::sample(*model, req, {}, gen); };
  }
  call();  // warm-up
  auto t0 = std::chrono::steady_clock::now();
  call();
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  std::map<std::string, Stat> stats;
  double profiled_wall_us = 0;
  {
    prof::TLSLegacyProfilerGuard guard(torch::profiler::impl::ProfilerConfig(torch::profiler::impl::ProfilerState::CPU),
                                       [&](const prof::thread_event_lists& lists) {
                                         for (const auto& list : lists) {
                                           struct Open {
                                             std::string name;
                                             double start, child;
                                           };
                                           std::vector<Open> stack;
                                           for (const auto& e : list) {
                                             const auto kind = e.kindStr();
                                             if (kind == "push") {
                                               stack.push_back({e.name(), e.cpuUs(), 0.0});
                                             } else if (kind == "pop" && !stack.empty()) {
                                               Open o = stack.back();
                                               stack.pop_back();
                                               const double dur = e.cpuUs() - o.start;
                                               auto& s = stats[o.name];
                                               s.self_us += dur - o.child;
                                               s.total_us += dur;
                                               ++s.calls;
                                               if (!stack.empty()) stack.back().child += dur;
                                             }
                                           }
                                         }
                                       });
    auto p0 = std::chrono::steady_clock::now();
    call();
    profiled_wall_us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - p0).count();
  }
  std::vector<std::pair<std::string, Stat>> rows(stats.begin(), stats.end());
  std::sort(rows.begin(), rows.end(), [](auto& a, auto& b) { return a.second.self_us > b.second.self_us; });
  double self_sum = 0;
  long calls = 0;
  for (auto& [n, s] : rows) {
    self_sum += s.self_us;
    calls += s.calls;
  }
  std::printf(
      "%s %s, %d threads: wall %.1f ms (unprofiled), %.1f ms profiled; %ld op calls, self time in ops %.1f ms "
      "(%.0f%% of profiled wall)\n",
      model_name.c_str(), op.c_str(), threads, wall * 1e3, profiled_wall_us / 1e3, calls, self_sum / 1e3,
      100.0 * self_sum / profiled_wall_us);
  std::printf("%-44s %10s %7s %10s %8s\n", "op", "self ms", "self %", "total ms", "calls");
  for (int i = 0; i < top && i < static_cast<int>(rows.size()); ++i) {
    const auto& [n, s] = rows[i];
    std::printf("%-44s %10.1f %6.1f%% %10.1f %8ld\n", n.c_str(), s.self_us / 1e3, 100.0 * s.self_us / profiled_wall_us,
                s.total_us / 1e3, s.calls);
  }
  return 0;
}
