#include "device.hpp"

#include <cstdlib>
#include <mutex>
#include <set>
#include <thread>

#include <ATen/Parallel.h>

#include <rlloop/error.hpp>

namespace rlloop::engine {

DeviceChoice choose_device(const std::string& spec) {
  if (spec == "cpu") return {torch::Device(torch::kCPU), torch::kFloat32};
  const bool want_cuda = spec.rfind("cuda", 0) == 0;
  if (spec != "auto" && !want_cuda)
    throw invalid_argument("device must be auto, cpu, cuda or cuda:N, got '" + spec + "'");
  if (torch::cuda::is_available())
    return {torch::Device(spec == "auto" ? std::string("cuda") : spec), torch::kBFloat16};
  if (want_cuda) throw unsupported("device '" + spec + "' requested but this LibTorch build has no usable CUDA");
  return {torch::Device(torch::kCPU), torch::kFloat32};
}

int configure_threads(int requested) {
  int n = requested;
  if (n <= 0)
    if (const char* env = std::getenv("OMP_NUM_THREADS")) n = std::atoi(env);
  if (n <= 0) n = static_cast<int>(std::thread::hardware_concurrency());
  if (n <= 0) n = 1;
  at::set_num_threads(n);
  return n;
}

int threads_in_parallel_region(int items) {
  std::mutex mutex;
  std::set<std::thread::id> seen;
  at::parallel_for(0, items, 1, [&](std::int64_t, std::int64_t) {
    std::lock_guard lock(mutex);
    seen.insert(std::this_thread::get_id());
  });
  return static_cast<int>(seen.size());
}

std::string device_name(const torch::Device& d) { return d.str(); }

}  // namespace rlloop::engine
