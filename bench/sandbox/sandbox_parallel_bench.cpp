// Scores 64 programs (the shipped problems' Python references, cycled) with the code reward, serially and
// in parallel with TBB, and prints the speed-up. Each scoring runs the program against all its tests in the
// sandbox. Usage: sandbox_parallel_bench [--benchmark_repetitions=N] [--jobs=N (default 4)]
#include <benchmark/benchmark.h>

#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <thread>

#include <oneapi/tbb/global_control.h>

#include <rlloop/envs/competitive_programming.hpp>
#include <rlloop/rewards/batch.hpp>
#include <rlloop/rewards/code.hpp>

namespace {
using namespace rlloop;

int g_jobs = 4;

struct Batch {
  std::vector<rewards::CodeProblem> problems;
  std::vector<std::string> completions;
};

const Batch& batch() {
  static const Batch b = [] {
    Batch out;
    auto all = envs::load_code_problems(std::string(RLLOOP_SOURCE_DIR) + "/data/problems/problems.jsonl");
    std::vector<rewards::CodeProblem> py;
    for (auto& p : all)
      if (p.language == sandbox::Language::python) py.push_back(p);
    for (std::size_t i = 0; out.problems.size() < 64; ++i) {
      out.problems.push_back(py[i % py.size()]);
      out.completions.push_back(py[i % py.size()].reference_solution);
    }
    return out;
  }();
  return b;
}

const rewards::CodeReward& reward() {
  static const rewards::CodeReward r{rewards::CodeRewardOptions{.mode = rewards::CodeRewardMode::all_pass}};
  return r;
}

void score(benchmark::State& state, int concurrency) {
  const auto& b = batch();
  double solved = 0;
  for (auto _ : state) {
    const auto scores = rewards::score_batch(reward(), b.problems, b.completions, {.max_concurrency = concurrency});
    solved = 0;
    for (const auto& s : scores) solved += s.value;
  }
  if (solved != 64) state.SkipWithError("a reference solution failed: the comparison would be meaningless");
  state.counters["programs/s"] =
      benchmark::Counter(64.0 * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}

void BM_score64_serial(benchmark::State& state) { score(state, 1); }
void BM_score64_parallel(benchmark::State& state) { score(state, g_jobs); }

// Keeps the mean real time of each benchmark to print the ratio at the end.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  std::map<std::string, double> seconds;
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const auto& r : runs)
      if (r.run_type == Run::RT_Iteration || r.aggregate_name == "mean")
        seconds[r.run_name.function_name] = r.GetAdjustedRealTime();
  }
};
}  // namespace

BENCHMARK(BM_score64_serial)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(2);
BENCHMARK(BM_score64_parallel)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(2);

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i)
    if (std::strncmp(argv[i], "--jobs=", 7) == 0) g_jobs = std::atoi(argv[i] + 7);
  // Sandboxed runs mostly wait on their process; let TBB run more of them than there are cores.
  tbb::global_control parallelism(tbb::global_control::max_allowed_parallelism, static_cast<std::size_t>(g_jobs));
  benchmark::Initialize(&argc, argv);
  RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  const double serial = reporter.seconds["BM_score64_serial"], parallel = reporter.seconds["BM_score64_parallel"];
  if (serial > 0 && parallel > 0)
    std::printf("64 programs: serial %.0f ms, parallel (%d jobs, %u cores) %.0f ms, speed-up %.2fx\n", serial, g_jobs,
                std::thread::hardware_concurrency(), parallel, serial / parallel);
  benchmark::Shutdown();
}
