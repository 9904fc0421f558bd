// Qwen3 (dense): Llama's layer with a per-head RMSNorm of q and k before RoPE and an explicit head_dim; its chat
// template with thinking off unless the caller asks for it.
#include "model/families/families.hpp"

namespace rlloop::engine::families {

ModelFamily qwen3() {
  ModelFamily f;
  f.model_type = "qwen3";
  f.gguf_architecture = "qwen3";
  f.hf_architecture = "Qwen3ForCausalLM";
  f.attention_bias_default = false;
  f.o_proj_bias = true;
  f.qk_norm = true;
  f.gguf_reorders_qk = false;
  f.chat_renderer = "qwen3_no_thinking";
  return f;
}

}  // namespace rlloop::engine::families
