// The architecture families the engine runs, one entry each: what tells one Hugging Face `model_type` from another
// where the code used to compare the name (the config's defaults, the attention's biases and norms, the GGUF
// layout, the architecture config.json names). Adding a family that shares the dense decoder's layer is one entry
// in model_family.cpp plus its tests; a family with a layer of its own needs more (issue 26's registry).
#pragma once
#include <string>
#include <vector>

namespace rlloop::engine {

struct ModelFamily {
  std::string model_type;       // config.json's model_type, also the GGUF's general.architecture
  std::string hf_architecture;  // what config.json's "architectures" lists for a causal LM of the family
  bool attention_bias_default;  // q/k/v biases when config.json has no attention_bias key (Qwen2)
  bool o_proj_bias;             // with attention biases, o_proj has one too (Llama's attention_bias; not Qwen2)
  bool qk_norm;                 // per-head RMSNorm of q and k before RoPE (Qwen3)
  bool gguf_reorders_qk;        // llama.cpp's converter reorders the q/k rows of each head (the llama family)
};

// Every family, in a fixed order.
const std::vector<ModelFamily>& model_families();
// The family of `model_type`, or null when the engine has none.
const ModelFamily* find_model_family(const std::string& model_type);
// The supported model_types as a list for error messages: "llama, qwen2, qwen3".
std::string supported_model_types();

}  // namespace rlloop::engine
