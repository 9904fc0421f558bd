// What a local session holds whatever its parallel mode, and what it does itself in every mode: the model and its
// optimizer, the sampler cache, the session's random seeds, the checks of a request and the billing of its tokens.
// The executor (executor.hpp) does the rest: how a step's tensors meet the ranks. Executors get the core by
// reference and call back into it, so that a mode never checks or bills a request in its own way.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Generator.h>

#include <rlloop/local.hpp>
#include <rlloop/tokenizer.hpp>

#include "io/checkpoint.hpp"
#include "kernels/cpu_allocator.hpp"
#include "kernels/device.hpp"
#include "runtime/base_models.hpp"
#include "runtime/engine_loop.hpp"
#include "runtime/optimizer.hpp"
#include "runtime/sampler.hpp"
#include "runtime/session_model.hpp"
#include "session/executor.hpp"

namespace rlloop::engine {

// Blocks cached for a closed session's shapes would sit unused in a long-lived process (a server whose tenants
// come and go); the next step of another session refills the cache with its own.
struct ReleaseCachedCpuBlocks {
  ~ReleaseCachedCpuBlocks() {
    if (auto* allocator = installed_caching_cpu_allocator()) allocator->release_cached();
  }
};

struct SessionCore {
  ReleaseCachedCpuBlocks release_cache;  // first member: destroyed last, after the lane, model and gradients
  SessionOptions options;
  LocalServiceOptions service;
  std::shared_ptr<BaseModelRegistry> bases;
  std::string resolved_base;
  std::string key;  // of the base in `bases`
  DeviceChoice dev;
  DecodePrecision decode_precision = DecodePrecision::fp32;
  dist::Group* experts = nullptr;           // the group the models' experts are spread over (expert_group_of)
  dist::Group* shard_group = nullptr;       // the group a LoRA model's base is sharded over (shard_group_of)
  std::shared_ptr<SharedBase> shared_base;  // LoRA sessions: the weights they share; null with a private model
  std::shared_ptr<Transformer> model;
  // A hash of the weights this rank read, for a model read sharded from its file(s) (SessionModel::weights_hash):
  // the ranks compare it when the session opens.
  std::optional<std::uint64_t> weights_hash;
  std::unique_ptr<AdamW> optimizer;
  // A forward_backward ran since the last optimizer step or load: the parameters' .grad() hold an accumulation
  // that save_state keeps (on every rank with data parallelism).
  bool gradients_pending = false;
  std::shared_ptr<const Tokenizer> tokenizer;  // for stop strings; null if the model has none we can load
  at::Generator generator;
  // A model sample() can decode from, with its bf16 weight snapshot kept across calls (bf16 precision only;
  // sample() re-rounds when the weights changed since). Models over the shared base use its one snapshot.
  struct SamplingModel {
    std::shared_ptr<Transformer> model;
    std::shared_ptr<const RoundedWeights> rounded;
    std::uint64_t last_used = 0;
    int decoding = 0;  // this session's sampling requests reading it now (they run side by side): never dropped
    dist::TensorParallelSlice slice;  // the live model's tensor-parallel slice (fully sharded sessions), kept
  };
  SamplingModel live;  // the training model
  // Sampler weights saved by this session or opened from disk, by checkpoint path. At most
  // kLoadedSamplerModels stay loaded, the least recently used dropped first (and read again from disk when
  // asked for): a loop that saves sampler weights under a new name every step would otherwise keep every
  // step's model in memory. With LoRA each holds only its adapters.
  static constexpr std::size_t kLoadedSamplerModels = 4;
  std::map<std::string, SamplingModel> samplers;
  std::uint64_t sampler_clock = 0;

  std::mutex usage_mu;
  TokenUsage usage;

  // How the operations meet the ranks; made once the model is (it may open the session's replicas on other ranks).
  std::unique_ptr<Executor> executor;
  // Last member: destroying it waits for the session's queued operations, before the rest is destroyed.
  std::unique_ptr<EngineLoop::Lane> lane;

  SessionCore(const SessionOptions& opts, const LocalServiceOptions& svc, std::shared_ptr<BaseModelRegistry> registry);

  // The session's model as created (session_model.hpp), or a sampler model for a checkpoint's weights.
  std::shared_ptr<Transformer> make_model(bool sampler);
  // A new optimizer over the model's trainable tensors (its moments allocated now): the old one's go first, so
  // that both sets are never held at once.
  void build_optimizer() {
    optimizer.reset();
    optimizer = make_optimizer(*model);
  }

  // An unseeded request's seed: the next number of the session's generator (saved with its state), so a session
  // restored from save_state samples what the saved one would have.
  std::uint64_t next_seed();
  void add_usage(const TokenUsage& u);

  // A sampling request as every rank decodes it: validated against `cfg`, the model's end-of-sequence token among
  // its stop ids, its stop strings' check and its seed (the request's, else next_seed()).
  struct CheckedSample {
    SampleRequest request;
    StopStringCheck stop_check;
    std::uint64_t seed = 0;
  };
  CheckedSample check_sample(const SampleRequest& request, const ModelConfig& cfg);
  // Bills a sampling request's tokens: the prompt once, every sample's new tokens.
  void bill_sample(std::int64_t prompt_tokens, const std::vector<SampledSequence>& sequences);
  // compute_logprobs' prompt, validated against `model` and billed as prefill.
  std::vector<token_id> checked_logprob_tokens(const ComputeLogprobsRequest& request, const Transformer& model);

  // The bf16 snapshot slot of `target`: a LoRA session's every model shares the base's.
  std::shared_ptr<const RoundedWeights>* rounded_slot(SamplingModel& target);
  // The key of a sampling request's model: empty for the live model, else the checkpoint's normalized path (as
  // save() returns paths).
  static std::string sampler_key(const std::optional<std::string>& path);
  // The model a request samples: the live one, or the sampler model of `path` (loaded on the first use, on every
  // rank through the executor).
  SamplingModel& sampling_model(const std::optional<std::string>& path);
  void drop_sampler(std::map<std::string, SamplingModel>::iterator it);

  // A checkpoint holds what its session trained (with LoRA, the adapters only), so it is only meaningful over
  // the base it was trained on.
  void check_same_base(const CheckpointMeta& meta, const std::string& path) const;
};

}  // namespace rlloop::engine
