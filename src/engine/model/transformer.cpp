// The transformer: the weights (model_weights.hpp) and the recipe that runs them. A forward builds its step's row
// and KV layout (step_context.hpp) and runs every layer's recipe (decoder_layer.hpp) through the ATen backend
// (aten_ops.hpp), the sparse layers' experts through their dispatch (experts_layer.hpp); the state dicts are
// weight_io.hpp's, the LoRA adapters lora.cpp's, the fully sharded and tensor-parallel forms transformer_parallel.cpp's
// (its private state, Impl, in transformer_impl.hpp). The math follows Hugging Face transformers' eager implementation
// step by step (fp32 RMSNorm, rotate_half RoPE, softmax in fp32) so HF weights give the same logits.
#include "model/transformer.hpp"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <utility>

#include <rlloop/error.hpp>

#include "kernels/device.hpp"
#include "kernels/fused_ops.hpp"
#include "model/transformer_impl.hpp"
#include "model/weight_io.hpp"

namespace rlloop::engine {

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
