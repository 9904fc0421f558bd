// `rlloop info`: version, LibTorch, device, threads and BLAS of this build.
#include <cstdio>

#include <CLI/CLI.hpp>

#include <rlloop/local.hpp>

#include "command.hpp"

namespace {
int run(int argc, char** argv) {
  CLI::App app{"Print what rlloop runs on: version, LibTorch version, device, threads, BLAS."};
  std::string device = "auto";
  int threads = 0;
  app.add_option("--device", device, "auto, cpu, cuda or cuda:N");
  app.add_option("--threads", threads, "LibTorch threads, as `rlloop serve --threads` takes them (0 = all cores)")
      ->check(CLI::Range(0, 1024));
  CLI11_PARSE(app, argc, argv);
  rlloop::configure_engine_process({.num_threads = threads});  // what `rlloop serve` and `rlloop sample` run with
  const auto info = rlloop::engine_info(device);
  std::printf("rlloop        %s\n", RLLOOP_VERSION);
  std::printf("libtorch      %s\n", info.libtorch_version.c_str());
  std::printf("device        %s (%s)\n", info.device.c_str(), info.dtype.c_str());
  std::printf("cuda          %s\n", info.cuda_available ? "available" : "not available");
  std::printf("threads       %d (%d ran a parallel region of the engine)\n", info.threads, info.parallel_threads);
  std::printf("blas          %s\n", info.blas.c_str());
  std::printf("cpu kernels   %s\n", info.cpu_kernels.c_str());
  return 0;
}
const rlloop::cli::RegisterCommand reg({"info", "version, LibTorch, device, threads and BLAS", &run});
}  // namespace
