// Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, ...): Qwen3's attention (q/k norm, no biases) with sparse layers: a
// linear router ("mlp.gate") whose softmax picks num_experts_per_tok SwiGLU experts per token, their outputs
// weighted by those probabilities (renormalised when norm_topk_prob). Checkpoints list each expert's projections
// ("mlp.experts.E.gate_proj.weight"), which transformers 5 fuses on load and splits again on save. llama.cpp's
// "qwen3moe" GGUF files stack the experts in one tensor per projection ("blk.N.ffn_gate_exps.weight" [E, I, H]) and
// name the router "ffn_gate_inp" (gguf_model.cpp, gguf_export.cpp).
#include "model/families/families.hpp"

namespace rlloop::engine::families {

ModelFamily qwen3_moe() {
  ModelFamily f;
  f.model_type = "qwen3_moe";
  f.hf_architecture = "Qwen3MoeForCausalLM";
  f.attention_bias_default = false;
  f.o_proj_bias = true;
  f.qk_norm = true;
  f.experts = true;
  f.chat_renderer = "qwen3_no_thinking";
  f.gguf_architecture = "qwen3moe";
  return f;
}

}  // namespace rlloop::engine::families
