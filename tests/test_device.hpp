// The device and dtype the engine tests run on, from the environment: RLLOOP_TEST_DEVICE (cpu, cuda, cuda:N;
// default cpu) and RLLOOP_TEST_DTYPE (fp32, bf16 or auto = the engine's own choice: bf16 on CUDA, fp32 on the CPU).
// The GPU bundle's run.sh (scripts/gpu_bundle.sh) runs the device-aware tests with RLLOOP_TEST_DEVICE=cuda; CI runs
// them on the CPU.
#pragma once
#include <cstdlib>
#include <stdexcept>
#include <string>

namespace rlloop::test_device {

inline std::string env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::string(v) : std::string(fallback);
}

inline std::string device() { return env_or("RLLOOP_TEST_DEVICE", "cpu"); }

inline bool on_cuda() { return device().rfind("cuda", 0) == 0; }

// "fp32" or "bf16", the value LocalServiceOptions::dtype takes.
inline std::string dtype() {
  const std::string d = env_or("RLLOOP_TEST_DTYPE", "auto");
  if (d == "auto") return on_cuda() ? "bf16" : "fp32";
  if (d != "fp32" && d != "bf16")
    throw std::invalid_argument("RLLOOP_TEST_DTYPE: expected fp32, bf16 or auto, got '" + d + "'");
  return d;
}

// The configuration whose exact figures (bit-exact batching, the CPU decoder's options) most tests were written for.
inline bool cpu_fp32() { return !on_cuda() && dtype() == "fp32"; }

// How far two computations of one log-probability may be apart when they round differently (another kernel, another
// order of a sum, cached keys and values against a full forward, adapters merged into the weights): fp32's is the
// engine tests' long-standing bound; bf16's is its significand's relative rounding, 2^-8, over a log-probability of
// a few nats (measured on the CPU with RLLOOP_TEST_DTYPE=bf16: engine_session_test's differences up to 0.002).
inline double logprob_tolerance() { return dtype() == "bf16" ? 0.02 : 1e-4; }

// Where the device-aware tests find the source tree's files and the rlloop program: RLLOOP_SOURCE_DIR and
// RLLOOP_PROGRAM from the environment when set (the GPU bundle's run.sh: its binaries run on another machine, far from
// the build), else the paths CMake compiled in.
#ifdef RLLOOP_SOURCE_DIR
inline std::string source_dir() { return env_or("RLLOOP_SOURCE_DIR", RLLOOP_SOURCE_DIR); }
#endif
#ifdef RLLOOP_BIN
inline std::string rlloop_program() { return env_or("RLLOOP_PROGRAM", RLLOOP_BIN); }
#endif

}  // namespace rlloop::test_device
