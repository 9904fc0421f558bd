// Models from GGUF files (llama.cpp's and Ollama's format): the configuration from the file's metadata and the
// weights under the engine's (Hugging Face) names, dequantized to fp32 and cast to the session's dtype (or kept in
// their blocks for a frozen base), with what llama.cpp's converter did to them undone (it permutes the Llama
// family's q/k rows for GGML's RoPE layout).
// Architectures llama, qwen2 and qwen3.
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include <torch/torch.h>

#include "model/model_config.hpp"
#include "model/transformer.hpp"

namespace rlloop::gguf {
class File;
}

namespace rlloop::engine {

// A path that names a GGUF file: a regular file whose name ends in ".gguf".
bool is_gguf_path(const std::string& path);

// The model configuration a GGUF file's metadata describes. Throws unsupported naming the file for an
// architecture or a RoPE scaling rlloop does not implement, invalid_argument for missing or mistyped keys.
ModelConfig gguf_model_config(const gguf::File& file);

// Every tensor of the file under its Hugging Face name, dequantized to fp32, in Hugging Face's layout.
TensorMap gguf_hf_tensors(const gguf::File& file, const ModelConfig& config);

// A model's tensors by Hugging Face name, each read whole from its file when called.
using TensorSources = std::map<std::string, std::function<torch::Tensor()>>;
// gguf_hf_tensors' tensors one at a time (a model read sharded: load_sharded_model), each read from `file` when
// called: `file` and `config` must outlive them. A dense model's: unsupported names a tensor without a counterpart
// (an expert stack's too).
TensorSources gguf_tensor_sources(const gguf::File& file, const ModelConfig& config);

// The model of a GGUF file on `device` as `dtype`. With `keep_quantized` (honoured for fp32 on the CPU) its
// matrices stay in their blocks (quantized_matrix.hpp: F16 and BF16 ones too, every type but F32), for a frozen
// base that LoRA sessions share; otherwise every tensor is dequantized.
std::shared_ptr<Transformer> load_gguf_model(const std::string& path, torch::Device device, torch::ScalarType dtype,
                                             bool keep_quantized = false);

// llama.cpp's name for one of the family's (Hugging Face) tensor names, "model.layers.3.self_attn.q_proj.weight" ->
// "blk.3.attn_q.weight"; nullopt for a name that is not one of the decoder's tensors.
std::optional<std::string> gguf_tensor_name(const ModelFamily& family, const std::string& hf_name);
// llama.cpp's name of sparse layer `layer`'s experts' projection `p`, stacked ("blk.3.ffn_gate_exps.weight"; with
// suffix ".bias" their biases, gpt-oss's).
std::string gguf_expert_stack_name(std::int64_t layer, Projection p, const std::string& suffix = ".weight");
// A tensor (or a LoRA B, whose rows are the weight's) as llama.cpp's converter writes `gguf_name`: the llama family's
// q and k rows permuted for GGML's RoPE, Gemma's norms as 1 + w (read back as w), everything else as it is.
torch::Tensor to_gguf_layout(const ModelConfig& config, const std::string& gguf_name, const torch::Tensor& t);

}  // namespace rlloop::engine
