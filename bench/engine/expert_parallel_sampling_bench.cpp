// What batching an expert-parallel session's sampling requests buys: R seeded requests (S samples of up to M new
// tokens each, distinct prompts) to one rlloop-tiny-moe session on two ranks with half the experts each (this
// process and an `rlloop worker` it starts, c10d Gloo over the loopback), sent one at a time (each awaited before the
// next: one command of the group per request, as every request ran before batching) and queued together (one batch:
// one forward per step for all of them). For reference, the same requests queued together on one rank holding
// every expert (the engine loop's continuous batching). Rounds alternate the modes; medians and the ratio are
// printed, and the tokens of the two modes on two ranks are compared (seeded: they must be equal).
//   expert_parallel_sampling_bench [--rounds N] [--requests R] [--samples S] [--max-tokens M]
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include <rlloop/local.hpp>

namespace {

using namespace rlloop;
using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

struct Settings {
  int rounds = 3;
  int requests = 16;
  int samples = 4;
  int max_tokens = 32;
};

std::vector<SampleRequest> make_requests(const Settings& s) {
  std::vector<SampleRequest> out;
  for (int i = 0; i < s.requests; ++i) {
    SampleRequest r;
    const std::string prompt = std::to_string(i * 37 % 100) + "+" + std::to_string(i * 11 % 50) + "=";
    r.prompt = ModelInput::from_tokens(std::vector<token_id>(prompt.begin(), prompt.end()));
    r.num_samples = s.samples;
    r.params.max_tokens = s.max_tokens;
    r.params.seed = 1000 + i;
    out.push_back(std::move(r));
  }
  return out;
}

// Seconds to answer every request, and the tokens, in order.
std::pair<double, std::vector<std::vector<token_id>>> run(LocalSession& session, const std::vector<SampleRequest>& reqs,
                                                          bool together) {
  const auto t0 = Clock::now();
  std::vector<SampleResponse> out;
  if (together) {
    std::vector<Future<SampleResponse>> futures;
    for (const auto& r : reqs) futures.push_back(session.sample(r));
    for (auto& f : futures) out.push_back(f.get());
  } else {
    for (const auto& r : reqs) out.push_back(session.sample(r).get());
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  std::vector<std::vector<token_id>> tokens;
  for (const auto& resp : out)
    for (const auto& seq : resp.sequences) tokens.push_back(seq.tokens);
  return {seconds, tokens};
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) try {
  Settings s;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const int value = std::stoi(argv[i + 1]);
    if (flag == "--rounds") s.rounds = value;
    else if (flag == "--requests") s.requests = value;
    else if (flag == "--samples") s.samples = value;
    else if (flag == "--max-tokens") s.max_tokens = value;
    else throw std::invalid_argument("unknown flag " + flag);
  }
  configure_engine_process({.num_threads = 1});
  const fs::path dir = fs::temp_directory_path() / ("rlloop-ep-sampling-bench-" + std::to_string(::getpid()));
  LocalServiceOptions one;
  one.checkpoint_dir = (dir / "one").string();
  LocalServiceOptions two = one;
  two.checkpoint_dir = (dir / "two").string();
  two.data_parallel.world_size = 2;
  two.data_parallel.expert_parallel = true;
  two.data_parallel.worker_program = RLLOOP_BIN;
  SessionOptions opts;
  opts.base_model = "rlloop-tiny-moe";
  opts.seed = 3;
  LocalService service_one(one), service_two(two);
  auto single = service_one.create_session(opts);
  auto spread = service_two.create_session(opts);
  const auto reqs = make_requests(s);
  run(*spread, reqs, true);  // warm-up
  run(*single, reqs, true);

  std::vector<double> alone, together, reference;
  bool same = true;
  std::uint64_t calls_alone = 0, calls_together = 0;
  for (int round = 0; round < s.rounds; ++round) {
    const bool alone_first = round % 2 == 0;
    std::vector<std::vector<token_id>> tokens[2];
    for (int k = 0; k < 2; ++k) {
      const bool batched = (k == 0) != alone_first;
      const auto before = service_two.data_parallel_stats().alltoall_calls;
      auto [seconds, t] = run(*spread, reqs, batched);
      const auto calls = service_two.data_parallel_stats().alltoall_calls - before;
      (batched ? together : alone).push_back(seconds);
      (batched ? calls_together : calls_alone) = calls;
      tokens[batched] = std::move(t);
    }
    same = same && tokens[0] == tokens[1];
    reference.push_back(run(*single, reqs, true).first);
  }
  std::printf("expert_parallel_sampling_bench --rounds %d --requests %d --samples %d --max-tokens %d\n", s.rounds,
              s.requests, s.samples, s.max_tokens);
  std::printf("rlloop-tiny-moe, %d requests x %d samples x up to %d new tokens, 1 thread per rank\n", s.requests,
              s.samples, s.max_tokens);
  std::printf("| case | seconds (median of %d) | all-to-alls of rank 0 |\n|---|---|---|\n", s.rounds);
  std::printf("| W=2 expert-parallel, one request at a time | %.3f | %llu |\n", median(alone),
              static_cast<unsigned long long>(calls_alone));
  std::printf("| W=2 expert-parallel, queued together | %.3f | %llu |\n", median(together),
              static_cast<unsigned long long>(calls_together));
  std::printf("| W=1, queued together (engine loop) | %.3f | - |\n", median(reference));
  std::printf("together / one at a time: %.2fx faster; same tokens: %s\n", median(alone) / median(together),
              same ? "yes" : "NO");
  fs::remove_all(dir);
  return same ? 0 : 1;
} catch (const std::exception& e) {
  std::fprintf(stderr, "expert_parallel_sampling_bench: %s\n", e.what());
  return 1;
}
