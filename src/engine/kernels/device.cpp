#include "kernels/device.hpp"

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <rlloop/error.hpp>

namespace rlloop::engine {

namespace {
DeviceChoice with_dtype(torch::Device device, const std::string& dtype) {
  if (dtype == "fp32" || dtype == "float32") return {device, torch::kFloat32};
  if (dtype == "bf16" || dtype == "bfloat16") return {device, torch::kBFloat16};
  if (dtype != "auto") throw invalid_argument("dtype must be auto, fp32 or bf16, got '" + dtype + "'");
  return {device, device.is_cuda() ? torch::kBFloat16 : torch::kFloat32};
}
}  // namespace

DeviceChoice choose_device(const std::string& spec, const std::string& dtype) {
  if (spec == "cpu") return with_dtype(torch::Device(torch::kCPU), dtype);
  const bool want_cuda = spec.rfind("cuda", 0) == 0;
  if (spec != "auto" && !want_cuda)
    throw invalid_argument("device must be auto, cpu, cuda or cuda:N, got '" + spec + "'");
  if (torch::cuda::is_available())
    return with_dtype(torch::Device(spec == "auto" ? std::string("cuda") : spec), dtype);
  if (want_cuda) throw unsupported("device '" + spec + "' requested but this LibTorch build has no usable CUDA");
  return with_dtype(torch::Device(torch::kCPU), dtype);
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

torch::Tensor to_host(const torch::Tensor& t) {
  RECORD_USER_SCOPE(kToHostScope);
  return t.cpu();
}

torch::Tensor to_device(const torch::Tensor& host, torch::Device device) {
  return device.is_cpu() ? host : host.pin_memory().to(device, /*non_blocking=*/true);
}

double peak_flops(const torch::Device& device, torch::ScalarType dtype) {
  if (const char* env = std::getenv("RLLOOP_PEAK_TFLOPS")) {
    char* end = nullptr;
    const double tflops = std::strtod(env, &end);
    if (end == env || *end != '\0' || !(tflops > 0) || !std::isfinite(tflops))
      throw invalid_argument(std::string("RLLOOP_PEAK_TFLOPS: expected a positive number of TFLOP/s, got '") + env +
                             "'");
    return tflops * 1e12;
  }
  static std::mutex mu;
  static std::map<std::pair<std::string, int>, double> measured;
  std::lock_guard lock(mu);
  const auto key = std::make_pair(device.str(), static_cast<int>(dtype));
  if (auto it = measured.find(key); it != measured.end()) return it->second;
  // Large enough to run at the library's full rate on every core, small enough to cost milliseconds on a CPU.
  const std::int64_t n = device.is_cuda() ? 4096 : 384;
  torch::NoGradGuard no_grad;
  const auto opts = torch::TensorOptions().device(device).dtype(dtype);
  // Constant operands: the rate does not depend on the values, and torch::rand would advance the global
  // generator, which the caller's own code may have seeded.
  const auto a = torch::full({n, n}, 0.5, opts), b = torch::full({n, n}, 0.25, opts);
  auto c = torch::mm(a, b);  // warm-up: thread pools, kernels chosen
  double best = 0;
  for (int i = 0; i < 5; ++i) {
    if (device.is_cuda()) torch::cuda::synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    for (int k = 0; k < 4; ++k) c = torch::mm(a, b);
    if (device.is_cuda()) torch::cuda::synchronize();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, 4 * 2.0 * static_cast<double>(n * n * n) / s);
  }
  return measured[key] = best;
}

}  // namespace rlloop::engine
