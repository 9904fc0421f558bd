// `rlloop worker`: one rank of a data-parallel group; holds replicas of rank 0's sessions and trains its share
// of every batch and of every sampling request. Rank 0 (`rlloop serve --world-size W`, or any LocalService with
// data_parallel set) starts local workers itself; this command is how a rank on another host joins.
// Started by a launcher (RANK or SLURM_PROCID set) and without --rank, it is `rlloop serve` on every rank, which
// takes its part from the launcher's environment: one command line for every rank (docs/distributed.md).
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include <rlloop/local.hpp>

#include "base_models.hpp"
#include "command.hpp"
#include "launch_env.hpp"

namespace {

bool has_flag(int argc, char** argv, const char* flag) {
  const std::size_t n = std::strlen(flag);
  for (int i = 1; i < argc; ++i)
    if (std::strncmp(argv[i], flag, n) == 0 && (argv[i][n] == '\0' || argv[i][n] == '=')) return true;
  return false;
}

int run_worker(int argc, char** argv) {
  if (!has_flag(argc, argv, "--rank") && rlloop::cli::launched_rank())
    for (const auto& command : rlloop::cli::commands())
      if (command.name == "serve") return command.run(argc, argv);
  CLI::App app{"Join a data-parallel group as one of its ranks", "rlloop worker"};
  rlloop::DataParallelWorkerOptions options;
  int threads = 0;
  std::vector<std::string> base_models;
  app.add_option("--rendezvous", options.rendezvous, "Rank 0's HOST:PORT (its --rendezvous)")->required();
  app.add_option("--rank", options.rank, "This rank, 1..world size - 1")->required();
  app.add_option("--world-size", options.world_size, "Ranks in the group, rank 0 included")->required();
  app.add_option("--timeout-s", options.timeout_s, "Rendezvous and collective timeout (as rank 0's)");
  app.add_option("--device", options.service.device, "auto, cpu, cuda or cuda:N");
  app.add_option("--dtype", options.service.dtype, "auto, fp32 or bf16 (as rank 0's)");
  app.add_option("--backend", options.service.data_parallel.backend,
                 "The tensors' collectives: auto, gloo or nccl (as rank 0's --dp-backend resolved)");
  app.add_option("--threads", threads, "LibTorch threads (0 = all cores)");
  app.add_option("--base-model", base_models, "Catalogue entry NAME=MODEL_DIR, as rank 0's (repeatable)");
  app.add_option("--max-batch-rows", options.service.max_batch_rows,
                 "Most sample rows this rank decodes in one batched step (as rank 0's --max-batch-rows)");
  app.add_option("--kv-cache-mb", options.service.kv_cache_mb,
                 "KV cache memory of this rank's sampling requests (as rank 0's --kv-cache-mb)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--prefill-chunk-tokens", options.service.prefill_chunk_tokens,
                 "Most prompt tokens this rank prefills per decoding step (as rank 0's --prefill-chunk-tokens)")
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 30));
  bool dequantize_base = false;
  app.add_flag("--dequantize-base", dequantize_base, "As rank 0's --dequantize-base");
  app.add_flag("--activation-checkpointing", options.service.activation_checkpointing,
               "As rank 0's --activation-checkpointing");
  app.add_flag("--expert-parallel", options.service.data_parallel.expert_parallel, "As rank 0's --expert-parallel");
  app.add_option("--shard", options.service.data_parallel.shard, "As rank 0's --shard")
      ->check(CLI::IsMember({"none", "full"}));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  options.service.base_models = rlloop::cli::parse_base_models(base_models);
  options.service.quantized_base = !dequantize_base;
  rlloop::configure_engine_process({.num_threads = threads});
  rlloop::run_data_parallel_worker(options);
  return 0;
}

const rlloop::cli::RegisterCommand registered{
    {"worker", "Join a data-parallel group (rlloop serve --world-size) as one rank", run_worker}};

}  // namespace
