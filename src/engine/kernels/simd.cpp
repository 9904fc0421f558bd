// The kernels' instruction-set level: what the CPU supports, capped by RLLOOP_CPU_KERNELS.
#include <cstdlib>
#include <string>

#include <rlloop/error.hpp>

#include "kernels/simd.hpp"

namespace rlloop::engine::simd {

namespace {

KernelLevel cpu_level() {
#if RLLOOP_SIMD_X86
  if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) return KernelLevel::portable;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bf16"))
    return KernelLevel::avx512_bf16;
  return KernelLevel::avx2;
#else
  return KernelLevel::portable;
#endif
}

}  // namespace

const char* to_string(KernelLevel level) {
  switch (level) {
    case KernelLevel::portable:
      return "portable";
    case KernelLevel::avx2:
      return "avx2";
    case KernelLevel::avx512_bf16:
      return "avx512_bf16";
  }
  return "?";
}

KernelLevel detect_kernel_level() {
  const KernelLevel supported = cpu_level();
  const char* cap = std::getenv("RLLOOP_CPU_KERNELS");
  if (!cap || !*cap || std::string(cap) == "native") return supported;
  for (KernelLevel level : {KernelLevel::portable, KernelLevel::avx2, KernelLevel::avx512_bf16})
    if (cap == std::string(to_string(level))) return level < supported ? level : supported;
  throw invalid_argument(std::string("RLLOOP_CPU_KERNELS: unknown kernel level '") + cap +
                         "' (expected native, avx512_bf16, avx2 or portable)");
}

}  // namespace rlloop::engine::simd
