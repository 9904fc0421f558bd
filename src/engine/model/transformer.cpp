// The transformer: the weights (model_weights.hpp) and the recipe that runs them. A forward builds its step's row
// and KV layout (step_context.hpp) and runs every layer's recipe (decoder_layer.hpp) through the ATen backend
// (aten_ops.hpp), the sparse layers' experts through their dispatch (experts_layer.hpp); the state dicts are
// weight_io.hpp's, the LoRA adapters lora.cpp's. The math follows Hugging Face transformers' eager implementation
// step by step (fp32 RMSNorm, rotate_half RoPE, softmax in fp32) so HF weights give the same logits.
#include "model/transformer.hpp"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <utility>

#include <rlloop/error.hpp>

#include "kernels/device.hpp"
#include "kernels/fused_ops.hpp"
#include "model/aten_ops.hpp"
#include "model/experts_layer.hpp"
#include "model/fully_sharded.hpp"
#include "model/model_weights.hpp"
#include "model/rope_tables.hpp"
#include "model/step_context.hpp"
#include "model/tensor_parallel.hpp"
#include "model/weight_io.hpp"

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

// ------------------------------------------------------------------------------------------ Transformer

Transformer::Transformer() : impl_(std::make_shared<Impl>()) {}

Transformer::Transformer(const ModelConfig& cfg) : Transformer(cfg, torch::TensorOptions().dtype(torch::kFloat32)) {}

Transformer::Transformer(const ModelConfig& cfg, torch::TensorOptions options)
    : Transformer(cfg, options, QuantizedTensors{}) {}

Transformer::Transformer(const ModelConfig& cfg, torch::TensorOptions options, const QuantizedTensors& quantized,
                         ExpertRange experts)
    : impl_(std::make_shared<Impl>()) {
  cfg.validate();
  if (experts.count == -1 && experts.first == 0) experts.count = cfg.num_experts;  // the default: all of them
  if (experts.first < 0 || experts.count < (cfg.num_experts > 0 ? 1 : 0) ||
      experts.first + experts.count > cfg.num_experts)
    throw invalid_argument("Transformer: experts [" + std::to_string(experts.first) + ", " +
                           std::to_string(experts.first + experts.count) + ") are not within the model's " +
                           std::to_string(cfg.num_experts));
  const bool cpu_fp32 = options.device().is_cpu() && c10::typeMetaToScalarType(options.dtype()) == torch::kFloat32;
  if (!quantized.empty() && !cpu_fp32)
    throw invalid_argument("Transformer: quantized weights need an fp32 model on the CPU");
  impl_->kv_pools = std::make_shared<KVPools>(cfg, options.device());
  impl_->build(cfg, options, quantized, experts.first, experts.count,
               [this](const std::string& name, const torch::Tensor& value) {
                 return register_parameter(name, value, /*requires_grad=*/true);
               });
}

const ModelConfig& Transformer::config() const { return impl_->cfg; }

const std::shared_ptr<KVPools>& Transformer::kv_pools() const { return impl_->kv_pools; }

std::shared_ptr<Transformer> Transformer::sharing_base(Transformer& base) {
  const Impl& from = *base.impl_;
  if (from.lora || base.has_value_head())
    throw conflict("Transformer::sharing_base: the base model has adapters or a value head of its own");
  if (from.experts.parallel())
    throw conflict("Transformer::sharing_base: the base model is expert-parallel (its sessions would not share it)");
  for (auto& p : base.parameters())
    if (p.requires_grad()) p.set_requires_grad(false);  // written once: later users only read the flag
  auto shared = std::shared_ptr<Transformer>(new Transformer());
  Impl& to = *shared->impl_;
  static_cast<ModelWeights&>(to) = from;  // the same tensors (the base has neither adapters nor a value head)
  to.kv_pools = from.kv_pools;
  to.for_each_base([&](const std::string& name, const torch::Tensor& t) {
    shared->register_parameter(module_name(name), t, /*requires_grad=*/false);
  });
  // Its handles hold the placeholders: bound in its passes, whose gathers are its own.
  if (from.sharding) to.use_sharding(from.sharding, std::make_unique<GatherPipeline>());
  return shared;
}

// A layer under activation checkpointing: forward keeps only the layer's input (and the RoPE rows), backward runs
// the layer again with its graph and differentiates it at once, as PyTorch's reentrant torch.utils.checkpoint does.
// A training step then holds one [B, T, H] tensor per layer plus one layer's activations, instead of every
// layer's (the MLP's [B, T, intermediate] products and the attention's inputs and outputs), for a second forward's
// compute. The layer's parameters are not inputs: the inner backward accumulates their gradients itself. `anchor`
// is a 0-element tensor that requires grad, so that the layer is part of the graph when its adapters train but its
// input does not (the first layer of a LoRA model); a layer with neither runs plainly. The model must outlive the
// graph, as for target_logprobs. A sparse layer's recompute replays the routes its forward took (hidden_states
// always records them under checkpointing), so that the gradients are those of the forward's routing even where
// the recompute's arithmetic could differ in the last bits.
class Transformer::Impl::CheckpointedLayer : public torch::autograd::Function<CheckpointedLayer> {
 public:
  static torch::Tensor run(const Impl& impl, std::size_t li, const torch::Tensor& x, const StepContext& in) {
    // Nothing to differentiate (a frozen layer whose input needs no gradient): the plain forward, no graph.
    if (!x.requires_grad() && !impl.layers[li].trains()) return impl.layer_forward(li, x, in);
    const torch::Tensor anchor = torch::empty({0}, x.options()).requires_grad_(!x.requires_grad());
    return apply(x, in.cos, in.sin, anchor, &impl, static_cast<std::int64_t>(li), in.scale, in.routing);
  }

  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor x, torch::Tensor cos,
                               torch::Tensor sin, torch::Tensor anchor, const Impl* impl, std::int64_t li,
                               double scale, ExpertRouting* routing) {
    (void)anchor;
    ctx->save_for_backward({x, cos, sin});
    // saved_data holds IValues: the model's address (see above), the layer and the scale; the forward's routes
    // (every layer's, filled in as the forward goes on: kept here by reference, not as a saved variable, whose
    // version autograd would check).
    ctx->saved_data["impl"] = static_cast<std::int64_t>(reinterpret_cast<std::intptr_t>(impl));
    ctx->saved_data["layer"] = li;
    ctx->saved_data["scale"] = scale;
    if (routing) ctx->saved_data["routes"] = routing->recorded;
    StepContext in{cos, sin, scale, nullptr, 0};
    in.routing = routing;
    return impl->layer_forward(static_cast<std::size_t>(li), x, in);
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto* impl = reinterpret_cast<const Impl*>(static_cast<std::intptr_t>(ctx->saved_data["impl"].toInt()));
    const auto li = static_cast<std::size_t>(ctx->saved_data["layer"].toInt());
    StepContext in{saved[1], saved[2], ctx->saved_data["scale"].toDouble(), nullptr, 0};
    ExpertRouting replay;
    if (ctx->saved_data.count("routes")) {
      replay.replay = ctx->saved_data["routes"].toTensor();
      replay.recorded = torch::empty_like(replay.replay);
      in.routing = &replay;
    }
    const bool x_needs_grad = ctx->needs_input_grad(0);
    torch::AutoGradMode enable(true);
    const torch::Tensor x = saved[0].detach().requires_grad_(x_needs_grad);
    const torch::Tensor out = impl->layer_forward(li, x, in);
    torch::Tensor grad_x;
    if (out.requires_grad()) {
      torch::autograd::backward({out}, {grads[0]});
      if (x_needs_grad) grad_x = x.grad();
    }
    return {grad_x,          torch::Tensor(), torch::Tensor(), torch::Tensor(),
            torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

void Transformer::set_activation_checkpointing(bool on) { impl_->checkpoint_layers = on; }

bool Transformer::activation_checkpointing() const { return impl_->checkpoint_layers; }

bool Transformer::expert_parallel() const { return impl_->experts.parallel(); }

bool Transformer::is_expert_tensor(const std::string& name) const {
  return ExpertsLayer::is_expert_tensor(*impl_, name);
}

int Transformer::expert_rank_of(const std::string& name) const { return impl_->experts.rank_of(*impl_, name); }

void Transformer::set_expert_parallel(dist::Group& group) { impl_->experts.set_parallel(*impl_, group); }

std::string Transformer::why_not_fully_shardable() const {
  const Impl& m = *impl_;
  const std::string what = "fully sharded parallelism: ";
  if (m.sharding) return what + "the model is sharded already";
  if (m.lora) return what + "a LoRA model is sharded through its base (shard the base before sharing it)";
  if (quantized_bytes() > 0) return what + "the model keeps quantized weights (it needs dense ones)";
  if (has_value_head()) return what + "a model with a value head is not sharded yet";
  if (m.cfg.num_experts > 0) return what + "Mixture-of-Experts models are not sharded yet";
  return {};
}

namespace {
// The unit of a fully sharded model that holds weight `name`, and its index there.
template <class Sharding>
std::pair<const ShardedUnit*, int> unit_of(const std::shared_ptr<const Sharding>& sharding, const std::string& name) {
  if (!sharding) throw invalid_argument("'" + name + "': the model is not fully sharded");
  if (int i = sharding->root->find(name); i >= 0) return {sharding->root.get(), i};
  for (const auto& unit : sharding->layers)
    if (int i = unit->find(name); i >= 0) return {unit.get(), i};
  throw invalid_argument("'" + name + "' is not a weight of this fully sharded model");
}
}  // namespace

void Transformer::set_fully_sharded(dist::Group& group) {
  Impl& m = *impl_;
  if (std::string why = why_not_fully_shardable(); !why.empty()) throw unsupported(why);
  auto gathers = std::make_unique<GatherPipeline>();  // its setting checked before any weight is cut
  auto sharding = std::make_shared<Impl::Sharding>();
  for (std::size_t li = 0; li < m.layers.size(); ++li)
    sharding->layers.push_back(std::make_unique<ShardedUnit>(m.layer_slots(li), group));
  sharding->root = std::make_unique<ShardedUnit>(m.root_slots_of(), group);
  m.use_sharding(std::move(sharding), std::move(gathers));
}

void Transformer::set_fully_sharded(dist::Group& group, const torch::TensorOptions& options,
                                    const WeightSource& source) {
  Impl& m = *impl_;
  if (std::string why = why_not_fully_shardable(); !why.empty()) throw unsupported(why);
  if (!m.device().is_meta())
    throw invalid_argument("Transformer::set_fully_sharded: a model filled by its source is built on the meta device");
  auto gathers = std::make_unique<GatherPipeline>();
  const TensorMap shapes = hf_state_dict();  // the names and meta tensors, before the units empty the handles
  const bool trains = m.embed.requires_grad();
  auto sharding = std::make_shared<Impl::Sharding>();
  for (std::size_t li = 0; li < m.layers.size(); ++li)
    sharding->layers.push_back(std::make_unique<ShardedUnit>(m.layer_slots(li), group, options, trains));
  sharding->root = std::make_unique<ShardedUnit>(m.root_slots_of(), group, options, trains);
  std::shared_ptr<const Impl::Sharding> units = sharding;
  for (const auto& [name, shape] : shapes) unit_of(units, name).first->fill(name, source(name, shape));
  // The module's own list still holds the meta tensors: the placeholders the handles hold now replace them.
  m.for_each_base([&](const std::string& name, const torch::Tensor& t) { parameters_[module_name(name)] = t; });
  m.options = options;
  m.kv_pools = std::make_shared<KVPools>(m.cfg, options.device());
  m.use_sharding(std::move(sharding), std::move(gathers));
}

bool Transformer::fully_sharded() const { return impl_->sharding != nullptr; }

bool Transformer::trains_shards() const { return impl_->sharding && impl_->sharding->root->trains(); }

std::int64_t Transformer::sharded_elements() const {
  if (!impl_->sharding) return 0;
  std::int64_t n = impl_->sharding->root->elements();
  for (const auto& unit : impl_->sharding->layers) n += unit->elements();
  return n;
}

torch::Tensor Transformer::unshard(const std::string& name, const torch::Tensor& part) const {
  const auto [unit, i] = unit_of(impl_->sharding, name);
  return unit->whole(i, part);
}

torch::Tensor Transformer::shard_of(const std::string& name, const torch::Tensor& whole, int rank) const {
  const auto [unit, i] = unit_of(impl_->sharding, name);
  return unit->part_of(i, whole, rank);
}

// ------------------------------------------------------------------------------------------ tensor parallelism

std::string Transformer::why_not_tensor_parallel(int ranks) const {
  const Impl& m = *impl_;
  const ModelConfig& c = m.cfg;
  const std::string what = "tensor parallelism over " + std::to_string(ranks) + " ranks: ";
  if (m.tensor_parallel) return what + "the model is a tensor-parallel slice already";
  if (quantized_bytes() > 0) return what + "the model keeps quantized weights (it needs dense ones)";
  if (m.experts.parallel()) return what + "the model's experts are spread over the ranks (expert parallelism)";
  for (const Layer& l : m.layers)
    if (l.expert_lora.gate_up_a.defined() || l.expert_lora.down_a.defined())
      return what + "adapters on the experts are not cut yet";
  for (auto [name, n] : {std::pair{"num_attention_heads", c.num_attention_heads},
                         std::pair{"num_key_value_heads", c.num_key_value_heads},
                         std::pair{"intermediate_size", c.intermediate_size},
                         std::pair{"moe_intermediate_size", c.num_experts > 0 ? c.moe_intermediate_size : 0},
                         std::pair{"vocab_size", c.vocab_size}})
    if (n % ranks != 0) return what + std::string(name) + " " + std::to_string(n) + " does not divide by the ranks";
  return {};
}

std::shared_ptr<Transformer> Transformer::tensor_parallel(dist::Group& group) {
  Impl& from = *impl_;
  const int W = group.size(), r = group.rank();
  if (std::string why = why_not_tensor_parallel(W); !why.empty()) throw unsupported(why);
  ModelConfig cut = from.cfg;
  cut.num_attention_heads /= W;
  cut.num_key_value_heads /= W;
  cut.intermediate_size /= W;
  if (cut.num_experts > 0) cut.moe_intermediate_size /= W;
  auto out = std::make_shared<Transformer>(cut, from.options);
  Impl& to = *out->impl_;
  torch::NoGradGuard no_grad;
  // Every tensor of `slots` from its whole value in `wholes`, sliced for this rank's shape. A row-parallel linear's
  // bias (its weight cut by columns) is rank 0's alone.
  auto fill = [&](const UnitSlots& slots, const TensorMap& wholes) {
    const std::map<std::string, torch::Tensor*> local(slots.begin(), slots.end());
    for (const auto& [name, handle] : slots) {
      bool rank_zero_only = false;
      if (name.ends_with(".bias")) {
        const auto weight = local.find(name.substr(0, name.size() - 5) + ".weight");
        rank_zero_only = weight != local.end() && weight->second->dim() == 2 &&
                         weight->second->size(1) != wholes.at(weight->first).size(1);
      }
      handle->set_data(tensor_parallel_slice(wholes.at(name), handle->sizes(), r, rank_zero_only));
    }
  };
  for (std::size_t li = 0; li < from.layers.size(); ++li) fill(to.layer_slots(li), from.whole_layer(li));
  // The vocabulary's rows: the embedding and unembedding were made whole-sized by the cut config.
  const TensorMap root = from.whole_root();
  const WeightNames& n = to.family->names;
  to.embed.set_data(root.at(n.embed + ".weight").chunk(W, 0)[r].clone());
  to.final_norm.set_data(root.at(n.final_norm + ".weight").clone());
  if (!to.cfg.tie_word_embeddings) to.lm_head.weight.set_data(root.at(n.lm_head + ".weight").chunk(W, 0)[r].clone());
  if (from.lora) {
    out->enable_lora(*from.lora, 0);  // adapters of the cut shapes, their values set below
    TensorMap adapters;
    to.for_each_adapter([&](const std::string& name, const torch::Tensor& t, bool) { adapters[name] = t; });
    from.for_each_adapter([&](const std::string& name, const torch::Tensor& t, bool) {
      const torch::Tensor& target = adapters.at(name);
      target.set_data(tensor_parallel_slice(t.detach(), target.sizes(), r, false));
    });
  }
  for (auto& p : out->parameters()) p.set_requires_grad(false);
  to.tensor_parallel = std::make_shared<TensorParallel>(group, from.cfg.vocab_size);
  return out;
}

bool Transformer::is_tensor_parallel() const { return impl_->tensor_parallel != nullptr; }

ShardedPass::ShardedPass(Transformer& model) : model_(model) {
  auto& m = *model_.impl_;
  if (!m.sharding) return;
  if (!m.root_weights.empty()) throw conflict("ShardedPass: the model is in a pass already");
  m.gathers->begin_pass();
  const ShardedUnit& root = *m.sharding->root;
  m.root_weights = root.unpack(root.gather(root.flat_shard()), torch::GradMode::is_enabled() && root.trains());
  root.bind(m.root_slots, m.root_weights);
}

void ShardedPass::reduce_gradients() {
  auto& m = *model_.impl_;
  if (!m.sharding || !m.sharding->root->trains()) return;
  const ShardedUnit& root = *m.sharding->root;
  std::vector<torch::Tensor> grads;
  for (const torch::Tensor& w : m.root_weights) grads.push_back(w.grad());
  root.accumulate(root.reduce_scatter(root.pack(grads)));
}

ShardedPass::~ShardedPass() {
  auto& m = *model_.impl_;
  if (!m.sharding) return;
  m.sharding->root->unbind(m.root_slots);
  m.root_weights.clear();
}

torch::Tensor Transformer::hidden_states(const torch::Tensor& input_ids, KVCache* cache, ExpertRouting* routing) {
  const ModelConfig& cfg = impl_->cfg;
  const auto device = impl_->device();
  check_forward_input(cfg, device, input_ids, cache, impl_->experts.parallel() || impl_->sharding);
  const std::int64_t B = input_ids.size(0), T = input_ids.size(1);
  const std::int64_t past = cache ? cache->length : 0;
  torch::Tensor ids = input_ids.device() == device ? input_ids : input_ids.to(device);
  const bool sharded = impl_->sharding != nullptr;
  if (sharded && impl_->root_weights.empty())
    throw std::logic_error("Transformer: a fully sharded model's forward runs within a ShardedPass");

  // [T, D] rows of the RoPE tables, broadcast over batch and heads.
  const auto [cos_table, sin_table] = impl_->rope_tables(device, impl_->dtype());
  const double scale = cfg.attention_scale();
  torch::Tensor x = impl_->embed_rows(ids);
  StepContext in =
      StepContext::prefill(cos_table.narrow(0, past, T), sin_table.narrow(0, past, T), scale, cache, B, T, device);
  // Checkpointed layers keep only their input for backward and recompute the rest there (training, no cache).
  const bool checkpoint = impl_->checkpoint_layers && !cache && torch::GradMode::is_enabled();
  // Under checkpointing a sparse layer's recompute replays its forward's routes (CheckpointedLayer): they are
  // recorded even when the caller asked for none.
  ExpertRouting own_routing;
  if (!routing && checkpoint && cfg.num_experts > 0) routing = &own_routing;
  if (routing) {
    ExpertsLayer::check_routing(*impl_, *routing, B * T);
    if (routing->replay.defined() && routing->replay.device() != device) routing->replay = routing->replay.to(device);
    if (routing->mask.defined() && routing->mask.device() != device) routing->mask = routing->mask.to(device);
    routing->recorded = torch::empty({B * T, impl_->sparse_layers(), cfg.num_experts_per_tok},
                                     torch::TensorOptions().dtype(torch::kLong).device(device));
    in.routing = routing;
  }
  for (std::size_t li = 0; li < impl_->layers.size(); ++li)
    x = sharded      ? run_sharded_layer(impl_->sharded_layers[li], x, in)
        : checkpoint ? Impl::CheckpointedLayer::run(*impl_, li, x, in)
                     : impl_->layer_forward(li, x, in);
  if (cache) cache->length = past + T;
  return impl_->final_norm_of(x);
}

torch::Tensor Transformer::logits(const torch::Tensor& hidden) {
  return impl_->capped(impl_->whole_vocabulary(impl_->lm_head.apply(hidden)));
}

bool Transformer::shares_base(const Transformer& other) const { return impl_->same_base(*other.impl_); }

torch::Tensor Transformer::decode_step(std::span<const DecodeGroup> groups, torch::Tensor* routes) {
  const ModelConfig& cfg = impl_->cfg;
  if (groups.empty()) throw invalid_argument("Transformer::decode_step: no groups");
  if (impl_->sharding && impl_->root_weights.empty())
    throw std::logic_error("Transformer: a fully sharded model's decode_step runs within a ShardedPass");
  if (routes && cfg.num_experts == 0)
    throw invalid_argument("Transformer::decode_step: routes asked of a " + cfg.model_type + " model without experts");
  c10::InferenceMode inference;
  const auto device = impl_->device();
  std::vector<RowGroup> rows;
  std::vector<torch::Tensor> tokens;
  std::vector<KVCache*> caches;
  std::vector<std::int64_t> new_tokens;
  std::vector<double> scales;  // each group's LoRA scale
  std::int64_t R = 0;
  for (const DecodeGroup& g : groups) {
    if (!g.model || !g.tokens || !g.cache) throw invalid_argument("Transformer::decode_step: a group lacks a member");
    if (!shares_base(*g.model))
      throw invalid_argument("Transformer::decode_step: a group's model does not share this model's base weights");
    const bool chunk = check_decode_group(cfg, device, *g.tokens, *g.cache);
    const std::int64_t n = g.tokens->numel();
    const Impl& own = *g.model->impl_;
    rows.push_back({&own, R, n, chunk});
    tokens.push_back(*g.tokens);
    caches.push_back(g.cache);
    new_tokens.push_back(n);
    scales.push_back(own.lora ? static_cast<double>(own.lora->alpha) / own.lora->rank : 0.0);
    R += n;
  }
  const DecodeSlots step = prepare_decode_step(caches, new_tokens, "Transformer::decode_step");
  // The rows as the positions of one sequence ([1, R]): norms, products and RoPE run over all of them at once.
  const torch::Tensor ids = torch::cat(tokens).view({1, R});
  const auto [cos_table, sin_table] = impl_->rope_tables(device, impl_->dtype());
  StepContext in = StepContext::decode(rows, scales, step, caches.front()->pool(), cos_table, sin_table,
                                       cfg.attention_scale(), device);
  ExpertRouting routing;
  if (routes) {
    routing.recorded = torch::empty({R, impl_->sparse_layers(), cfg.num_experts_per_tok},
                                    torch::TensorOptions().dtype(torch::kLong).device(device));
    in.routing = &routing;
  }
  torch::Tensor x = impl_->embed_rows(ids);
  for (std::size_t li = 0; li < impl_->layers.size(); ++li)
    x = impl_->sharding ? run_sharded_layer(impl_->sharded_layers[li], x, in) : impl_->layer_forward(li, x, in);
  for (std::size_t i = 0; i < caches.size(); ++i) caches[i]->length += step.advance[i];
  if (routes) *routes = routing.recorded;
  torch::Tensor h = impl_->final_norm_of(x);

  // The unembedding of the rows asked for only: a chunk's earlier rows predict tokens the prompt already has.
  std::vector<RowGroup> wanted;
  std::vector<std::int64_t> kept;
  std::vector<double> wanted_scales;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    if (!groups[i].logits) continue;
    const RowGroup& g = rows[i];
    const std::int64_t first = g.chunk ? g.row0 + g.rows - 1 : g.row0;
    wanted.push_back({g.weights, static_cast<std::int64_t>(kept.size()), g.row0 + g.rows - first});
    for (std::int64_t r = first; r < g.row0 + g.rows; ++r) kept.push_back(r);
    wanted_scales.push_back(scales[i]);
  }
  if (kept.empty()) return torch::empty({0, cfg.vocab_size}, h.options());
  if (static_cast<std::int64_t>(kept.size()) != R) {
    h = h.index_select(1, to_device(torch::tensor(kept, torch::kLong), device));
    in.set_stacked_layout(wanted, wanted_scales, device);
  }
  return impl_->capped(impl_->whole_vocabulary(
      project(impl_->lm_head, h, in, [](const RowGroup& g) -> const Linear& { return g.weights->lm_head; })[0]));
}

// ------------------------------------------------------------------------------------------ state dicts

TensorMap Transformer::hf_state_dict() const { return WeightIO(*impl_).hf_state_dict(); }

void Transformer::load_hf_state_dict(const TensorMap& tensors) { WeightIO(*impl_).load_hf_state_dict(tensors); }

TensorMap Transformer::peft_state_dict() const { return WeightIO(*impl_).peft_state_dict(); }

void Transformer::load_peft_state_dict(const TensorMap& tensors) { WeightIO(*impl_).load_peft_state_dict(tensors); }

TensorMap Transformer::merged_hf_state_dict() const { return WeightIO(*impl_).merged_hf_state_dict(); }

// ------------------------------------------------------------------------------------------------- LoRA

void Transformer::enable_lora(const LoraOptions& options, std::int64_t seed) {
  if (impl_->lora) throw conflict("Transformer::enable_lora: the model already has LoRA adapters");
  const std::set<std::string> targets = impl_->lora_targets(options);
  for (auto& p : parameters()) p.set_requires_grad(false);
  Impl& m = *impl_;
  // Over a sharded base the handles hold placeholders: the adapters take their shapes from the weights' stand-ins.
  auto bind_stand_ins = [&](bool on) {
    if (!m.sharding) return;
    for (std::size_t li = 0; li < m.layers.size(); ++li) {
      const ShardedLayer& layer = m.sharded_layers[li];
      on ? layer.unit->bind(layer.slots, layer.unit->stand_ins()) : layer.unit->unbind(layer.slots);
    }
    on ? m.sharding->root->bind(m.root_slots, m.sharding->root->stand_ins()) : m.sharding->root->unbind(m.root_slots);
  };
  bind_stand_ins(true);
  try {
    m.add_lora(options, targets, seed, [this](const std::string& name, const torch::Tensor& value) {
      return register_parameter(name, value, /*requires_grad=*/true);
    });
  } catch (...) {
    bind_stand_ins(false);
    throw;
  }
  bind_stand_ins(false);
}

bool Transformer::has_lora() const { return impl_->lora.has_value(); }

const std::optional<LoraOptions>& Transformer::lora_options() const { return impl_->lora; }

std::vector<torch::Tensor> Transformer::lora_a_parameters() {
  std::vector<torch::Tensor> out;
  impl_->for_each_adapter([&](const std::string&, const torch::Tensor& t, bool a) {
    if (a) out.push_back(t);
  });
  return out;
}

std::vector<torch::Tensor> Transformer::lora_b_parameters() {
  std::vector<torch::Tensor> out;
  impl_->for_each_adapter([&](const std::string&, const torch::Tensor& t, bool a) {
    if (!a) out.push_back(t);
  });
  return out;
}

// ------------------------------------------------------------------------------------------ inference views

// A fully sharded model's weights are whole only while its layers run: decode_step gathers them.
bool Transformer::cpu_kernels_decode() const {
  return !impl_->sharding && !impl_->tensor_parallel && impl_->cpu_kernels_decode();
}

InferenceWeights Transformer::inference_weights() {
  torch::NoGradGuard no_grad;
  auto linear = [](const Linear& lin) {
    LinearWeights w;
    if (lin.weight.defined()) w.weight = lin.weight.detach();
    w.quantized = lin.quantized;
    if (lin.bias.defined()) w.bias = lin.bias.detach();
    if (lin.lora_a.defined()) {
      w.lora_a = lin.lora_a.detach();
      w.lora_b = lin.lora_b.detach();
      w.lora_scale = lin.lora_scale;
    }
    return w;
  };
  InferenceWeights out;
  if (impl_->embed.defined()) out.embed = impl_->embed.detach();
  out.quantized_embed = impl_->embed_quantized;
  out.final_norm = impl_->final_norm.detach();
  for (const Layer& l : impl_->layers) {
    LayerWeights w;
    w.input_norm = l.input_norm.detach();
    w.post_norm = l.post_norm.detach();
    if (impl_->cfg.qk_norm) {
      w.q_norm = l.q_norm.detach();
      w.k_norm = l.k_norm.detach();
    }
    for (Projection p : kProjections) projection_member(w, p) = linear(l.projection(p));
    out.layers.push_back(std::move(w));
  }
  out.lm_head = linear(impl_->lm_head);
  std::tie(out.rope_cos, out.rope_sin) = impl_->rope_tables(impl_->device(), impl_->dtype());
  return out;
}

std::int64_t Transformer::quantized_bytes() const {
  std::int64_t bytes = 0;
  impl_->for_each_quantized([&](const std::string&, const QuantizedMatrix& q) { bytes += q.bytes(); });
  return bytes;
}

std::int64_t Transformer::quantized_values() const {
  std::int64_t values = 0;
  impl_->for_each_quantized([&](const std::string&, const QuantizedMatrix& q) { values += q.rows() * q.cols(); });
  return values;
}

// ------------------------------------------------------------------------------------------ training

std::vector<std::pair<std::string, torch::Tensor>> Transformer::named_trainable_parameters() {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  if (trains_shards()) {
    for (const auto& shard : impl_->sharding->root->shards()) out.push_back(shard);
    for (const auto& unit : impl_->sharding->layers)
      for (const auto& shard : unit->shards()) out.push_back(shard);
    return out;
  }
  if (impl_->lora) {
    impl_->for_each_adapter([&](const std::string& name, const torch::Tensor& t, bool) { out.emplace_back(name, t); });
  } else {
    if (quantized_bytes() > 0)
      throw conflict("full fine-tuning needs dense weights: this model keeps its base quantized (train LoRA adapters, "
                     "or load the model dequantized)");
    impl_->for_each_base([&](const std::string& name, const torch::Tensor& t) { out.emplace_back(name, t); });
  }
  if (has_value_head()) {
    out.emplace_back("value_head.weight", impl_->value_head.weight);
    out.emplace_back("value_head.bias", impl_->value_head.bias);
  }
  return out;
}

void Transformer::enable_value_head(std::int64_t seed) {
  if (has_value_head()) throw conflict("enable_value_head: the model already has a value head");
  const std::int64_t H = impl_->cfg.hidden_size;
  // The head stays fp32 whatever the base dtype: it is tiny and its regression targets need the precision.
  auto f32 = impl_->options.dtype(torch::kFloat32);
  auto gen = at::detail::createCPUGenerator(static_cast<std::uint64_t>(seed) ^ 0x5eedULL);
  auto w = at::normal(0.0, 0.02, {1, H}, gen).to(f32.device());
  impl_->value_head.name = "value_head";
  impl_->value_head.short_name = "value_head";
  impl_->value_head.weight = register_parameter("value_head_weight", w, true);
  impl_->value_head.bias = register_parameter("value_head_bias", torch::zeros({1}, f32), true);
}

bool Transformer::has_value_head() const { return impl_->value_head.weight.defined(); }

torch::Tensor Transformer::values(const torch::Tensor& hidden) {
  if (!has_value_head()) throw invalid_argument("Transformer::values: the model has no value head");
  return impl_->value_head.apply(hidden.to(torch::kFloat32)).squeeze(-1);
}

}  // namespace rlloop::engine
