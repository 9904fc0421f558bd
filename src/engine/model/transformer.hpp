// The decoder-only transformer of every model family (model_family.hpp: Llama, Qwen2/3, their MoE variants,
// gpt-oss, ...) with optional LoRA adapters and a value head, as a LibTorch module. Tensor names follow Hugging Face
// so state dicts load and save in HF layout; adapters follow PEFT names. The class keeps the weights and runs the
// layer recipe; its parts live in their own units (model_weights.hpp, step_context.hpp, aten_ops.hpp,
// experts_layer.hpp, weight_io.hpp, rope_tables.hpp; docs/engine.md, "The model's structure").
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <rlloop/types.hpp>

#include "model/experts.hpp"
#include "model/kv_cache.hpp"
#include "model/model_config.hpp"
#include "model/model_family.hpp"
#include "kernels/quantized_matrix.hpp"

namespace rlloop::engine {

using TensorMap = std::map<std::string, torch::Tensor>;

// What an inference kernel reads: the parameters themselves as plain tensors (no autograd, no copies).
struct LinearWeights {
  torch::Tensor weight;          // [out, in]; undefined when the weight is quantized
  std::shared_ptr<const QuantizedMatrix> quantized;  // the weight in its GGUF blocks, or null
  torch::Tensor bias;            // [out]; undefined without bias
  torch::Tensor lora_a, lora_b;  // [rank, in], [out, rank]; undefined without an adapter
  double lora_scale = 0.0;       // y = x W^T + b + lora_scale * (x A^T) B^T

  std::int64_t out_features() const { return quantized ? quantized->rows() : weight.size(0); }
  std::int64_t in_features() const { return quantized ? quantized->cols() : weight.size(1); }
};
struct LayerWeights {
  torch::Tensor input_norm, post_norm, q_norm, k_norm;  // q_norm/k_norm only with qk_norm
  LinearWeights q, k, v, o, gate, up, down;

  const LinearWeights& projection(Projection p) const { return projection_member(*this, p); }
};
struct InferenceWeights {
  torch::Tensor embed, final_norm;  // embed undefined when quantized_embed holds it
  std::shared_ptr<const QuantizedMatrix> quantized_embed;
  std::vector<LayerWeights> layers;
  LinearWeights lm_head;
  torch::Tensor rope_cos, rope_sin;  // [max_position_embeddings, head_dim], the tables hidden_states uses
};

class Transformer;
namespace dist {
class Group;
}

// The experts of every sparse layer a model holds: [first, first + count); count -1: all of them. A rank of an
// expert-parallel group holds its slice (Transformer::set_expert_parallel).
struct ExpertRange {
  std::int64_t first = 0;
  std::int64_t count = -1;
};

// One batch of sequences in a decoding step of several (Transformer::decode_step): the model whose adapters apply
// to its rows, the tokens its rows feed, and its cache (each batch at its own length). Either one new token per
// sequence (rows == cache->batch()), or a chunk of a prompt: rows consecutive tokens of the one sequence of a cache
// of batch 1 (chunked prefill: prompts prefill in the steps that decode other requests).
struct DecodeGroup {
  Transformer* model;
  const torch::Tensor* tokens;  // [rows] int64
  KVCache* cache;
  // Whether the step returns logits for this group: every row's for one token per sequence, the last row's for a
  // chunk (the one the next token is drawn from); none when false (a chunk that does not end its prompt).
  bool logits = true;
};

class Transformer : public torch::nn::Module {
 public:
  explicit Transformer(const ModelConfig& cfg);
  // Allocates the weights directly with `options` (device, dtype): loading a large model onto a GPU
  // never materialises an fp32 CPU copy first. Weights start at zero, norms at one.
  Transformer(const ModelConfig& cfg, torch::TensorOptions options);
  // The same with the matrices named in `quantized` (HF names of the embedding, the projections and lm_head,
  // each of its shape) kept in their blocks instead of parameters: a frozen base for LoRA sessions
  // (quantized_matrix.hpp). CPU and fp32 only. Such a model trains adapters only: full fine-tuning, and loading
  // those matrices' values, need dense weights.
  // `experts`: the experts of each sparse layer it holds (all by default), under their global names.
  Transformer(const ModelConfig& cfg, torch::TensorOptions options, const QuantizedTensors& quantized,
              ExpertRange experts = {});

  const ModelConfig& config() const;
  // The KV block pools of this model's base (kv_cache.hpp): shared by every model over the same base weights
  // (sharing_base), so that their requests' caches can decode in one step.
  const std::shared_ptr<KVPools>& kv_pools() const;

  // A model over `base`'s weights (the same tensors, not copies) for sessions that share one base model and
  // train only their own LoRA adapters (enable_lora) and value head. `base` must have neither; its weights are
  // frozen here (requires_grad false) and must not change while another model shares them.
  static std::shared_ptr<Transformer> sharing_base(Transformer& base);

  // input_ids: [B, T] int64. Without a cache, positions are 0..T-1 with a causal mask. With a cache, the
  // tokens continue the cached positions and the cache is extended. Returns the final-norm hidden states [B, T, H].
  // `routing` (models with experts, experts.hpp): records the experts every sparse layer routed each token to, and
  // routes by given ones where routing->replay is defined (invalid_argument when its shape or ids do not fit).
  torch::Tensor hidden_states(const torch::Tensor& input_ids, KVCache* cache = nullptr,
                              ExpertRouting* routing = nullptr);
  // Activation checkpointing (off by default): a forward that builds a graph keeps only each layer's input and
  // recomputes the layer in backward, trading one more forward for activation memory that no longer grows with the
  // number of layers times the MLP's width. Values and gradients are those of the plain graph.
  void set_activation_checkpointing(bool on);
  // Expert parallelism: this model (built with rank r's ExpertRange of `group`: the r-th of its size's equal slices
  // of the experts) routes its tokens to every rank's experts through `group` in every forward that builds on
  // hidden_states or decode_step (training, scoring, prefill, decoding): every rank of the group must run its
  // forwards together with the others' (a rank with nothing to compute runs hidden_states over [0, 1]), or they
  // wait on each other until the group's timeout. Adapters on the experts (enable_lora, before or after) are every
  // expert's on every rank, each rank applying its own experts'. invalid_argument when the group's size does not
  // divide the experts or the model holds another slice.
  void set_expert_parallel(dist::Group& group);
  // Fully sharded data parallelism (fully_sharded.hpp; ZeRO-3): from now on this rank keeps 1/W of every weight
  // (named_trainable_parameters returns these shards under the weights' names, so the optimizer's state is 1/W
  // too), and every decoder layer is gathered from `group` just before its forward and again in its backward (which
  // recomputes the layer), freed after, its gradient reduce-scattered into the shards. The embedding, final norm
  // and unembedding are gathered for a whole pass: every forward (hidden_states, decode_step) runs within a
  // ShardedPass. Every rank of the group runs its passes together with the others'. A frozen model (a shared base:
  // its weights require no grad) is sharded the same way, reduce-scattering nothing: the models sharing_base makes
  // over it share its shards and train their own adapters, replicated. A dense model without a value head, adapters
  // or quantized weights; unsupported, naming what, otherwise.
  void set_fully_sharded(dist::Group& group);
  // The same for a model built on the meta device (its weights' shapes, no storage), that never holds it whole:
  // `source` makes each weight whole (given its HF name and meta tensor), one at a time in hf_state_dict's order,
  // and only this rank's part of it is kept. The shards, the emptied handles and the KV pools get `options`.
  using WeightSource = std::function<torch::Tensor(const std::string& name, const torch::Tensor& shape)>;
  void set_fully_sharded(dist::Group& group, const torch::TensorOptions& options, const WeightSource& source);
  // Whether this model's weights are sharded (its own, or the sharded base it shares).
  bool fully_sharded() const;
  // Whether it trains the shards (full fine-tuning; false for a model over a sharded frozen base).
  bool trains_shards() const;
  // Why set_fully_sharded would refuse this model (its message), or empty.
  std::string why_not_fully_shardable() const;
  // Tensor parallelism for decoding (tensor_parallel.hpp): this rank's slice of the model, built by every rank of
  // `group` together from this model, whole or fully sharded (its layers then gathered one at a time): the config
  // cut to the rank's heads and widths, the vocabulary's rows, the adapters cut with their linears, KV pools of its
  // own, nothing that trains (no value head). Its forwards run on every rank of the group in step. unsupported,
  // naming what (why_not_tensor_parallel), when the model cannot be cut over the group's size.
  std::shared_ptr<Transformer> tensor_parallel(dist::Group& group);
  std::string why_not_tensor_parallel(int ranks) const;
  bool is_tensor_parallel() const;
  // The elements of every sharded weight whole (0 for a model that is not sharded).
  std::int64_t sharded_elements() const;
  // A fully sharded model's weight `name` whole, from every rank's `part` of it (its shard, or the shard's gradient
  // or optimizer moment: every rank calls it together, in the same order), and this rank's part of a whole one.
  // invalid_argument for a name the model does not shard or a shape that does not fit.
  torch::Tensor unshard(const std::string& name, const torch::Tensor& part) const;
  // `rank`: another rank's part (-1: this rank's).
  torch::Tensor shard_of(const std::string& name, const torch::Tensor& whole, int rank = -1) const;
  bool activation_checkpointing() const;
  // Whether set_expert_parallel made this model route through a group.
  bool expert_parallel() const;
  // Whether `name` (a weight, a trainable parameter, or an optimizer state entry "<parameter>.exp_avg") belongs to
  // an expert of a sparse layer: under expert parallelism such tensors are each rank's own, every other one is the
  // same on every rank.
  bool is_expert_tensor(const std::string& name) const;
  // Under expert parallelism, the rank that holds `name` when it is one expert's tensor (a name of
  // "<layer's experts>.<e>."); -1 for the tensors every rank holds, and without expert parallelism.
  int expert_rank_of(const std::string& name) const;
  // Unembedding (lm_head, or the tied embedding), LoRA included when enabled: [B, T, H] -> [B, T, V].
  torch::Tensor logits(const torch::Tensor& hidden);
  torch::Tensor forward(const torch::Tensor& input_ids, KVCache* cache = nullptr) {
    return logits(hidden_states(input_ids, cache));
  }

  // One new token for every sequence of several batches at once (or a chunk of a prompt for a group that is one),
  // each with its own cache (so its own positions) and its own model over this model's base weights (shares_base:
  // sessions with their own adapters on one base): the base products run once over the rows of every group, each
  // group's adapters over its rows, and each group's rows attend over its own cache, which grows by one position
  // (by the chunk's length for a chunk). The layers are hidden_states' (one definition). Returns the logits of the
  // rows DecodeGroup::logits asks for, [those rows, V] in the groups' order. `routes`, when given (models with
  // experts), receives the experts each row was routed to in each sparse layer: [sum of rows, sparse layers, k]
  // int64.
  torch::Tensor decode_step(std::span<const DecodeGroup> groups, torch::Tensor* routes = nullptr);
  // True when `other` computes with the same base weights (the same tensors: models of one shared base).
  bool shares_base(const Transformer& other) const;

  // Base weights under HF names ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", ...,
  // "lm_head.weight" unless tied; each expert's projections by expert_module's names even where checkpoints stack
  // them: expert_layout.hpp converts), quantized ones dequantized to fp32. Loading checks every name and shape and
  // copies in place; it takes the dense weights only (a quantized model's matrices are fixed at construction).
  TensorMap hf_state_dict() const;
  void load_hf_state_dict(const TensorMap& tensors);

  // LoRA: adds adapters to the selected linears (LoraOptions::target_modules), freezes every base weight.
  // A is initialised from `seed` (Kaiming-uniform), B to zero, so the adapted model equals the base model.
  void enable_lora(const LoraOptions& options, std::int64_t seed);
  bool has_lora() const;
  const std::optional<LoraOptions>& lora_options() const;
  std::vector<torch::Tensor> lora_a_parameters();
  std::vector<torch::Tensor> lora_b_parameters();
  // Adapters under PEFT names ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight").
  TensorMap peft_state_dict() const;
  void load_peft_state_dict(const TensorMap& tensors);
  // Base weights with W + (alpha / rank) * B A folded in (HF names); the module itself is not changed.
  TensorMap merged_hf_state_dict() const;

  // PPO critic: a scalar linear head on the final hidden states ("value_head.weight" / "value_head.bias"),
  // initialised from `seed` (weight ~ N(0, 0.02^2), bias 0), always trainable (with LoRA too). Not part of the
  // HF state dict.
  void enable_value_head(std::int64_t seed);
  bool has_value_head() const;
  // [B, T, H] -> [B, T] fp32.
  torch::Tensor values(const torch::Tensor& hidden);

  // The bytes of the matrices kept quantized (0 for a dense model), and how many values they hold.
  std::int64_t quantized_bytes() const;
  std::int64_t quantized_values() const;

  // Whether the CPU's decoding kernels (cpu_decoder.hpp: decoder_layer over host buffers) implement this model as
  // it is. Asked of each layer (dense, plain causal attention, fp32 tensors on the CPU), so that a layer they do not
  // implement (experts, attention sinks, a window, another dtype or device) is decoded by decode_step, never as
  // another layer.
  bool cpu_kernels_decode() const;
  // Views of the current weights for inference kernels (see InferenceWeights): the dense layer's. A sparse layer's
  // gate, up and down are empty and its router and experts are not there (the CPU decoder takes dense models only).
  InferenceWeights inference_weights();

  // What the optimizer updates: the adapters with LoRA, every weight without, plus the value head if any.
  // Names are stable across runs.
  std::vector<std::pair<std::string, torch::Tensor>> named_trainable_parameters();

 private:
  friend class ShardedPass;
  Transformer();  // an empty module for sharing_base to fill
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

// One pass (forward, and backward if it builds a graph; or one decoding step) of a fully sharded model, on every
// rank of its group together: opening it gathers the root weights (embedding, final norm, unembedding) for the whole
// pass, and reduce_gradients() after the backward reduce-scatters their gradient into the shards (when they train);
// closing it frees them.
// On a model that is not sharded it does nothing.
class ShardedPass {
 public:
  explicit ShardedPass(Transformer& model);
  ~ShardedPass();
  ShardedPass(const ShardedPass&) = delete;
  ShardedPass& operator=(const ShardedPass&) = delete;
  void reduce_gradients();

 private:
  Transformer& model_;
};

}  // namespace rlloop::engine
