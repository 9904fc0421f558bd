// Llama (2, 3.x) and the models that reuse its architecture name (SmolLM2, TinyLlama, Mistral without sliding
// windows): the dense decoder as Hugging Face's LlamaForCausalLM defines it.
#include "model/families/families.hpp"

namespace rlloop::engine::families {

ModelFamily llama() {
  ModelFamily f;
  f.model_type = "llama";
  f.gguf_architecture = "llama";
  f.hf_architecture = "LlamaForCausalLM";
  f.attention_bias_default = false;
  f.o_proj_bias = true;  // LlamaConfig.attention_bias puts a bias on all four attention projections
  f.qk_norm = false;
  f.gguf_reorders_qk = true;  // llama.cpp's convert_hf_to_gguf permutes Llama's q/k rows for GGML's RoPE
  f.chat_renderer = "llama3";
  return f;
}

}  // namespace rlloop::engine::families
