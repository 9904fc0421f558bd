// The Transformer's parallel forms: fully sharded (each rank keeps 1/W of every weight, fully_sharded.hpp; the
// ShardedPass that gathers the root for a pass) and a tensor-parallel slice for decoding (tensor_parallel.hpp).
#include <map>
#include <string>

#include <rlloop/error.hpp>

#include "model/transformer_impl.hpp"

namespace rlloop::engine {

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

}  // namespace rlloop::engine
