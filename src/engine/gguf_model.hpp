// Models from GGUF files (llama.cpp's and Ollama's format): the configuration from the file's metadata and the
// weights under the engine's (Hugging Face) names, dequantized to fp32 and cast to the session's dtype, with what
// llama.cpp's converter did to them undone (it permutes the Llama family's q/k rows for GGML's RoPE layout).
// Architectures llama, qwen2 and qwen3.
#pragma once
#include <memory>
#include <string>

#include <torch/torch.h>

#include "model_config.hpp"
#include "transformer.hpp"

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

std::shared_ptr<Transformer> load_gguf_model(const std::string& path, torch::Device device, torch::ScalarType dtype);

}  // namespace rlloop::engine
