// configure_engine_process: the process-wide settings, applied only where a program asks for them.
#include <rlloop/local.hpp>

#include "kernels/cpu_allocator.hpp"
#include "kernels/device.hpp"
#include "kernels/simd.hpp"

namespace rlloop {

EngineProcessOptions configure_engine_process(const EngineProcessOptions& options) {
  (void)engine::simd::kernel_level();  // a bad RLLOOP_CPU_KERNELS is an error here, not inside a kernel
  EngineProcessOptions in_effect;
  in_effect.num_threads = engine::configure_threads(options.num_threads);
  if (options.caching_cpu_allocator) engine::install_caching_cpu_allocator();
  in_effect.caching_cpu_allocator = engine::installed_caching_cpu_allocator() != nullptr;
  return in_effect;
}

}  // namespace rlloop
