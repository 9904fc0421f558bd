// The weights of one decoder model, as the transformer holds them (an internal header of src/engine/model: the
// transformer and the units it is split into, never its users): every layer's norms, linears and experts, the
// embedding, the final norm, the unembedding, the adapters and the value head, with their HF / PEFT names and the
// walks over them that construction, sharing a base, the state dicts and the optimizer all take in one fixed order.
// What a forward does with them is elsewhere: the layer recipe (decoder_layer.hpp) over a backend's operations
// (aten_ops.hpp, cpu_decoder.hpp), a step's row and KV layout (step_context.hpp), the experts' dispatch
// (experts_layer.hpp), the state dicts (weight_io.hpp).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include <torch/torch.h>

#include <rlloop/types.hpp>

#include "kernels/quantized_matrix.hpp"
#include "model/experts.hpp"
#include "model/linear.hpp"
#include "model/model_config.hpp"
#include "model/model_family.hpp"

namespace rlloop::engine {

class TensorParallel;

// "[2, 3]": a shape in error messages.
std::string shape_string(at::IntArrayRef s);
// A module's parameter name for an HF name (module parameter names may not contain '.', HF names are dotted).
std::string module_name(const std::string& hf_name);

struct Layer {
  torch::Tensor input_norm, post_norm, q_norm, k_norm;
  torch::Tensor attn_out_norm, mlp_out_norm;  // families with sandwich norms
  torch::Tensor sinks;  // [heads]: families with attention sinks
  Linear q, k, v, o, gate, up, down;  // a sparse layer has no gate, up and down (not present())
  Linear router;                      // a sparse layer's: [experts, H]
  std::vector<Expert> experts;        // a sparse layer's
  ExpertAdapters expert_lora;         // a sparse layer's adapters on its experts (LoRA)
  bool sparse() const { return !experts.empty(); }
  // Whether the CPU's decoding kernels (cpu_decoder.hpp) implement this layer as it is: decoder_layer's dense form
  // with plain causal attention (`window` 0: none), every tensor fp32 on the CPU (quantized matrices are read from
  // their blocks).
  bool cpu_kernels_apply(std::int64_t window) const;
  // Whether any weight, norm or adapter of the layer requires grad.
  bool trains() const;

  // Every linear the layer has, in a fixed order: the projections present (kProjections' order), then the router
  // and each expert's gate, up and down.
  template <class Self, class L = std::conditional_t<std::is_const_v<Self>, const Linear, Linear>>
  static std::vector<L*> linears_of(Self& self) {
    std::vector<L*> out;
    for (L* lin : {&self.q, &self.k, &self.v, &self.o, &self.gate, &self.up, &self.down})
      if (lin->present()) out.push_back(lin);
    if (self.router.present()) out.push_back(&self.router);
    for (auto& e : self.experts)
      for (L* lin : {&e.gate, &e.up, &e.down}) out.push_back(lin);
    return out;
  }
  std::vector<Linear*> linears() { return linears_of(*this); }
  std::vector<const Linear*> linears() const { return linears_of(*this); }
  Linear& projection(Projection p) { return projection_member(*this, p); }
  const Linear& projection(Projection p) const { return projection_member(*this, p); }
};

// Registers a new parameter of the model (its HF-derived module name, its initial value) and returns it.
using RegisterParameter = std::function<torch::Tensor(const std::string& module_name, const torch::Tensor& value)>;

struct ModelWeights {
  ModelConfig cfg;
  const ModelFamily* family = nullptr;  // cfg's: the tensor names and the LoRA target modules
  torch::TensorOptions options;
  torch::Tensor embed;  // undefined when embed_quantized holds it
  std::shared_ptr<const QuantizedMatrix> embed_quantized;
  torch::Tensor final_norm;
  std::vector<Layer> layers;
  Linear lm_head;  // weight aliases embed when tied
  std::optional<LoraOptions> lora;
  Linear value_head;  // undefined weight without a value head
  // A tensor-parallel rank's slice of a model (tensor_parallel.hpp): cfg is cut to the rank's heads and widths, the
  // embedding and unembedding hold its rows of the vocabulary. Null for a whole model.
  std::shared_ptr<const TensorParallel> tensor_parallel;

  // The weights of `cfg` (validated) with `options`, the matrices named in `quantized` kept in their blocks, and
  // experts [first_expert, first_expert + expert_count) of each sparse layer; every dense one registered through
  // `param`, zero but the norms (one).
  void build(const ModelConfig& cfg, torch::TensorOptions options, const QuantizedTensors& quantized,
             std::int64_t first_expert, std::int64_t expert_count, const RegisterParameter& param);

  // What a norm's weight `w` scales by: w, or 1 + w for a family whose norms add one (Gemma).
  torch::Tensor norm_scale(const torch::Tensor& w) const { return cfg.norm_adds_one ? w + 1 : w; }
  torch::Device device() const { return options.device(); }
  torch::ScalarType dtype() const { return c10::typeMetaToScalarType(options.dtype()); }
  std::int64_t sparse_layers() const {
    std::int64_t n = 0;
    for (const Layer& l : layers) n += l.sparse() ? 1 : 0;
    return n;
  }
  // Whether `other` holds the same base tensors (not copies: models of one shared base).
  bool same_base(const ModelWeights& other) const;
  // Whether the CPU's decoding kernels implement every layer and the unembedding (Transformer::cpu_kernels_decode).
  bool cpu_kernels_decode() const;

  // Every dense base weight (parameter) under its HF name, in a fixed order (init_model draws from one generator
  // in this order); quantized matrices are for_each_quantized's.
  template <class F>
  void for_each_base(F&& f) const {
    const WeightNames& n = family->names;
    if (embed.defined()) f(n.embed + ".weight", embed);
    for (std::size_t i = 0; i < layers.size(); ++i) for_each_layer_tensor(layers[i], static_cast<std::int64_t>(i), f);
    f(n.final_norm + ".weight", final_norm);
    if (!cfg.tie_word_embeddings && lm_head.weight.defined()) f(n.lm_head + ".weight", lm_head.weight);
  }
  // Layer `li`'s dense weights (`l`, const or not: fully sharded parallelism points the handles at the gathered
  // tensors while the layer runs) under their HF names, in for_each_base's order.
  template <class L, class F>
  void for_each_layer_tensor(L& l, std::int64_t li, F&& f) const {
    const WeightNames& n = family->names;
    f(family->layer_tensor(li, n.input_norm) + ".weight", l.input_norm);
    for (auto* lin : l.linears()) {
      if (lin->weight.defined()) f(lin->name + ".weight", lin->weight);
      if (lin->bias.defined()) f(lin->name + ".bias", lin->bias);
    }
    if (cfg.qk_norm) {
      f(family->layer_tensor(li, n.q_norm) + ".weight", l.q_norm);
      f(family->layer_tensor(li, n.k_norm) + ".weight", l.k_norm);
    }
    if (l.sinks.defined()) f(family->layer_tensor(li, n.sinks), l.sinks);
    if (l.attn_out_norm.defined()) f(family->layer_tensor(li, n.attn_out_norm) + ".weight", l.attn_out_norm);
    f(family->layer_tensor(li, n.post_norm) + ".weight", l.post_norm);
    if (l.mlp_out_norm.defined()) f(family->layer_tensor(li, n.mlp_out_norm) + ".weight", l.mlp_out_norm);
  }
  // The quantized matrices under their HF names.
  template <class F>
  void for_each_quantized(F&& f) const {
    if (embed_quantized) f(family->names.embed + ".weight", *embed_quantized);
    for (const auto& l : layers)
      for (const Linear* lin : l.linears())
        if (lin->quantized) f(lin->name + ".weight", *lin->quantized);
    if (!cfg.tie_word_embeddings && lm_head.quantized) f(family->names.lm_head + ".weight", *lm_head.quantized);
  }

  template <class F>
  void for_each_linear(F&& f) {
    for (auto& l : layers)
      for (Linear* lin : l.linears()) f(*lin);
    f(lm_head);
  }
  template <class F>
  void for_each_linear(F&& f) const {
    for (const auto& l : layers)
      for (const Linear* lin : l.linears()) f(*lin);
    f(lm_head);
  }

  static std::string peft_prefix(const Linear& lin) { return "base_model.model." + lin.name; }

  // Every adapter tensor under its PEFT name, with whether it is an A: the linears' adapters, then each sparse
  // layer's stacked expert adapters, named as PEFT names its ParamWrappers on the experts: gate_up_proj's wrapper
  // inside down_proj's, so gate_up's tensors are under "experts.base_layer" when both are there.
  template <class F>
  void for_each_adapter(F&& f) const {
    for_each_linear([&](const Linear& lin) {
      if (!lin.lora_a.defined()) return;
      f(peft_prefix(lin) + ".lora_A.weight", lin.lora_a, true);
      f(peft_prefix(lin) + ".lora_B.weight", lin.lora_b, false);
    });
    for (std::size_t i = 0; i < layers.size(); ++i) {
      const ExpertAdapters& e = layers[i].expert_lora;
      const std::string prefix =
          "base_model.model." + family->layer_tensor(static_cast<std::int64_t>(i), family->names.experts);
      if (e.gate_up_a.defined()) {
        const std::string inner = prefix + (e.down_a.defined() ? ".base_layer" : "");
        f(inner + ".lora_A.weight", e.gate_up_a, true);
        f(inner + ".lora_B.weight", e.gate_up_b, false);
      }
      if (e.down_a.defined()) {
        f(prefix + ".lora_A.weight", e.down_a, true);
        f(prefix + ".lora_B.weight", e.down_b, false);
      }
    }
  }

  // LoRA (Transformer::enable_lora, lora.cpp). The modules `options` targets (PEFT's names, "all-linear" expanded),
  // checked: invalid_argument for a bad rank, alpha or module.
  std::set<std::string> lora_targets(const LoraOptions& options) const;
  // Adapters on the `targets` linears (and the experts' stacked ones), registered through `param`, A drawn from
  // `seed` (Kaiming-uniform), B zero; the caller freezes every base weight first.
  void add_lora(const LoraOptions& options, const std::set<std::string>& targets, std::int64_t seed,
                const RegisterParameter& param);

 private:
  Layer build_layer(std::int64_t i, std::int64_t first_expert, std::int64_t expert_count,
                    const std::function<Linear(const std::string&, const std::string&, std::int64_t, std::int64_t,
                                               bool)>& linear,
                    const std::function<torch::Tensor(const std::string&, std::vector<std::int64_t>, bool)>& param)
      const;
};

}  // namespace rlloop::engine
