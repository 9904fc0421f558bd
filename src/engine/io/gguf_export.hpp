// Exports in llama.cpp's format: LoRA adapters as a GGUF LoRA adapter that llama.cpp loads beside its base
// (`llama-cli -m base.gguf --lora adapter.gguf`), and merged weights as a GGUF model. Tensor names, shapes and the
// llama family's q/k row order are the ones llama.cpp's converters (convert_lora_to_gguf.py, convert_hf_to_gguf.py)
// write. Both files are written atomically.
#pragma once
#include <map>
#include <string>

#include <rlloop/gguf.hpp>

#include "model/transformer.hpp"

namespace rlloop::engine {

// The model's LoRA adapters: general.type = "adapter", adapter.type = "lora", adapter.lora.alpha, and per adapted
// matrix "<gguf name>.lora_a" (A, [rank, in]) and "<gguf name>.lora_b" (B, [out, rank]) in F32, which llama.cpp
// applies as scale * alpha / rank * B A x. Throws conflict without adapters, unsupported for an architecture
// llama.cpp's converter does not name (llama, qwen2, qwen3 are supported) or an lm_head adapter on a tied model
// (llama.cpp has no output matrix to adapt there).
void save_gguf_adapter(const Transformer& model, const std::string& path);

// The model with its adapters merged, as a GGUF model file: its architecture's metadata from the model's
// configuration, then every key of `carried` it does not set (the base file's tokenizer and general keys), matrices
// stored as `type` (F32, F16, BF16, Q8_0, Q4_K or Q6_K; Q8_0 where a K-quant row is not whole super-blocks of 256,
// F16 where a Q8_0 row is not whole blocks of 32) and vectors in F32, as llama.cpp's converter stores them. Throws
// unsupported for other architectures or types.
// "F32", "F16", "BF16" or "Q8_0" (any case) as a type the sessions' and `rlloop export`'s GGUF export writes;
// invalid_argument naming the others.
gguf::TensorType gguf_export_type(const std::string& name);

void save_gguf_model(const Transformer& model, const std::string& path, gguf::TensorType type,
                     const std::map<std::string, gguf::Value>& carried);

}  // namespace rlloop::engine
