#include "model_family.hpp"

namespace rlloop::engine {

const std::vector<ModelFamily>& model_families() {
  static const std::vector<ModelFamily> families = {
      {.model_type = "llama",
       .hf_architecture = "LlamaForCausalLM",
       .attention_bias_default = false,
       .o_proj_bias = true,
       .qk_norm = false,
       .gguf_reorders_qk = true},
      {.model_type = "qwen2",
       .hf_architecture = "Qwen2ForCausalLM",
       .attention_bias_default = true,
       .o_proj_bias = false,
       .qk_norm = false,
       .gguf_reorders_qk = false},
      {.model_type = "qwen3",
       .hf_architecture = "Qwen3ForCausalLM",
       .attention_bias_default = false,
       .o_proj_bias = true,
       .qk_norm = true,
       .gguf_reorders_qk = false},
  };
  return families;
}

const ModelFamily* find_model_family(const std::string& model_type) {
  for (const ModelFamily& f : model_families())
    if (f.model_type == model_type) return &f;
  return nullptr;
}

std::string supported_model_types() {
  std::string out;
  for (const ModelFamily& f : model_families()) {
    if (!out.empty()) out += ", ";
    out += f.model_type;
  }
  return out;
}

}  // namespace rlloop::engine
