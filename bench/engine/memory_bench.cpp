// Peak memory of one training pass (forward + backward of the summed target logprobs, as cross_entropy) on a
// Qwen3-shaped model with Qwen3's 151,936-token vocabulary (2 layers, hidden 256: the vocabulary is what the
// logits scale with), measured with the caching CPU allocator's statistics (blocks of 1 MiB and more), with the
// logits in chunks (target_logprobs.hpp, what the engine runs) and whole (one chunk: the engine before chunking).
//   memory_bench [--rows B] [--tokens T,T,...] [--whole-up-to T]
// Prints one line per case: tokens, mode, peak MiB, seconds. Whole logits are measured only up to --whole-up-to
// tokens per row (default 512): at 8 x 2048 tokens one fp32 copy of them is 10 GB.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <rlloop/local.hpp>

#include "kernels/cpu_allocator.hpp"
#include "model/model_config.hpp"
#include "io/model_io.hpp"
#include "runtime/target_logprobs.hpp"

using namespace rlloop;
using namespace rlloop::engine;

namespace {

ModelConfig qwen3_shaped() {
  return ModelConfig::from_json({{"model_type", "qwen3"},
                                 {"vocab_size", 151936},
                                 {"hidden_size", 256},
                                 {"intermediate_size", 768},
                                 {"num_hidden_layers", 2},
                                 {"num_attention_heads", 4},
                                 {"num_key_value_heads", 2},
                                 {"head_dim", 64},
                                 {"tie_word_embeddings", true},
                                 {"max_position_embeddings", 40960},
                                 {"rope_theta", 1000000.0},
                                 {"rms_norm_eps", 1e-6}});
}

}  // namespace

int main(int argc, char** argv) {
  int rows = 8, whole_up_to = 512;
  std::vector<int> lengths{256, 512, 1024, 2048};
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--rows")) rows = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--whole-up-to")) whole_up_to = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--tokens")) {
      lengths.clear();
      std::stringstream list(argv[i + 1]);
      for (std::string t; std::getline(list, t, ',');) lengths.push_back(std::stoi(t));
    }
  }
  configure_engine_process({});
  CachingCpuAllocator* allocator = installed_caching_cpu_allocator();
  if (!allocator) {
    std::fprintf(stderr, "memory_bench: the caching CPU allocator is off (RLLOOP_CPU_CACHE_MB=0)\n");
    return 1;
  }
  const ModelConfig cfg = qwen3_shaped();
  auto model = init_model(cfg, 1, torch::kCPU, torch::kFloat32);
  std::printf("Qwen3-shaped: vocabulary %lld, hidden %lld, %lld layers; %d rows\n",
              static_cast<long long>(cfg.vocab_size), static_cast<long long>(cfg.hidden_size),
              static_cast<long long>(cfg.num_hidden_layers), rows);
  std::printf("%-8s %-16s %10s %8s\n", "tokens", "logits", "peak MiB", "seconds");
  for (const int T : lengths) {
    const auto ids = torch::randint(0, cfg.vocab_size, {rows, T}, torch::kLong);
    const auto targets = torch::randint(0, cfg.vocab_size, {rows, T}, torch::kLong);
    for (const bool whole : {false, true}) {
      if (whole && T > whole_up_to) continue;
      for (auto& [name, p] : model->named_trainable_parameters()) p.mutable_grad().reset();
      allocator->release_cached();
      const std::size_t before = allocator->stats().in_use_bytes;
      allocator->reset_peak();
      const auto start = std::chrono::steady_clock::now();
      const auto lp = target_logprobs(*model, model->hidden_states(ids), targets,
                                      whole ? std::int64_t{1} << 62 : kLogitChunkValues);
      (-lp.sum()).backward();
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      const double mib = static_cast<double>(allocator->stats().peak_in_use_bytes - before) / (1 << 20);
      std::printf("%-8d %-16s %10.0f %8.1f\n", rows * T, whole ? "whole" : "chunks of 16M", mib, seconds);
      std::fflush(stdout);
    }
  }
  return 0;
}
