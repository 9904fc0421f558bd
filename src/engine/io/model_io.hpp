// Model directories in Hugging Face layout: config.json + model.safetensors, or sharded
// model-0000x-of-0000y.safetensors with model.safetensors.index.json, read and written. PEFT adapter directories
// (adapter_config.json + adapter_model.safetensors) are written only: LoRA exports for peft.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include <torch/torch.h>

#include "model/transformer.hpp"

namespace rlloop::engine {

// Reads every tensor of one .safetensors file (F32, F16, BF16, I64, I32 at least) onto the CPU.
// A missing, truncated or malformed file throws io_error naming the file and the problem.
TensorMap read_safetensors(const std::string& path);
// Writes tensors atomically (temp file in the same directory, fsync, rename).
void write_safetensors(const std::string& path, const TensorMap& tensors,
                       const std::map<std::string, std::string>& metadata = {});
// Replaces `path` with `content` atomically: temp file in the same directory, fsync, rename, fsync the directory.
void write_file_atomic(const std::string& path, const std::string& content);

// Loads config.json and weights (single or sharded) from `dir`, onto `device` in `dtype`.
// `dir` may also name a .gguf file (gguf_model.hpp).
std::shared_ptr<Transformer> load_model(const std::string& dir, torch::Device device, torch::ScalarType dtype,
                                        bool keep_quantized = false);
// What a model made sharded (below) is for: training its shards (full fine-tuning), or a frozen base that LoRA
// sessions share (its shards require no gradient).
enum class ShardedUse { trained, frozen_base };
// load_model's model (a model directory or a GGUF file) fully sharded over `group` without ever being whole on a
// rank: built on the meta device, each tensor read from its file in hf_state_dict's order (a GGUF one dequantized)
// and only this rank's part of it kept. `weights_hash`, when given, receives a hash of every value read (the ranks
// compare it: none broadcasts). A tensor of the file that the model has not is refused, naming it.
std::shared_ptr<Transformer> load_sharded_model(const std::string& path, torch::Device device,
                                                torch::ScalarType dtype, dist::Group& group,
                                                std::uint64_t* weights_hash = nullptr,
                                                ShardedUse use = ShardedUse::trained);
// Builds a randomly initialised model (seeded; std 0.02 normal, as HF initialises) for tests and from-scratch demos.
std::shared_ptr<Transformer> init_model(const ModelConfig& cfg, std::int64_t seed, torch::Device device,
                                        torch::ScalarType dtype);
// init_model's model fully sharded over `group` (Transformer::set_fully_sharded) without ever being whole on a
// rank: built on the meta device, each weight drawn in init_model's order (every rank draws the same stream) and
// only this rank's part of it kept. Equal to init_model's model sharded. `weights_hash` and `use` as
// load_sharded_model's.
std::shared_ptr<Transformer> init_sharded_model(const ModelConfig& cfg, std::int64_t seed, torch::Device device,
                                                torch::ScalarType dtype, dist::Group& group,
                                                std::uint64_t* weights_hash = nullptr,
                                                ShardedUse use = ShardedUse::trained);
// Saves config.json + model.safetensors (fp32 unless the model is bf16); with LoRA, the merged weights.
// `max_shard_bytes` > 0 splits into shards with an index. Atomic per file; the directory is created.
void save_model(const Transformer& model, const std::string& dir, std::int64_t max_shard_bytes = 0);
// Saves adapter_config.json + adapter_model.safetensors (PEFT layout), for peft to load onto the base model.
// Throws if the model has no LoRA.
void save_peft_adapter(const Transformer& model, const std::string& dir, const std::string& base_model_name);

}  // namespace rlloop::engine
