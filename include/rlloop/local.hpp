// The local backend: a LibTorch session in this process (CUDA bf16 when the LibTorch build has CUDA, CPU fp32
// otherwise). This header does not include LibTorch; link rlloop::engine.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <rlloop/session.hpp>

namespace rlloop {

// The arithmetic of CPU sampling (LocalServiceOptions::sampling_precision).
enum class SamplingPrecision { fp32, bf16, int8 };

// "fp32", "bf16" or "int8" (command lines, config files); anything else is an invalid_argument naming the value.
inline SamplingPrecision sampling_precision_from(const std::string& name) {
  if (name == "fp32") return SamplingPrecision::fp32;
  if (name == "bf16") return SamplingPrecision::bf16;
  if (name == "int8") return SamplingPrecision::int8;
  throw invalid_argument("sampling_precision: unknown value '" + name + "' (expected fp32, bf16 or int8)");
}

// Data parallelism: a service whose sessions train on `world_size` ranks, this process being rank 0 (the one the
// clients talk to) and the others `rlloop worker` processes, here or on other hosts, joined over LibTorch's c10d
// (Gloo; NCCL for CUDA weights). Every rank holds a replica of each session; training batches are split across
// the ranks by token count and the gradients summed before each optimizer step, so the session computes what it
// would on one rank, within floating-point reassociation. Sampling and logprobs run on rank 0.
struct DataParallelOptions {
  int world_size = 1;  // 1: no other ranks
  // Where rank 0's rendezvous store listens, "HOST:PORT"; workers on other hosts connect there. Port 0 picks a
  // free port (fine when every worker is local).
  std::string rendezvous = "127.0.0.1:0";
  // Workers the service starts itself on this host, as ranks 1..local_workers; -1: all of them
  // (world_size - 1). Ranks above run elsewhere: `rlloop worker --rendezvous HOST:PORT --rank R ...`.
  int local_workers = -1;
  // The rlloop executable whose `worker` command the local workers run.
  std::string worker_program;
  // A rendezvous, or a collective (one step of an operation between ranks), not done within this fails with
  // group_failure naming the ranks that stopped answering.
  double timeout_s = 60;
  // What carries the tensors' collectives: "gloo", "nccl" (CUDA weights, one GPU per rank) or "auto": NCCL where
  // the weights are on CUDA, LibTorch has it and every rank on this host gets a GPU of its own (ranks r on
  // cuda:(N + r) mod GPUs); Gloo otherwise, which also takes CUDA tensors, so that the group runs with several
  // ranks on one GPU (tests, a one-GPU machine). The byte messages always go through Gloo.
  std::string backend = "auto";
  // Expert parallelism inside the group: a session on a Mixture-of-Experts model holds on rank r of W only experts
  // [r E / W, (r + 1) E / W) of every sparse layer, and each layer's routed rows travel by all-to-all to the rank
  // that holds their expert (W must divide the experts). Training (forward, forward_backward, the custom loss,
  // optim_step) and checkpoints (gathered on rank 0, in the layout of one rank's) work as without it, and give the
  // same losses, gradients and weights; sample and compute_logprobs run on every rank in step (the session's
  // sampling requests queued together decode as one batch, not with other sessions' requests); merged-model exports
  // are refused (adapter exports work: rank 0 holds every adapter). Dense models ignore it.
  // Every rank must be started with the same setting (the rendezvous refuses a rank that differs).
  bool expert_parallel = false;
  // For ranks a cluster launcher started (docs/distributed.md): the store at `rendezvous` is hosted by a process
  // that outlives the group (torchrun's elastic agent), so rank 0 connects to it as the workers do instead of
  // opening it; and every key the group writes there goes under `store_prefix` (each attempt of a restarted job
  // takes its own; workers give the same one). Empty prefix: none.
  bool external_store = false;
  std::string store_prefix;
  // "full": fully sharded data parallelism (docs/distributed.md) for the full fine-tuning sessions of dense models:
  // each rank keeps 1/W of their weights, gradients and optimizer state, and gathers a layer only while it
  // computes. They train as replicated sessions do; save_state writes the checkpoint one rank would and load_state
  // reads one from any world size; sample and compute_logprobs take saved sampler weights (a model path), not the
  // live ones, and exports are refused. LoRA sessions stay replicated (as their shared base does); sessions with a
  // value head or on a Mixture-of-Experts model are refused. "none" (the default): every rank a replica. Every rank
  // must be started with the same setting.
  std::string shard = "none";
};

struct LocalServiceOptions {
  // Where save_state / save_weights_for_sampler write ("<checkpoint_dir>/<name>/").
  std::string checkpoint_dir = "rlloop-checkpoints";
  // Base-model catalogue: names usable as SessionOptions::base_model besides a model directory path.
  std::vector<std::pair<std::string, std::string>> base_models;
  // "auto" (CUDA if available, else CPU), "cpu", "cuda", "cuda:N".
  std::string device = "auto";
  // The models' arithmetic: "auto" (bf16 on CUDA, fp32 on the CPU), "fp32" or "bf16". bf16 on the CPU runs the
  // arithmetic CUDA runs (ATen's bf16 kernels; slower than fp32 there): full fine-tuning keeps fp32 master weights
  // and fp32 gradient sums in the optimizer, LoRA adapters stay fp32; a GGUF base is then dequantized to bf16.
  std::string dtype = "auto";
  // Arithmetic of sample()'s decoding steps on the CPU. "fp32": sampled logprobs equal compute_logprobs
  // (within 1e-4). "bf16": the projection weights and their inputs rounded to bf16, sums in fp32, and the KV
  // cache stored as bf16 (norms and attention compute in fp32): 1.8-2.3x faster sampling of rlloop-100m with
  // AVX512_BF16 (bench/engine/README.md; elsewhere the fp32 kernels compute the same rounding at about fp32
  // speed), logprobs off from compute_logprobs by the rounding (~1e-2); the importance_sampling and ppo losses
  // correct for exactly that kind of sampler/trainer mismatch. The prompt's prefill stays fp32. A session rounds
  // the weights once and keeps them while they do not change. "int8": bf16, and a quantized GGUF base's Q4_0 /
  // Q4_1 / Q8_0 matrices (quantized_base) multiply inputs rounded to 8 bits per block of 32 in integer products,
  // as llama.cpp computes: the fastest decoding of such a base (SmolLM2: bench/README.md), logprobs off by ~0.05.
  // CUDA models are bf16 throughout and ignore this.
  SamplingPrecision sampling_precision = SamplingPrecision::fp32;
  // Most sample rows decoded in one step by a base model's engine loop, summed over every session's requests;
  // requests beyond it wait their turn (a larger single request runs alone). Up to 64 a row's tokens do not
  // depend on the rows beside it and its logprobs only in the last digits (within 1e-5; docs/engine.md).
  int max_batch_rows = 64;
  // The KV cache memory of a base model's decoding requests together, in MiB: a request is admitted when the most
  // its samples can take (its prompt's blocks once, each sample's own up to max_tokens; docs/engine.md, "The paged
  // KV cache") fits beside what the decoding ones may take; otherwise it waits, oldest first, and a request larger
  // than the whole budget runs alone. 0: no limit but max_batch_rows. (An expert-parallel session's batch of
  // requests is bounded by it and by max_batch_rows alone, not beside the other sessions' requests.)
  std::int64_t kv_cache_mb = 4096;
  // Most prompt tokens a base model's engine loop prefills in one decoding step, across the requests just admitted
  // (chunked prefill: prompts are rows of the steps that decode the others, a longer one over several steps;
  // docs/engine.md). Larger: prompts start sooner; smaller: decoding requests wait less per step.
  std::int64_t prefill_chunk_tokens = 512;
  // LoRA sessions on a GGUF base (CPU, fp32) share its matrices in their quantized blocks, dequantized where each
  // product uses them: the base then takes its file's size in memory instead of 4 bytes per weight (SmolLM2-135M:
  // 0.1 GB instead of 0.5), at a cost in speed (bench/README.md). false: dequantized to fp32 once, at load. Full
  // fine-tuning always trains a dense fp32 copy.
  bool quantized_base = true;
  // Activation checkpointing: a training pass keeps only each layer's input and recomputes the layer in backward
  // (about one more forward per step), so that activation memory stops growing with layers x the MLP's width;
  // for long sequences or large batches. Losses and gradients are the same (docs/engine.md, "Memory").
  bool activation_checkpointing = false;
  // Ranks beyond this process that train every session with it (docs/data_parallel.md).
  DataParallelOptions data_parallel;
};

// What one base model's engine loop is doing (LocalService::base_model_stats).
struct BaseModelStats {
  std::string base;             // the resolved model, its device and dtype
  int sessions = 0;             // sessions (training and sampler) whose operations run on its loop
  int shared_weight_users = 0;  // of those, models reading the one shared copy of the base weights
  std::int64_t shared_weight_bytes = 0;  // the memory that copy takes (quantized blocks as stored), 0 without one
  int active_requests = 0;      // sampling requests decoding now
  int active_rows = 0;          // their rows in the current batch
  int queued_operations = 0;    // operations waiting in sessions' queues
  int peak_batch_rows = 0;      // the largest batch decoded so far
  int peak_batch_requests = 0;  // the most requests in one decoding step so far
  std::int64_t kv_reserved_bytes = 0;       // KV memory the decoding requests may take (kv_cache_mb)
  std::int64_t peak_kv_reserved_bytes = 0;  // its largest value so far
  std::uint64_t decode_steps = 0;
};

// What a service's data-parallel group has moved (LocalService::data_parallel_stats), for benchmarks.
struct DataParallelStats {
  int world_size = 1;
  std::uint64_t allreduce_calls = 0;  // one per optimizer step
  std::uint64_t allreduce_bytes = 0;  // gradients (fp32) plus one flag per parameter, per call
  double allreduce_seconds = 0;       // on rank 0, waiting included
  std::uint64_t broadcast_bytes = 0;  // weights sent at session open and load_state
  std::uint64_t worker_samples = 0;   // samples decoded by the workers (the rest by rank 0)
  std::uint64_t worker_logprobs = 0;  // compute_logprobs prompts run by the workers
  // Expert parallelism: rank 0's all-to-alls (each sparse layer's counts, routed rows and expert outputs in a
  // forward, their gradients in a backward) and the bytes it sent in them.
  std::uint64_t alltoall_calls = 0;
  std::uint64_t alltoall_bytes = 0;
  // Expert parallelism: checkpoint bytes rank 0 sent the other ranks at load_state and sampler loads, each rank
  // its own slice (the tensors every rank holds, and its experts').
  std::uint64_t scatter_bytes = 0;
  // Fully sharded sessions: what rank 0 received in all-gathers of shards ((W - 1) shards each) and the logical
  // bytes of its reduce-scatters of gradients ((W - 1) / W of each), beside the bytes it actually sent in them.
  std::uint64_t allgather_bytes = 0;
  std::uint64_t reduce_scatter_bytes = 0;
  std::uint64_t reduce_scatter_sent_bytes = 0;
};

namespace engine {
class BaseModelRegistry;
}

// One training session: its adapters (over a base model shared with the other LoRA sessions of its service) or
// its own full model, its operations run in submission order by the engine loop of its base model.
class LocalSession {
 public:
  // A session of its own, sharing nothing with other sessions.
  LocalSession(const SessionOptions& options, const LocalServiceOptions& service);
  // A session sharing `bases` (the base weights and engine loops of one LocalService).
  LocalSession(const SessionOptions& options, const LocalServiceOptions& service,
               std::shared_ptr<engine::BaseModelRegistry> bases);
  ~LocalSession();
  LocalSession(const LocalSession&) = delete;
  LocalSession& operator=(const LocalSession&) = delete;

  Future<ForwardBackwardOutput> forward(const std::vector<Datum>& data, const LossSpec& loss);
  Future<ForwardBackwardOutput> forward_backward(const std::vector<Datum>& data, const LossSpec& loss);
  Future<ForwardBackwardOutput> forward_backward_custom(const std::vector<Datum>& data, const CustomLossFn& fn);
  Future<OptimStepOutput> optim_step(const AdamParams& params);
  Future<CheckpointRef> save_state(const std::string& name);
  Future<LoadStateOutput> load_state(const std::string& path, bool with_optimizer);
  Future<CheckpointRef> save_weights_for_sampler(const std::string& name);
  Future<SampleResponse> sample(const SampleRequest& request);
  // The same, calling on_step after every decoding step with what every sample holds so far (streaming). It runs
  // on the engine loop's thread between steps, so it should only copy what it needs.
  using SampleProgress = std::function<void(const SampleResponse& so_far)>;
  Future<SampleResponse> sample(const SampleRequest& request, SampleProgress on_step);
  Future<std::vector<double>> compute_logprobs(const ComputeLogprobsRequest& request);
  SessionInfo info();
  TokenUsage usage();

  // Exports (run in order with the other operations): merged weights in HF layout, LoRA adapter in PEFT layout.
  Future<CheckpointRef> export_merged_model(const std::string& dir);
  Future<CheckpointRef> export_peft_adapter(const std::string& dir);
  // In llama.cpp's format (GGUF files, written atomically): the LoRA adapters as a GGUF LoRA adapter that llama.cpp
  // loads beside the base (`llama-cli -m base.gguf --lora adapter.gguf`), for llama, qwen2 and qwen3 bases; and the
  // merged model as a GGUF model with matrices in `type` ("F32", "F16", "BF16" or "Q8_0"), for a GGUF base (the
  // file keeps the base's tokenizer and chat template). A bad type or base is an error of the future.
  Future<CheckpointRef> export_gguf_adapter(const std::string& path);
  Future<CheckpointRef> export_gguf_model(const std::string& path, const std::string& type = "F16");

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};
static_assert(Session<LocalSession>);

// Creates LocalSessions; satisfies the Service concept.
class LocalService {
 public:
  using session_type = LocalSession;
  explicit LocalService(LocalServiceOptions options = {});

  std::shared_ptr<LocalSession> create_session(const SessionOptions& options);
  std::shared_ptr<LocalSession> create_session_from_state(const std::string& path, const SessionOptions& options);
  std::shared_ptr<LocalSession> open_sampler(const std::string& path);
  std::vector<std::string> list_base_models();
  ServerCapabilities capabilities();
  const LocalServiceOptions& options() const { return options_; }
  // One entry per base model in use: how many sessions share it, what its engine loop is batching.
  std::vector<BaseModelStats> base_model_stats() const;
  DataParallelStats data_parallel_stats() const;
  // Why the data-parallel group failed (group_failure's message), or empty while it works or there is none.
  // A failed group stays failed: the service must be made again (rlloop serve restarts itself).
  std::string data_parallel_failure() const;

 private:
  LocalServiceOptions options_;
  std::shared_ptr<engine::BaseModelRegistry> bases_;
};
static_assert(Service<LocalService>);

// Resolves a base-model name through the catalogue (or returns it as a path); throws not_found.
std::string resolve_base_model(const LocalServiceOptions& service, const std::string& name);

}  // namespace rlloop

namespace rlloop {

// Settings of the whole process rather than of a session: LibTorch's thread count and its CPU allocator.
// Nothing sets them implicitly; a program that wants them calls configure_engine_process once, before its first
// session (`rlloop serve` and `rlloop sample`, the examples and the benches do). Without the call LibTorch keeps
// its own defaults, which on Debian's build is one thread and posix_memalign for every tensor: correct, slower.
struct EngineProcessOptions {
  // LibTorch's intra-op threads; 0 = OMP_NUM_THREADS if set, else the number of cores.
  int num_threads = 0;
  // Serve CPU tensors of 1 MiB and more from a cache of freed blocks, so that each training step reuses the
  // previous step's memory instead of page-faulting fresh pages in (about 12% of a step on rlloop-100m). The
  // cache keeps at most RLLOOP_CPU_CACHE_MB MiB if set (0: no cache), else a quarter of the physical memory,
  // at most 8 GiB; an unreadable RLLOOP_CPU_CACHE_MB is an invalid_argument naming it.
  bool caching_cpu_allocator = true;
};

// Applies `options` to this process and returns what is in effect: the thread count chosen, and whether the
// caching allocator is installed. Calling it again with the same options changes nothing. Each call sets the
// thread count (threads that have already run a LibTorch parallel region keep theirs, so call it before
// creating sessions); the allocator is installed by the first call that asks for it and stays installed, since
// live tensors hold its blocks (caching_cpu_allocator = false never removes it). It also reads
// RLLOOP_CPU_KERNELS (native | avx512_bf16 | avx2 | portable: the highest instruction set the engine's own CPU
// kernels may use) and throws invalid_argument naming it for another value.
EngineProcessOptions configure_engine_process(const EngineProcessOptions& options = {});

// A data-parallel worker: joins rank 0's group and holds replicas of its sessions.
struct DataParallelWorkerOptions {
  std::string rendezvous;  // rank 0's "HOST:PORT"
  int rank = 1;
  int world_size = 2;
  double timeout_s = 60;
  // The device and the base-model catalogue: the same as rank 0's (the group refuses a rank whose device kind
  // differs; a session whose base model differs fails to open, naming the rank).
  LocalServiceOptions service;
};
// Runs until rank 0 closes the group (returns) or goes away (throws group_failure). Errors at the rendezvous
// (unreachable address, another world size, a rank already taken) throw, naming what was wrong.
void run_data_parallel_worker(const DataParallelWorkerOptions& options);

// What the engine runs on, for `rlloop info` and logs.
struct EngineInfo {
  std::string libtorch_version;
  std::string device;  // the device "auto" resolves to
  std::string dtype;
  int threads = 0;           // LibTorch's intra-op thread count in effect
  int parallel_threads = 0;  // threads that ran one of the engine's own parallel regions (== threads when built right)
  std::string blas;          // the BLAS library LibTorch's matmuls go through, as loaded in this process
  std::string cpu_kernels;   // the instruction-set level of the engine's own CPU kernels (RLLOOP_CPU_KERNELS caps it)
  bool cuda_available = false;
};
EngineInfo engine_info(const std::string& device = "auto");

}  // namespace rlloop
