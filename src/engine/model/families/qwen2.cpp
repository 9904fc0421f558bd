// Qwen2 and Qwen2.5: Llama's layer with q/k/v biases (always: its config.json has no attention_bias key) and
// none on o_proj; ChatML.
#include "model/families/families.hpp"

namespace rlloop::engine::families {

ModelFamily qwen2() {
  ModelFamily f;
  f.model_type = "qwen2";
  f.gguf_architecture = "qwen2";
  f.hf_architecture = "Qwen2ForCausalLM";
  f.attention_bias_default = true;
  f.o_proj_bias = false;
  f.qk_norm = false;
  f.gguf_reorders_qk = false;
  f.chat_renderer = "chatml";
  return f;
}

}  // namespace rlloop::engine::families
