#include <fstream>
#include <string>

#include <ATen/Parallel.h>

#include <rlloop/local.hpp>

#include "kernels/device.hpp"
#include "kernels/simd.hpp"

namespace rlloop {
namespace {
// LibTorch's build config only says "BLAS_INFO=open"; which library actually serves the calls depends on the
// Debian alternatives, so read the loaded libraries from /proc/self/maps.
std::string loaded_blas() {
  std::ifstream maps("/proc/self/maps");
  std::string line, found;
  while (std::getline(maps, line)) {
    const auto slash = line.find('/');
    if (slash == std::string::npos) continue;
    const std::string path = line.substr(slash);
    if (path.find("openblas") != std::string::npos || path.find("libblas") != std::string::npos ||
        path.find("mkl") != std::string::npos) {
      found = path;
      if (path.find("openblas") != std::string::npos) break;
    }
  }
  return found.empty() ? "unknown" : found;
}
}  // namespace

EngineInfo engine_info(const std::string& device) {
  EngineInfo info;
  info.libtorch_version = TORCH_VERSION;
  auto choice = engine::choose_device(device);
  info.device = engine::device_name(choice.device);
  info.dtype = choice.dtype == torch::kBFloat16 ? "bfloat16" : "float32";
  info.threads = at::get_num_threads();
  info.parallel_threads = engine::threads_in_parallel_region(info.threads);
  // Touch BLAS once so that a lazily loaded library shows up in the process map.
  (void)torch::matmul(torch::ones({2, 2}), torch::ones({2, 2})).sum().item<float>();
  info.blas = loaded_blas();
  info.cpu_kernels = engine::simd::to_string(engine::simd::kernel_level());
  info.cuda_available = torch::cuda::is_available();
  return info;
}

}  // namespace rlloop
