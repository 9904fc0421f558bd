// `rlloop serve`: rlloop-server hosting LocalService sessions for the tenants of a tenants file.
#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <rlloop/error.hpp>

#include "command.hpp"
#include "server/server.hpp"
#ifdef RLLOOP_HAVE_ENGINE
#include <rlloop/local.hpp>
#endif

namespace {

volatile std::sig_atomic_t g_stop = 0;
void on_signal(int) { g_stop = 1; }

int run_serve(int argc, char** argv) {
  CLI::App app{"Serve the training-session API (SageMaker shape) for the tenants of a tenants file", "rlloop serve"};
  std::string host = "127.0.0.1";
  int port = 8080;
  std::string data_dir = "rlloop-server-data";
  std::string tenants_file;
  std::vector<std::string> base_models;
  std::string device = "auto", sampling_precision = "fp32", region = "us-east-1";
  int threads = 0, result_wait_ms = 0, max_batch_rows = 64, stats_interval_s = 10;
  rlloop::server::Options defaults;
  std::size_t io_threads = defaults.io_threads, max_connections = defaults.max_connections;
  long long idle_timeout_ms = defaults.idle_timeout.count();
  std::size_t retain_results = defaults.retention.results, retain_client_tokens = defaults.retention.client_tokens;
  long long result_retention_s = defaults.retention.result_age.count(),
            client_token_retention_s = defaults.retention.client_token_age.count();
  std::size_t compact_records = defaults.compact_after_records, compact_bytes = defaults.compact_after_bytes;
  bool bill_prompt_per_sample = false;
  app.add_option("--host", host, "Address to listen on");
  app.add_option("--port", port, "Port to listen on (0 = any free port)")->check(CLI::Range(0, 65535));
  app.add_option(
      "--data-dir", data_dir,
      "Where checkpoints and the session journal are written; a restart on the same directory resumes its sessions");
  app.add_option("--region", region, "AWS region named in the ARNs the server issues (clients sign for any region)");
  app.add_option(
         "--result-wait-ms", result_wait_ms,
         "Get*OperationResult without ?waitSeconds= waits up to this long for the operation (0 = answer at once)")
      ->check(CLI::Range(0, 20000));
  app.add_option("--tenants", tenants_file, "Tenants JSON file (access keys, bearer keys, limits)")->required();
  app.add_option("--base-model", base_models, "Catalogue entry NAME=MODEL_DIR (repeatable)");
  app.add_option("--device", device, "auto, cpu, cuda or cuda:N");
  app.add_option("--threads", threads, "LibTorch threads per process (0 = all cores); fix it for bit-exact replays")
      ->check(CLI::Range(0, 1024));
  app.add_option("--sampling-precision", sampling_precision,
                 "fp32 or bf16: arithmetic of CPU sampling (bf16 is faster with AVX512_BF16; logprobs ~1e-2 off)")
      ->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_option(
         "--max-batch-rows", max_batch_rows,
         "Sample rows decoded in one step per base model, all sessions' requests together; more wait their turn")
      ->check(CLI::Range(1, 4096));
  app.add_option("--stats-interval-s", stats_interval_s,
                 "Print an {\"event\":\"engine\"} line per base model this often while it changes (0 = never)")
      ->check(CLI::Range(0, 24 * 3600));
  app.add_option("--io-threads", io_threads,
                 "Threads serving every connection's sockets (they do not grow with clients)")
      ->check(CLI::Range(1, 256));
  app.add_option("--max-connections", max_connections,
                 "Concurrent connections; one more is answered 503 ServiceUnavailableException and closed")
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--idle-timeout-ms", idle_timeout_ms, "A keep-alive connection without a request is closed after this")
      ->check(CLI::Range(1LL, 24LL * 3600 * 1000));
  app.add_option("--retain-results", retain_results,
                 "Finished operations per session whose results stay retrievable (the most recent ones)")
      ->check(CLI::Range(std::size_t{0}, std::size_t{1} << 30));
  app.add_option("--result-retention-s", result_retention_s, "Seconds a finished operation's result stays retrievable")
      ->check(CLI::Range(0LL, 366LL * 24 * 3600));
  app.add_option("--retain-client-tokens", retain_client_tokens,
                 "clientToken / Idempotency-Key records kept per session (the most recent ones)")
      ->check(CLI::Range(std::size_t{0}, std::size_t{1} << 30));
  app.add_option("--client-token-retention-s", client_token_retention_s,
                 "Seconds a clientToken / Idempotency-Key makes retries return the same operation")
      ->check(CLI::Range(0LL, 366LL * 24 * 3600));
  app.add_option("--compact-records", compact_records,
                 "Compact the journal once its log holds this many records since the last snapshot (0 = no bound)");
  app.add_option("--compact-bytes", compact_bytes,
                 "Compact the journal also once its log holds this many bytes and the snapshot's size (0 = no bound)");
  app.add_flag("--bill-prompt-per-sample", bill_prompt_per_sample,
               "Bill a sample call's prompt once per sample (numSamples / n times) instead of once per call");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  rlloop::server::Options options;
  options.host = host;
  options.port = static_cast<std::uint16_t>(port);
  options.data_dir = data_dir;
  options.region = region;
  options.default_result_wait = std::chrono::milliseconds(result_wait_ms);
  options.tenants = rlloop::server::load_tenants(tenants_file);
  options.bill_prompt_per_sample = bill_prompt_per_sample;
  options.io_threads = io_threads;
  options.max_connections = max_connections;
  options.idle_timeout = std::chrono::milliseconds(idle_timeout_ms);
  options.retention.results = retain_results;
  options.retention.result_age = std::chrono::seconds(result_retention_s);
  options.retention.client_tokens = retain_client_tokens;
  options.retention.client_token_age = std::chrono::seconds(client_token_retention_s);
  options.compact_after_records = compact_records;
  options.compact_after_bytes = compact_bytes;

#ifdef RLLOOP_HAVE_ENGINE
  rlloop::LocalServiceOptions local;
  local.checkpoint_dir = (std::filesystem::path(data_dir) / "checkpoints").string();
  local.device = device;
  local.num_threads = threads;
  local.sampling_precision = rlloop::sampling_precision_from(sampling_precision);
  local.max_batch_rows = max_batch_rows;
  for (const auto& entry : base_models) {
    const auto eq = entry.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == entry.size())
      throw rlloop::invalid_argument("--base-model expects NAME=MODEL_DIR, got '" + entry + "'");
    local.base_models.emplace_back(entry.substr(0, eq), entry.substr(eq + 1));
  }
  std::filesystem::create_directories(local.checkpoint_dir);
  auto service = std::make_shared<rlloop::LocalService>(local);
  auto backend = rlloop::server::make_backend(service);
  auto report_stats = [service, last = std::string()]() mutable {
    std::string lines;
    for (const auto& b : service->base_model_stats())
      lines += nlohmann::json{{"event", "engine"},
                              {"base", b.base},
                              {"sessions", b.sessions},
                              {"sharedWeightUsers", b.shared_weight_users},
                              {"activeRequests", b.active_requests},
                              {"batchRows", b.active_rows},
                              {"queuedOperations", b.queued_operations},
                              {"peakBatchRows", b.peak_batch_rows},
                              {"peakBatchRequests", b.peak_batch_requests},
                              {"decodeSteps", b.decode_steps}}
                   .dump() +
               "\n";
    if (lines == last) return;
    std::fputs(lines.c_str(), stdout);
    std::fflush(stdout);
    last = std::move(lines);
  };
#else
  (void)base_models;
  (void)device;
  (void)threads;
  (void)max_batch_rows;
  auto report_stats = [] {};
  throw rlloop::unsupported(
      "this build has no training engine (configured with RLLOOP_WITH_TORCH=OFF); rebuild with it ON to serve");
  rlloop::server::Backend backend;
#endif

  rlloop::server::Server server(options, backend);
  server.start();
  std::printf("{\"event\":\"listening\",\"host\":\"%s\",\"port\":%u,\"tenants\":%zu}\n", host.c_str(), server.port(),
              options.tenants.size());
  std::fflush(stdout);
  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
  auto next_report = std::chrono::steady_clock::now();
  while (!g_stop) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (stats_interval_s > 0 && std::chrono::steady_clock::now() >= next_report) {
      report_stats();
      next_report += std::chrono::seconds(stats_interval_s);
    }
  }
  server.stop();
  return 0;
}

const rlloop::cli::RegisterCommand registration{
    {"serve", "serve the training-session API over HTTP (rlloop-server)", run_serve}};

}  // namespace
