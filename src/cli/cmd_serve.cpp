// `rlloop serve`: rlloop-server hosting LocalService sessions for the tenants of a tenants file.
#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <rlloop/local.hpp>

#include "base_models.hpp"
#include "command.hpp"
#include "launch_env.hpp"
#include "server/server.hpp"

namespace {

volatile std::sig_atomic_t g_stop = 0;
void on_signal(int) { g_stop = 1; }

// What `rlloop serve`'s flags say (add_flags binds each field to its flag).
struct ServeFlags {
  std::string host = "127.0.0.1";
  int port = 8080;
  std::string data_dir = "rlloop-server-data";
  std::string tenants_file;
  std::vector<std::string> base_models;
  int world_size = 1, local_workers = -1;
  std::string rendezvous = "127.0.0.1:0", dp_backend = "auto", shard = "none";
  double dp_timeout_s = 60;
  std::string device = "auto", dtype = "auto", sampling_precision = "fp32", region = "us-east-1";
  int threads = 0, result_wait_ms = 0, max_batch_rows = 64, stats_interval_s = 10;
  std::int64_t kv_cache_mb = rlloop::LocalServiceOptions{}.kv_cache_mb;
  std::int64_t prefill_chunk_tokens = rlloop::LocalServiceOptions{}.prefill_chunk_tokens;
  // The server's own defaults.
  inline static const rlloop::server::Options kDefaults{};
  std::size_t io_threads = kDefaults.io_threads;
  std::size_t max_connections = kDefaults.max_connections;
  long long idle_timeout_ms = kDefaults.idle_timeout.count();
  std::size_t retain_results = kDefaults.retention.results;
  std::size_t retain_client_tokens = kDefaults.retention.client_tokens;
  long long result_retention_s = kDefaults.retention.result_age.count();
  long long client_token_retention_s = kDefaults.retention.client_token_age.count();
  std::size_t compact_records = kDefaults.compact_after_records;
  std::size_t compact_bytes = kDefaults.compact_after_bytes;
  std::size_t autosave_operations = kDefaults.autosave_after_operations;
  long long tinker_session_timeout_s = kDefaults.tinker_session_timeout.count();
  bool bill_prompt_per_sample = false;
  bool dequantize_base = false, activation_checkpointing = false, expert_parallel = false;
  // Set from a launcher's environment (launch_env.hpp), not by a flag.
  bool external_store = false;
  std::string store_prefix;
};

void add_flags(CLI::App& app, ServeFlags& f) {
  app.add_option("--host", f.host, "Address to listen on");
  app.add_option("--port", f.port, "Port to listen on (0 = any free port)")->check(CLI::Range(0, 65535));
  app.add_option(
      "--data-dir", f.data_dir,
      "Where checkpoints and the session journal are written; a restart on the same directory resumes its sessions");
  app.add_option("--region", f.region, "AWS region named in the ARNs the server issues (clients sign for any region)");
  app.add_option(
         "--result-wait-ms", f.result_wait_ms,
         "Get*OperationResult without ?waitSeconds= waits up to this long for the operation, and "
         "DescribeTrainingSession for a session still Creating (0 = answer at once)")
      ->check(CLI::Range(0, 20000));
  app.add_option("--tinker-session-timeout-s", f.tinker_session_timeout_s,
                 "A Tinker session without a heartbeat for this long is finished and its models stopped")
      ->check(CLI::Range(1LL, 86400LL));
  app.add_option("--tenants", f.tenants_file,
                 "Tenants JSON file (access keys, bearer keys, limits); required where this process serves (rank 0)");
  app.add_option("--base-model", f.base_models, "Catalogue entry NAME=MODEL_DIR (repeatable)");
  app.add_option("--device", f.device, "auto, cpu, cuda or cuda:N");
  app.add_option("--dtype", f.dtype,
                 "auto (bf16 on CUDA, fp32 on the CPU), fp32 or bf16: the models' arithmetic (bf16 full fine-tuning "
                 "keeps fp32 master weights)");
  app.add_option("--world-size", f.world_size,
                 "Ranks that train every session (data parallel): this process and world size - 1 workers. Without "
                 "it and --rendezvous, a launcher's RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (torchrun, Slurm, "
                 "PyTorchJob) say this process's part: rank 0 serves, the others work (docs/distributed.md)")
      ->check(CLI::Range(1, 1024));
  app.add_option("--rendezvous", f.rendezvous, "HOST:PORT where the workers join (port 0: any free port)");
  app.add_option("--dp-backend", f.dp_backend,
                 "The tensors' collectives across ranks: auto (NCCL when every rank here has a GPU of its own), gloo "
                 "(also several ranks on one GPU) or nccl")
      ->check(CLI::IsMember({"auto", "gloo", "nccl"}));
  app.add_option("--shard", f.shard,
                 "full: full fine-tuning sessions keep 1/world-size of their weights, gradients and optimizer state "
                 "on each rank, gathering a layer only while it computes (LoRA sessions stay replicated; sampling "
                 "takes saved sampler weights); none: every rank a replica")
      ->check(CLI::IsMember({"none", "full"}));
  app.add_flag("--expert-parallel", f.expert_parallel,
               "Mixture-of-Experts sessions hold 1/world-size of the experts on each rank, routed rows exchanged by "
               "all-to-all; they train, checkpoint and sample as on one rank (merged exports are refused)");
  app.add_option("--local-workers", f.local_workers,
                 "Workers started on this host (-1: all); the others run `rlloop worker` on other hosts");
  app.add_option("--dp-timeout-s", f.dp_timeout_s,
                 "A rank that does not answer within this fails the operation, naming the rank");
  app.add_option("--threads", f.threads, "LibTorch threads per process (0 = all cores); fix it for bit-exact replays")
      ->check(CLI::Range(0, 1024));
  app.add_option("--sampling-precision", f.sampling_precision,
                 "fp32, bf16 or int8: arithmetic of CPU sampling (bf16 is faster with AVX512_BF16, logprobs ~1e-2 off; "
                 "int8: a quantized base's 4/8-bit products in integers, logprobs ~0.05 off)")
      ->check(CLI::IsMember({"fp32", "bf16", "int8"}));
  app.add_flag("--dequantize-base", f.dequantize_base,
               "LoRA sessions on a .gguf base share it dequantized to fp32 (faster, 4 bytes per weight) instead of "
               "in its quantized blocks");
  app.add_flag("--activation-checkpointing", f.activation_checkpointing,
               "Training passes keep each layer's input only and recompute the layer in backward: less activation "
               "memory for long sequences, about one more forward per step");
  app.add_option(
         "--max-batch-rows", f.max_batch_rows,
         "Sample rows decoded in one step per base model, all sessions' requests together; more wait their turn")
      ->check(CLI::Range(1, 4096));
  app.add_option("--kv-cache-mb", f.kv_cache_mb,
                 "KV cache memory per base model, all sessions' sampling requests together (each counted at the most "
                 "its samples can take); more wait their turn; 0 = no limit but --max-batch-rows")
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{1} << 30));
  app.add_option("--prefill-chunk-tokens", f.prefill_chunk_tokens,
                 "Most prompt tokens prefilled per decoding step per base model, across the requests just admitted "
                 "(chunked prefill: a longer prompt takes several steps)")
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 30));
  app.add_option("--stats-interval-s", f.stats_interval_s,
                 "Print an {\"event\":\"engine\"} line per base model this often while it changes (0 = never)")
      ->check(CLI::Range(0, 24 * 3600));
  app.add_option("--io-threads", f.io_threads,
                 "Threads serving every connection's sockets (they do not grow with clients)")
      ->check(CLI::Range(1, 256));
  app.add_option("--max-connections", f.max_connections,
                 "Concurrent connections; one more is answered 503 ServiceUnavailableException and closed")
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--idle-timeout-ms", f.idle_timeout_ms,
                 "A keep-alive connection without a request is closed after this")
      ->check(CLI::Range(1LL, 24LL * 3600 * 1000));
  app.add_option("--retain-results", f.retain_results,
                 "Finished operations per session whose results stay retrievable (the most recent ones)")
      ->check(CLI::Range(std::size_t{0}, std::size_t{1} << 30));
  app.add_option("--result-retention-s", f.result_retention_s,
                 "Seconds a finished operation's result stays retrievable")
      ->check(CLI::Range(0LL, 366LL * 24 * 3600));
  app.add_option("--retain-client-tokens", f.retain_client_tokens,
                 "clientToken / Idempotency-Key records kept per session (the most recent ones)")
      ->check(CLI::Range(std::size_t{0}, std::size_t{1} << 30));
  app.add_option("--client-token-retention-s", f.client_token_retention_s,
                 "Seconds a clientToken / Idempotency-Key makes retries return the same operation")
      ->check(CLI::Range(0LL, 366LL * 24 * 3600));
  app.add_option("--compact-records", f.compact_records,
                 "Compact the journal once its log holds this many records since the last snapshot (0 = no bound)");
  app.add_option("--compact-bytes", f.compact_bytes,
                 "Compact the journal also once its log holds this many bytes and the snapshot's size (0 = no bound)");
  app.add_option("--autosave-operations", f.autosave_operations,
                 "Autosave a session also once this many forwardBackward / loadState operations completed since its "
                 "last autosave (besides every optimizerStep): a restart runs fewer than this many again (0 = only "
                 "at optimizerSteps)");
  app.add_flag("--bill-prompt-per-sample", f.bill_prompt_per_sample,
               "Bill a sample call's prompt once per sample (numSamples / n times) instead of once per call");
}

// The HTTP server's options, listening on `port` (the flag's, or after a restart the port the first server bound).
rlloop::server::Options server_options(const ServeFlags& f, std::uint16_t port) {
  rlloop::server::Options options;
  options.host = f.host;
  options.port = port;
  options.data_dir = f.data_dir;
  options.region = f.region;
  options.default_result_wait = std::chrono::milliseconds(f.result_wait_ms);
  options.tinker_session_timeout = std::chrono::seconds(f.tinker_session_timeout_s);
  options.tenants = rlloop::server::load_tenants(f.tenants_file);
  options.bill_prompt_per_sample = f.bill_prompt_per_sample;
  options.io_threads = f.io_threads;
  options.max_connections = f.max_connections;
  options.idle_timeout = std::chrono::milliseconds(f.idle_timeout_ms);
  options.retention.results = f.retain_results;
  options.retention.result_age = std::chrono::seconds(f.result_retention_s);
  options.retention.client_tokens = f.retain_client_tokens;
  options.retention.client_token_age = std::chrono::seconds(f.client_token_retention_s);
  options.compact_after_records = f.compact_records;
  options.compact_after_bytes = f.compact_bytes;
  options.autosave_after_operations = f.autosave_operations;
  return options;
}

// The engine's options: checkpoints under the data directory, workers started from this executable.
rlloop::LocalServiceOptions engine_options(const ServeFlags& f) {
  rlloop::LocalServiceOptions local;
  local.checkpoint_dir = (std::filesystem::path(f.data_dir) / "checkpoints").string();
  local.device = f.device;
  local.dtype = f.dtype;
  local.sampling_precision = rlloop::sampling_precision_from(f.sampling_precision);
  local.max_batch_rows = f.max_batch_rows;
  local.kv_cache_mb = f.kv_cache_mb;
  local.prefill_chunk_tokens = f.prefill_chunk_tokens;
  local.quantized_base = !f.dequantize_base;
  local.activation_checkpointing = f.activation_checkpointing;
  local.base_models = rlloop::cli::parse_base_models(f.base_models);
  local.data_parallel.world_size = f.world_size;
  local.data_parallel.rendezvous = f.rendezvous;
  local.data_parallel.backend = f.dp_backend;
  local.data_parallel.local_workers = f.local_workers;
  local.data_parallel.expert_parallel = f.expert_parallel;
  local.data_parallel.shard = f.shard;
  local.data_parallel.timeout_s = f.dp_timeout_s;
  local.data_parallel.worker_program = "/proc/self/exe";
  local.data_parallel.external_store = f.external_store;
  local.data_parallel.store_prefix = f.store_prefix;
  return local;
}

// A rank a launcher started: the group's shape and store from its environment, the other ranks started by it. Its
// rank 0 connects to the launcher's store when the launcher hosts one (torchrun's agent) and hosts it otherwise.
void follow_launcher(ServeFlags& f, const rlloop::cli::LaunchedRank& launched) {
  f.world_size = launched.world_size;
  f.rendezvous = launched.rendezvous;
  f.local_workers = 0;
  f.store_prefix = launched.store_prefix;
  f.external_store = launched.agent_store;
  // LibTorch 1.13's store client cannot talk to a torch 2.x store server (torchrun's agent), which drops a client
  // that does not first send the validation message 2.x added: there rank 0 hosts the group's own store on the
  // port after the agent's.
  if (f.external_store && rlloop::engine_info("cpu").libtorch_version.starts_with("1.")) {
    f.external_store = false;
    const auto colon = launched.rendezvous.rfind(':');
    const int port = std::stoi(launched.rendezvous.substr(colon + 1));
    if (port == 65535) throw rlloop::invalid_argument("MASTER_PORT=65535 leaves no next port for the group's store");
    f.rendezvous = launched.rendezvous.substr(0, colon + 1) + std::to_string(port + 1);
  }
  // One GPU per rank on a host, as torchrun's LOCAL_RANK numbers them.
  if (f.device == "auto" && rlloop::engine_info("auto").cuda_available)
    f.device = "cuda:" + std::to_string(launched.local_rank);
}

// Ranks other than 0 of a launched group: `rlloop worker` with serve's flags (the ones every rank shares).
int work_as_launched(const ServeFlags& f, const rlloop::cli::LaunchedRank& launched) {
  rlloop::DataParallelWorkerOptions options;
  options.rendezvous = f.rendezvous;  // follow_launcher's choice of store
  options.rank = launched.rank;
  options.world_size = launched.world_size;
  options.timeout_s = f.dp_timeout_s;
  options.service = engine_options(f);
  std::printf("%s\n", nlohmann::json{{"event", "worker"}, {"rank", launched.rank}, {"launcher", launched.launcher},
                                     {"rendezvous", f.rendezvous}, {"shard", options.service.data_parallel.shard}}
                         .dump()
                         .c_str());
  std::fflush(stdout);
  rlloop::run_data_parallel_worker(options);
  return 0;
}

// One {"event":"engine"} line per base model, unless they say what the last call printed (`last`).
void report_stats(const rlloop::LocalService& service, std::string& last) {
  std::string lines;
  for (const auto& b : service.base_model_stats())
    lines += nlohmann::json{{"event", "engine"},
                            {"base", b.base},
                            {"sessions", b.sessions},
                            {"sharedWeightUsers", b.shared_weight_users},
                            {"sharedWeightBytes", b.shared_weight_bytes},
                            {"activeRequests", b.active_requests},
                            {"batchRows", b.active_rows},
                            {"queuedOperations", b.queued_operations},
                            {"peakBatchRows", b.peak_batch_rows},
                            {"peakBatchRequests", b.peak_batch_requests},
                            {"kvReservedBytes", b.kv_reserved_bytes},
                            {"peakKvReservedBytes", b.peak_kv_reserved_bytes},
                            {"decodeSteps", b.decode_steps}}
                 .dump() +
             "\n";
  if (lines == last) return;
  std::fputs(lines.c_str(), stdout);
  std::fflush(stdout);
  last = std::move(lines);
}

// Serves until SIGINT/SIGTERM (returns an empty string) or until the data-parallel group fails (returns why; the
// caller starts a new server). Listens on `port`; on return it holds the port this server bound.
std::string serve(const ServeFlags& f, std::uint16_t& port) {
  const auto options = server_options(f, port);
  const auto local = engine_options(f);
  std::filesystem::create_directories(local.checkpoint_dir);
  auto service = std::make_shared<rlloop::LocalService>(local);
  rlloop::server::Server server(options, rlloop::server::make_backend(service));
  server.start();
  port = server.port();
  std::printf("{\"event\":\"listening\",\"host\":\"%s\",\"port\":%u,\"tenants\":%zu}\n", f.host.c_str(), port,
              options.tenants.size());
  std::fflush(stdout);
  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
  auto next_report = std::chrono::steady_clock::now();
  std::string last_report, failure;
  while (!g_stop && failure.empty()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (f.stats_interval_s > 0 && std::chrono::steady_clock::now() >= next_report) {
      report_stats(*service, last_report);
      next_report += std::chrono::seconds(f.stats_interval_s);
    }
    failure = service->data_parallel_failure();
  }
  server.stop();
  return failure;
}

// A failed data-parallel group cannot be mended in place (its peer vanished mid-collective): the server starts
// again in this process, on the port it had bound and the same data directory, once serve() has returned and
// every object of the old one is gone (its group closed, its workers reaped). Crash recovery brings every session
// back from its last autosave plus the operations acknowledged since, with a new group. The operation that met the
// failure was answered Failed with the error naming the rank; the client retries it.
int run_serve(int argc, char** argv) {
  CLI::App app{"Serve the training-session API (SageMaker shape) for the tenants of a tenants file", "rlloop serve"};
  ServeFlags flags;
  add_flags(app, flags);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  rlloop::configure_engine_process({.num_threads = flags.threads});  // once per process
  std::optional<rlloop::cli::LaunchedRank> launched;
  if (app.count("--world-size") == 0 && app.count("--rendezvous") == 0) launched = rlloop::cli::launched_rank();
  if (launched) {
    follow_launcher(flags, *launched);
    if (launched->rank != 0) return work_as_launched(flags, *launched);
  }
  if (flags.tenants_file.empty()) throw rlloop::invalid_argument("--tenants is required where this process serves");
  auto port = static_cast<std::uint16_t>(flags.port);
  for (;;) {
    const std::string failure = serve(flags, port);
    if (failure.empty() || g_stop) return 0;  // a signal during the failed run ends the process instead
    // A launcher's ranks exit with the failed group; the launcher starts them all again (torchrun --max-restarts,
    // a PyTorchJob's restart policy), and the new rank 0 recovers the sessions from the data directory.
    const char* event = launched ? "data_parallel_failed" : "data_parallel_restart";
    std::printf("%s\n", nlohmann::json{{"event", event}, {"reason", failure}}.dump().c_str());
    std::fflush(stdout);
    if (launched) return 1;
  }
}

const rlloop::cli::RegisterCommand registration{
    {"serve", "serve the training-session API over HTTP (rlloop-server)", run_serve}};

}  // namespace
