// The cost of a fully sharded model's two ways to decode, on rlloop-100m (fp32, greedy, the CPU): two ranks as
// threads of this process (one core each), against one rank holding the whole model on one core.
//   tensor_parallel_bench [--model NAME] [--rows B] [--prompt T] [--tokens N]
// Cases, one line each (seconds, decoded tokens/s over all rows, weight elements a rank holds):
// Every case decodes with Transformer::decode_step (the ATen step: the CPU decoder's kernels take only whole models),
// so the three compare the same kernels.
//   whole:      W=1, the whole model, all B rows;
//   gathered:   W=2 fully sharded, each rank decoding B/2 rows, every layer all-gathered at every step;
//   tensor-parallel: W=2, each rank cutting its slice from the shards (timed apart: "cut") and decoding all B rows
//               over it, two all-reduces per layer and one all-gather of the logits per step.
#include <ATen/Parallel.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "decode_util.hpp"
#include "io/model_io.hpp"
#include "model/builtin_models.hpp"
#include "ranks_util.hpp"

using namespace rlloop;
using namespace rlloop::engine;

namespace {

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

std::int64_t elements(Transformer& model) {
  std::int64_t n = 0;
  for (const auto& p : model.parameters()) n += p.numel();
  return n;
}

}  // namespace

int main(int argc, char** argv) {
  std::string name = "rlloop-100m";
  std::int64_t rows = 8, prompt_tokens = 16;
  int tokens = 32;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--model")) name = argv[i + 1];
    else if (!std::strcmp(argv[i], "--rows")) rows = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--prompt")) prompt_tokens = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--tokens")) tokens = std::atoi(argv[i + 1]);
  }
  at::set_num_threads(1);
  const ModelConfig cfg = *builtin_model(name);
  torch::manual_seed(1);
  const torch::Tensor prompt = torch::randint(0, 256, {rows, prompt_tokens}, torch::kLong);
  const double decoded = static_cast<double>(rows) * (tokens + 1);
  auto report = [&](const char* mode, double s, std::int64_t held) {
    std::printf("%-16s %8.2f s  %8.1f tokens/s  %lld weight elements per rank\n", mode, s, decoded / s,
                static_cast<long long>(held));
  };

  auto whole = init_model(cfg, 0, torch::kCPU, torch::kFloat32);
  auto t0 = std::chrono::steady_clock::now();
  test_util::greedy_decode_logits(*whole, prompt, tokens);
  report("whole", seconds_since(t0), elements(*whole));
  const std::int64_t all = elements(*whole);
  whole.reset();

  double gathered_s = 0, tensor_parallel_s = 0, cut_s = 0;
  std::int64_t slice_elements = 0;
  const auto errors = test_util::on_ranks(2, [&](int r, dist::Group& g) {
    auto model = init_model(cfg, 0, torch::kCPU, torch::kFloat32);
    model->set_fully_sharded(g);
    auto t = std::chrono::steady_clock::now();
    test_util::greedy_decode_logits(*model, prompt.narrow(0, r * rows / 2, rows / 2), tokens);
    const double gathered = seconds_since(t);
    t = std::chrono::steady_clock::now();
    auto slice = model->tensor_parallel(g);
    const double cut = seconds_since(t);
    t = std::chrono::steady_clock::now();
    test_util::greedy_decode_logits(*slice, prompt, tokens);
    if (r == 0) {
      gathered_s = gathered;
      cut_s = cut;
      tensor_parallel_s = seconds_since(t);
      slice_elements = elements(*slice);
    }
  });
  for (const auto& e : errors)
    if (!e.empty()) {
      std::fprintf(stderr, "tensor_parallel_bench: %s\n", e.c_str());
      return 1;
    }
  report("gathered", gathered_s, all / 2);
  report("tensor-parallel", tensor_parallel_s, slice_elements);
  std::printf("%-16s %8.2f s  (once per sample command, from the shards)\n", "cut", cut_s);
  return 0;
}
