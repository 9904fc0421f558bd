// The architecture registry: one entry per model family (a Hugging Face `model_type`), holding everything that
// tells one family from another, so that no other file compares model_type strings:
//   - how its config.json reads (the attention-bias default, q/k norm, and a hook for keys of its own),
//   - its layer: the one decoder layer (transformer.hpp) configured by the entry's flags,
//   - its tensor names in Hugging Face's layout; PEFT's and LoRA's target modules derive from them, and llama.cpp's
//     GGUF names map to them by role (gguf_model.cpp),
//   - the chat format its instruct models use when the tokenizer's own template does not say.
// The built-in families each have a file in families/ and a line in builtin_families() (model_family.cpp); other
// code (a test, a user's program) adds one with register_model_family. docs/engine.md: "Adding a model family".
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace rlloop::gguf {
class File;
struct Value;
}

namespace rlloop::engine {

struct ModelConfig;

// The projections of the decoder layer, in the order every table below lists them: attention's q, k, v, o and the
// SwiGLU MLP's gate, up, down.
enum class Projection : std::uint8_t { q, k, v, o, gate, up, down };
inline constexpr std::size_t kNumProjections = 7;
inline constexpr std::array<Projection, kNumProjections> kProjections = {
    Projection::q, Projection::k, Projection::v, Projection::o, Projection::gate, Projection::up, Projection::down};

// The member of `layer` that `p` names, in any type with members q, k, v, o, gate, up and down (a layer's linears,
// their inference views, their bf16 snapshots); const when `layer` is.
template <class Layer>
auto& projection_member(Layer& layer, Projection p) {
  switch (p) {
    case Projection::q: return layer.q;
    case Projection::k: return layer.k;
    case Projection::v: return layer.v;
    case Projection::o: return layer.o;
    case Projection::gate: return layer.gate;
    case Projection::up: return layer.up;
    case Projection::down: return layer.down;
  }
  throw std::logic_error("projection_member: not a projection");
}

// A family's tensor names in Hugging Face's layout (without ".weight" / ".bias"). A layer's tensors are
// layer_prefix + index + "." + name. The defaults are Llama's, which Qwen2 and Qwen3 share.
struct WeightNames {
  std::string embed = "model.embed_tokens";
  std::string final_norm = "model.norm";
  std::string lm_head = "lm_head";
  std::string layer_prefix = "model.layers.";
  std::string input_norm = "input_layernorm";
  std::string post_norm = "post_attention_layernorm";
  std::string q_norm = "self_attn.q_norm";
  std::string k_norm = "self_attn.k_norm";
  // Each projection's module path within the layer; its last component is the name LoRA's target_modules use
  // (as PEFT matches them).
  std::array<std::string, kNumProjections> projections = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                          "self_attn.o_proj", "mlp.gate_proj",    "mlp.up_proj",
                                                          "mlp.down_proj"};
  // A sparse layer's (families with experts): the router's linear and the experts' list; expert e's gate, up and
  // down projections are experts + "." + e + "." + the dense MLP's module names ("mlp.experts.3.gate_proj").
  std::string router = "mlp.gate";
  std::string experts = "mlp.experts";
  // A family with attention sinks: the layer's learned logit per head.
  std::string sinks = "self_attn.sinks";
  // Sandwich norms: those of the attention's and the MLP's outputs (Gemma 2: post_attention_layernorm and
  // post_feedforward_layernorm; its norm before the MLP, post_norm, being pre_feedforward_layernorm).
  std::string attn_out_norm;
  std::string mlp_out_norm;
};

// How a family's sparse layers route and compute (families with `experts`). The defaults are Qwen-MoE's.
struct ExpertStyle {
  // Qwen-MoE routes by the softmax over every expert's logit, top k (renormalised with norm_topk_prob); gpt-oss takes
  // the top k logits and a softmax over those k.
  bool softmax_after_top_k = false;
  bool router_bias = false;  // the router's linear has a bias (gpt-oss)
  bool biases = false;       // each expert's gate, up and down projections have biases (gpt-oss)
  // gpt-oss's SwiGLU: the gate clamped above and up on both sides at ModelConfig::swiglu_limit, then
  // (up + 1) * gate * sigmoid(swiglu_alpha * gate). Plain SwiGLU (silu(gate) * up) otherwise.
  bool clamped_swiglu = false;
  // Checkpoints hold a sparse layer's experts stacked, as transformers' GptOssExperts keeps them: experts.gate_up_proj
  // [E, H, 2I] (x @ W, gate and up interleaved in the last dimension: gate even, up odd), experts.gate_up_proj_bias
  // [E, 2I], experts.down_proj [E, I, H], experts.down_proj_bias [E, H]. rlloop keeps a Linear per expert and
  // projection (expert_module's names) and converts where model files are read and written (load_model, save_model:
  // expert_layout.hpp).
  bool stacked_interleaved = false;
  // The config key of the experts' width.
  std::string width_key = "moe_intermediate_size";
};

struct ModelFamily {
  std::string model_type;         // config.json's model_type
  std::string hf_architecture;    // what config.json's "architectures" lists for a causal LM of the family
  std::string gguf_architecture;  // llama.cpp's general.architecture for it; empty when llama.cpp has none
  bool attention_bias_default = false;  // q/k/v biases when config.json has no attention_bias key (Qwen2)
  bool o_proj_bias = true;              // with attention biases, o_proj has one too (Llama's attention_bias)
  bool qk_norm = false;                 // per-head RMSNorm of q and k before RoPE (Qwen3)
  bool gguf_reorders_qk = false;        // llama.cpp's converter reorders the q/k rows of each head (llama)
  std::string gguf_post_norm = "ffn_norm";  // llama.cpp's name of the norm before the MLP (names.post_norm)
  // Sparse layers (mixture of experts): ModelConfig::from_json reads the expert keys (Qwen-MoE's names; a family's
  // read_config may read others), and the layers ModelConfig::sparse_layer names have a router and experts in place
  // of the dense MLP.
  bool experts = false;
  ExpertStyle expert_style;
  // A learned logit per attention head that joins every query's softmax beside the keys' and takes its share of the
  // probability without contributing a value (gpt-oss's sinks; names.sinks).
  bool attention_sinks = false;
  // Sandwich norms (Gemma 2): each sublayer's output is RMS-normed (names.attn_out_norm, names.mlp_out_norm) before
  // its residual add, besides the norms before attention and before the MLP.
  bool sandwich_norms = false;
  // RMSNorm scales by (1 + w) rather than w (Gemma): checkpoints hold w, zero for a norm that changes nothing.
  bool norm_adds_one = false;
  // The embeddings are multiplied by sqrt(hidden_size), rounded to the model's dtype (Gemma).
  bool scale_embeddings = false;
  // make_chat_renderer's name for the family's instruct format, used when the tokenizer carries no chat template
  // rlloop recognises (default_chat_renderer).
  std::string chat_renderer = "role_colon";
  WeightNames names;
  // Reads the family's own config.json keys into the config after the keys every family shares (optional); throws
  // invalid_argument / unsupported naming the key for a value the family cannot take.
  std::function<void(const nlohmann::json&, ModelConfig&)> read_config;
  // Writes those keys back (ModelConfig::to_json; optional).
  std::function<void(const ModelConfig&, nlohmann::json&)> write_config;
  // A GGUF file's keys of the family's own ("<gguf_architecture>.*": sliding windows, ...) as config.json's, into
  // the config that gguf_model_config builds from the keys every family shares (optional).
  std::function<void(const gguf::File&, nlohmann::json&)> read_gguf_config;
  // Writes those keys into a GGUF export's metadata (optional); throws unsupported for a config llama.cpp cannot run.
  std::function<void(const ModelConfig&, std::map<std::string, gguf::Value>&)> write_gguf_config;

  // "model.layers.3.self_attn.q_proj": the module of a layer's projection.
  std::string projection_module(std::int64_t layer, Projection p) const;
  // "model.layers.3.mlp.experts.5.gate_proj": expert e's gate, up or down projection in a sparse layer.
  std::string expert_module(std::int64_t layer, std::int64_t expert, Projection p) const;
  // "model.layers.3.input_layernorm": a layer tensor's name without ".weight".
  std::string layer_tensor(std::int64_t layer, const std::string& name) const;
  // "q_proj": the projection's name in LoRA's target_modules.
  std::string target_module(Projection p) const;
  // "gate": the router's name in LoRA's target_modules (families with experts).
  std::string router_target_module() const;
  // Every name target_modules takes: the projections', the router's (families with experts), "lm_head" and
  // "all-linear" (every projection, and the router).
  std::vector<std::string> lora_target_modules() const;
};

// Every family: the built-in ones, then those registered, in order. The entries live as long as the program.
std::vector<const ModelFamily*> model_families();
// The family of `model_type`, or null when none is registered.
const ModelFamily* find_model_family(const std::string& model_type);
// The family whose GGUF files name `architecture` (general.architecture), or null.
const ModelFamily* find_gguf_family(const std::string& architecture);
// The registered model_types as a list for error messages: "llama, qwen2, qwen3".
std::string supported_model_types();
// Adds a family (thread-safe). invalid_argument when its model_type is empty or taken, or when it lacks the
// HF architecture name, a chat renderer or a tensor name, or two projections end in the same module name.
const ModelFamily& register_model_family(ModelFamily family);

}  // namespace rlloop::engine
