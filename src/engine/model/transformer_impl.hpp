// Transformer's private state (transformer.hpp declares it only): its weights (model_weights.hpp) and what the
// recipe keeps beside them. Shared by the units that implement Transformer: transformer.cpp (the model and its
// forward passes) and transformer_parallel.cpp (fully sharded and tensor-parallel models).
#pragma once
#include <memory>
#include <utility>
#include <vector>

#include "model/aten_ops.hpp"
#include "model/experts_layer.hpp"
#include "model/fully_sharded.hpp"
#include "model/model_weights.hpp"
#include "model/rope_tables.hpp"
#include "model/step_context.hpp"
#include "model/tensor_parallel.hpp"
#include "model/transformer.hpp"

namespace rlloop::engine {

// The weights, and what the recipe keeps beside them: how to run the layers (checkpointing, the experts' dispatch),
// the RoPE tables and the base's KV pools.
struct Transformer::Impl : ModelWeights {
  bool checkpoint_layers = false;     // set_activation_checkpointing
  std::shared_ptr<KVPools> kv_pools;  // the base's: every model sharing it draws its caches' blocks from them
  ExpertsLayer experts;               // the sparse layers' routing and dispatch (expert parallelism)
  RopeTables rope;
  // Fully sharded (set_fully_sharded, or a model sharing a sharded base): the units of each layer and of the root
  // (embedding, final norm, unembedding), which every model over the base shares; this model's layers over its own
  // handles of them; the root's weights, gathered whole while a ShardedPass holds them.
  struct Sharding {
    std::vector<std::unique_ptr<ShardedUnit>> layers;
    std::unique_ptr<ShardedUnit> root;
  };
  std::shared_ptr<const Sharding> sharding;
  std::vector<ShardedLayer> sharded_layers;
  std::unique_ptr<GatherPipeline> gathers;  // this model's layers' gathers, each started a layer ahead
  UnitSlots root_slots;
  std::vector<torch::Tensor> root_weights;

  // This model's handles of layer `li`'s weights, and of the root's (the tied unembedding is the embedding's
  // handle twice: one weight).
  UnitSlots layer_slots(std::size_t li) {
    UnitSlots slots;
    for_each_layer_tensor(layers[li], static_cast<std::int64_t>(li),
                          [&](const std::string& name, torch::Tensor& t) { slots.emplace_back(name, &t); });
    return slots;
  }
  UnitSlots root_slots_of() {
    const WeightNames& n = family->names;
    UnitSlots root{{n.embed + ".weight", &embed}, {n.final_norm + ".weight", &final_norm}};
    root.emplace_back(cfg.tie_word_embeddings ? n.embed + ".weight" : n.lm_head + ".weight", &lm_head.weight);
    return root;
  }
  // Runs this model's layers over `s`'s units.
  void use_sharding(std::shared_ptr<const Sharding> s, std::unique_ptr<GatherPipeline> pipeline) {
    sharding = std::move(s);
    gathers = std::move(pipeline);
    const auto& units = sharding->layers;
    for (std::size_t li = 0; li < layers.size(); ++li)
      sharded_layers.push_back({units[li].get(), layer_slots(li),
                                [this, li](const torch::Tensor& x, const StepContext& in) {
                                  return layer_forward(li, x, in);
                                },
                                [this, li] { return layers[li].trains(); }, gathers.get(),
                                li + 1 < units.size() ? units[li + 1].get() : nullptr,
                                li > 0 ? units[li - 1].get() : nullptr});
    root_slots = root_slots_of();
  }

  torch::Tensor layer_forward(std::size_t li, torch::Tensor x, const StepContext& in) const {
    return aten_decoder_layer(*this, experts, li, std::move(x), in);
  }
  std::pair<torch::Tensor, torch::Tensor> rope_tables(torch::Device device, torch::ScalarType dtype) {
    return rope.get(cfg, device, dtype);
  }
  torch::Tensor embed_rows(const torch::Tensor& ids) const {
    torch::Tensor x = tensor_parallel ? tensor_parallel->embed(embed, ids)
                      : embed_quantized ? embed_quantized->rows_of(ids)
                                        : torch::embedding(embed, ids);
    // Gemma's sqrt(hidden_size), rounded to the model's dtype first as transformers rounds it.
    if (cfg.scale_embeddings) x = x * torch::scalar_tensor(cfg.embedding_multiplier(), x.options());
    return x;
  }
  torch::Tensor final_norm_of(const torch::Tensor& x) const {
    return rms_norm(x, norm_scale(final_norm), cfg.rms_norm_eps);
  }
  // The logits over the whole vocabulary from the unembedding's output (a tensor-parallel rank's columns: gathered).
  torch::Tensor whole_vocabulary(torch::Tensor logits) const {
    return tensor_parallel ? tensor_parallel->gather_vocabulary(logits) : logits;
  }
  // Layer li's weights whole, by name (a sharded layer gathered: every rank together), and the root's.
  TensorMap whole_layer(std::size_t li) {
    TensorMap out;
    if (!sharding) {
      for_each_layer_tensor(layers[li], static_cast<std::int64_t>(li),
                            [&](const std::string& name, const torch::Tensor& t) { out[name] = t; });
      return out;
    }
    return gathered(*sharding->layers[li]);
  }
  TensorMap whole_root() {
    if (sharding) return gathered(*sharding->root);
    TensorMap out;
    for (const auto& [name, handle] : root_slots_of()) out[name] = *handle;
    return out;
  }
  static TensorMap gathered(const ShardedUnit& unit) {
    const std::vector<torch::Tensor> wholes = unit.unpack(unit.gather(unit.flat_shard()), /*trainable=*/false);
    TensorMap out;
    for (std::size_t i = 0; i < wholes.size(); ++i) out[unit.shards()[i].first] = wholes[i];
    return out;
  }
  // Gemma 2's soft-cap of the output logits, cap * tanh(logits / cap), where the model has one.
  torch::Tensor capped(torch::Tensor logits) const {
    const double cap = cfg.final_logit_softcapping;
    return cap > 0 ? torch::tanh(logits / cap) * cap : logits;
  }
  class CheckpointedLayer;
};

}  // namespace rlloop::engine
