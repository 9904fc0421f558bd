// Device, dtype and thread-count choices for the engine.
#pragma once
#include <string>

#include <torch/torch.h>

namespace rlloop::engine {

struct DeviceChoice {
  torch::Device device{torch::kCPU};
  torch::ScalarType dtype = torch::kFloat32;  // CUDA: bf16; CPU: fp32 (CPU bf16 is slow and inaccurate here)
  // A GGUF base that LoRA sessions share keeps its matrices quantized (fp32 on the CPU only: gguf_model.hpp).
  bool quantized_base = true;
  // Sessions' models recompute each layer in backward instead of keeping its activations
  // (Transformer::set_activation_checkpointing; LocalServiceOptions::activation_checkpointing).
  bool activation_checkpointing = false;
};

// "auto" picks CUDA when this LibTorch build has it and a GPU is visible; "cpu", "cuda", "cuda:N" force one.
// dtype: "auto" (bf16 on CUDA, fp32 on the CPU), "fp32" or "bf16" (LocalServiceOptions::dtype).
DeviceChoice choose_device(const std::string& spec, const std::string& dtype = "auto");

// Sets LibTorch's intra-op thread count and returns it: `requested` if > 0, else OMP_NUM_THREADS if set, else
// the number of cores (LibTorch here defaults to 1 thread, leaving half the machine idle). The public entry is
// configure_engine_process.
int configure_threads(int requested);

// How many distinct threads run an at::parallel_for over `items` single-item chunks compiled in the engine.
// parallel_for is a header template, serial in any translation unit built without OpenMP whatever LibTorch's
// thread count says; this is how `rlloop info` and the tests see that the engine's kernels really split.
int threads_in_parallel_region(int items);

std::string device_name(const torch::Device& d);

// `t` on the host, for code that reads it there: the engine's one sanctioned way back from the device, so that every
// copy (and the wait for the device it implies on CUDA) is visible. It runs inside a RecordFunction scope named
// kToHostScope, which tests/engine_model/host_sync_test.cpp counts: a decoding step makes exactly one such copy, and
// on CUDA no device-to-host copy outside one.
inline constexpr const char* kToHostScope = "rlloop::to_host";
torch::Tensor to_host(const torch::Tensor& t);
// A (small) host tensor on `device` without making the host wait: to a GPU through pinned memory, so the copy is
// queued behind the kernels before it instead of synchronising with them; on the CPU `host` itself.
torch::Tensor to_device(const torch::Tensor& host, torch::Device device);

// The peak FLOP/s of one such device for products in `dtype`: RLLOOP_PEAK_TFLOPS (in TFLOP/s) when set, else
// measured once per process and device as the best rate of a few square matrix products through the library the
// engine's products use (so a CPU's figure is what its BLAS reaches on the cores LibTorch runs on, not a
// datasheet's). An unreadable RLLOOP_PEAK_TFLOPS throws invalid_argument naming it.
double peak_flops(const torch::Device& device, torch::ScalarType dtype);

}  // namespace rlloop::engine
