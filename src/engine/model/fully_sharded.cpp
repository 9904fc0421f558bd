#include "model/fully_sharded.hpp"

#include <algorithm>
#include <cstdlib>
#include <map>

#include <torch/torch.h>

#include <rlloop/error.hpp>

#include "comm/group.hpp"
#include "model/step_context.hpp"

namespace rlloop::engine {

ShardedUnit::ShardedUnit(const UnitSlots& slots, dist::Group& group) : group_(&group) {
  lay_out(slots);
  torch::NoGradGuard no_grad;
  for (const Weight& w : weights_) trains_ = trains_ || w.placeholder.requires_grad();
  for (std::size_t i = 0; i < weights_.size(); ++i)
    shards_[i].second = part_of(static_cast<int>(i), weights_[i].placeholder, group.rank()).requires_grad_(trains_);
  // The full tensors go. Emptied in place rather than replaced: the module's parameter list and the models sharing
  // them hold the same tensors, which all become the placeholder.
  empty_placeholders();
}

ShardedUnit::ShardedUnit(const UnitSlots& slots, dist::Group& group, const torch::TensorOptions& options, bool trains)
    : group_(&group), trains_(trains) {
  lay_out(slots);
  for (std::size_t i = 0; i < weights_.size(); ++i) {
    shards_[i].second = torch::zeros({weights_[i].part}, options).requires_grad_(trains);
    // Tensors of their own, not the slots' emptied in place: a meta tensor cannot take a CPU or CUDA one's data.
    weights_[i].placeholder = torch::empty({0}, options);
  }
  unbind(slots);
}

void ShardedUnit::lay_out(const UnitSlots& slots) {
  const std::int64_t W = group_->size();
  std::map<const void*, std::size_t> seen;  // a tensor's storage -> its weight (tied handles)
  for (const auto& [name, handle] : slots) {
    const torch::Tensor& t = *handle;
    if (seen.count(t.unsafeGetTensorImpl())) continue;
    seen[t.unsafeGetTensorImpl()] = weights_.size();
    Weight w;
    w.placeholder = t;
    w.shape = t.sizes().vec();
    w.numel = t.numel();
    w.part = (w.numel + W - 1) / W;
    w.offset = width_;
    width_ += w.part;
    weights_.push_back(std::move(w));
    shards_.emplace_back(name, torch::Tensor());
  }
}

void ShardedUnit::empty_placeholders() {
  for (Weight& w : weights_) {
    w.placeholder.set_requires_grad(false);
    w.placeholder.set_data(torch::empty({0}, w.placeholder.options()));
  }
}

void ShardedUnit::fill(const std::string& name, const torch::Tensor& whole) const {
  const int i = static_cast<int>(index(name));
  torch::NoGradGuard no_grad;
  shards_[static_cast<std::size_t>(i)].second.copy_(part_of(i, whole, -1));
}

torch::Tensor ShardedUnit::flat_shard() const {
  std::vector<torch::Tensor> parts;
  for (const auto& [name, shard] : shards_) parts.push_back(shard);
  return torch::cat(parts);
}

torch::Tensor ShardedUnit::gather(const torch::Tensor& flat_shard) const {
  return group_->all_gather(flat_shard.detach()).view({group_->size(), width_});
}

dist::PendingGather ShardedUnit::start_gather() const { return group_->start_all_gather(flat_shard().detach()); }

torch::Tensor ShardedUnit::finish_gather(dist::PendingGather& pending) const {
  return pending.wait().view({group_->size(), width_});
}

std::vector<torch::Tensor> ShardedUnit::unpack(const torch::Tensor& full, bool trainable) const {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> wholes;
  for (const Weight& w : weights_) {
    // [W, s] -> the padded weight, row after row (a copy: the columns are strided) -> the weight.
    torch::Tensor t = full.narrow(1, w.offset, w.part).reshape(-1).narrow(0, 0, w.numel).view(w.shape).contiguous();
    wholes.push_back(trainable ? t.requires_grad_(true) : t);
  }
  return wholes;
}

void ShardedUnit::bind(const UnitSlots& slots, const std::vector<torch::Tensor>& wholes) const {
  for (const auto& [name, handle] : slots) *handle = wholes.at(index(name));
}

void ShardedUnit::unbind(const UnitSlots& slots) const {
  for (const auto& [name, handle] : slots) *handle = weights_[index(name)].placeholder;
}

std::vector<torch::Tensor> ShardedUnit::stand_ins() const {
  std::vector<torch::Tensor> out;
  for (const Weight& w : weights_) out.push_back(torch::empty(w.shape, w.placeholder.options().device(torch::kMeta)));
  return out;
}

std::size_t ShardedUnit::index(const std::string& name) const {
  const int i = find(name);
  if (i < 0) throw invalid_argument("fully sharded: the unit holds no weight '" + name + "'");
  return static_cast<std::size_t>(i);
}

torch::Tensor ShardedUnit::pack(const std::vector<torch::Tensor>& grads) const {
  torch::NoGradGuard no_grad;
  const std::int64_t W = group_->size();
  torch::Tensor full = torch::zeros({W, width_}, weights_.front().placeholder.options());
  for (std::size_t i = 0; i < weights_.size(); ++i) {
    const Weight& w = weights_[i];
    if (!grads.at(i).defined()) continue;
    torch::Tensor padded = torch::zeros({W * w.part}, full.options());
    padded.narrow(0, 0, w.numel).copy_(grads[i].reshape(-1));
    full.narrow(1, w.offset, w.part).copy_(padded.view({W, w.part}));
  }
  return full;
}

torch::Tensor ShardedUnit::reduce_scatter(const torch::Tensor& grad_full) const {
  return group_->reduce_scatter_sum(grad_full.contiguous().view(-1));
}

void ShardedUnit::accumulate(const torch::Tensor& flat) const {
  torch::NoGradGuard no_grad;
  for (std::size_t i = 0; i < shards_.size(); ++i) {
    const torch::Tensor& shard = shards_[i].second;
    torch::Tensor g = flat.narrow(0, weights_[i].offset, weights_[i].part);
    if (shard.grad().defined())
      shard.mutable_grad().add_(g);
    else
      shard.mutable_grad() = g.clone();
  }
}

std::int64_t ShardedUnit::elements() const {
  std::int64_t n = 0;
  for (const Weight& w : weights_) n += w.numel;
  return n;
}

int ShardedUnit::find(const std::string& name) const {
  for (std::size_t i = 0; i < shards_.size(); ++i)
    if (shards_[i].first == name) return static_cast<int>(i);
  return -1;
}

torch::Tensor ShardedUnit::whole(int i, const torch::Tensor& part) const {
  const Weight& w = weights_.at(static_cast<std::size_t>(i));
  if (part.numel() != w.part)
    throw invalid_argument("fully sharded '" + shards_[i].first + "': a part of " + std::to_string(part.numel()) +
                           " elements where the shards have " + std::to_string(w.part));
  return group_->all_gather(part.detach().reshape(-1)).narrow(0, 0, w.numel).view(w.shape);
}

torch::Tensor ShardedUnit::part_of(int i, const torch::Tensor& whole, int rank) const {
  const Weight& w = weights_.at(static_cast<std::size_t>(i));
  if (whole.sizes().vec() != w.shape)
    throw invalid_argument("fully sharded '" + shards_[i].first + "': a tensor of another shape than the weight's");
  if (rank < 0) rank = group_->rank();
  // The rank's elements straight from the whole (a view of it when contiguous); the tail past the weight's end is
  // the zero padding.
  torch::Tensor part = torch::zeros({w.part}, whole.options());
  const std::int64_t begin = std::min(rank * w.part, w.numel), n = std::min(w.part, w.numel - begin);
  part.narrow(0, 0, n).copy_(whole.detach().reshape(-1).narrow(0, begin, n));
  return part;
}

namespace {
bool prefetch_from_environment() {
  const char* env = std::getenv("RLLOOP_SHARD_PREFETCH");
  if (!env) return true;
  const std::string v = env;
  if (v != "0" && v != "1") throw invalid_argument("RLLOOP_SHARD_PREFETCH must be 0 or 1, got '" + v + "'");
  return v == "1";
}
}  // namespace

GatherPipeline::GatherPipeline() : prefetch_(prefetch_from_environment()) {}

GatherPipeline::~GatherPipeline() {
  try {
    drop_in_flight();
  } catch (const std::exception&) {
    // The group failed; it says so to its next user.
  }
}

void GatherPipeline::begin_pass() {
  drop_in_flight();
  ++pass_;
}

void GatherPipeline::drop_in_flight() {
  if (in_flight_.pending()) in_flight_.wait();
  in_flight_unit_ = nullptr;
}

torch::Tensor GatherPipeline::take(const ShardedUnit& unit, std::uint64_t pass, const ShardedUnit* ahead) {
  torch::Tensor full;
  if (in_flight_.pending() && in_flight_unit_ == &unit && in_flight_pass_ == pass) {
    full = unit.finish_gather(in_flight_);
    in_flight_unit_ = nullptr;
  } else {
    drop_in_flight();
    full = unit.gather(unit.flat_shard());
  }
  if (prefetch_ && ahead) {
    in_flight_ = ahead->start_gather();
    in_flight_unit_ = ahead;
    in_flight_pass_ = pass;
  }
  return full;
}

namespace {

// A model's handles point at `wholes` while it lives.
class Bound {
 public:
  Bound(const ShardedLayer& layer, const std::vector<torch::Tensor>& wholes) : layer_(layer) {
    layer_.unit->bind(layer_.slots, wholes);
  }
  ~Bound() { layer_.unit->unbind(layer_.slots); }
  Bound(const Bound&) = delete;
  Bound& operator=(const Bound&) = delete;

 private:
  const ShardedLayer& layer_;
};

// See run_sharded_layer. Inputs: the layer's input, the RoPE rows, the unit's flat shard (whose gradient is the
// reduce-scattered one) and an anchor (a 0-element tensor that requires grad where only the adapters train, so
// that the node is in the graph: as CheckpointedLayer's); the layer by address (it outlives the graph).
class ShardedLayerFunction : public torch::autograd::Function<ShardedLayerFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor x, torch::Tensor cos,
                               torch::Tensor sin, torch::Tensor flat_shard, torch::Tensor anchor,
                               const ShardedLayer* layer, double scale) {
    (void)anchor;
    ctx->save_for_backward({x, cos, sin});
    ctx->saved_data["layer"] = static_cast<std::int64_t>(reinterpret_cast<std::intptr_t>(layer));
    ctx->saved_data["scale"] = scale;
    const std::uint64_t pass = layer->gathers->pass();
    ctx->saved_data["pass"] = static_cast<std::int64_t>(pass);
    (void)flat_shard;  // gathered by the pipeline (the same shards); an input for its gradient
    const ShardedUnit& unit = *layer->unit;
    Bound bound(*layer, unit.unpack(layer->gathers->take(unit, pass, layer->next), /*trainable=*/false));
    return layer->run(x, StepContext{cos, sin, scale, nullptr, 0});
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto* layer =
        reinterpret_cast<const ShardedLayer*>(static_cast<std::intptr_t>(ctx->saved_data["layer"].toInt()));
    const ShardedUnit& unit = *layer->unit;
    torch::AutoGradMode enable(true);
    // Each weight a leaf of its own: autograd gives each its gradient alone (views of one gathered buffer would
    // each produce a zero-filled buffer's worth of gradient).
    const auto pass = static_cast<std::uint64_t>(ctx->saved_data["pass"].toInt());
    std::vector<torch::Tensor> wholes = unit.unpack(layer->gathers->take(unit, pass, layer->previous), unit.trains());
    const torch::Tensor x = saved[0].detach().requires_grad_(ctx->needs_input_grad(0));
    torch::Tensor out;
    {
      Bound bound(*layer, wholes);
      out = layer->run(x, StepContext{saved[1], saved[2], ctx->saved_data["scale"].toDouble(), nullptr, 0});
    }
    // Every leaf of the recompute gets its gradient: the gathered weights, the input, the adapters (accumulated
    // into their .grad as a plain backward would).
    if (out.requires_grad()) torch::autograd::backward({out}, {grads[0]});
    const torch::Tensor grad_x = x.requires_grad() ? x.grad() : torch::Tensor();
    torch::Tensor grad_shard;
    if (unit.trains()) {
      std::vector<torch::Tensor> g;
      for (const torch::Tensor& w : wholes) g.push_back(w.grad());  // undefined where unused: zero
      grad_shard = unit.reduce_scatter(unit.pack(g));
    }
    return {grad_x, torch::Tensor(), torch::Tensor(), grad_shard, torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor run_sharded_layer(const ShardedLayer& layer, const torch::Tensor& x, const StepContext& in) {
  const ShardedUnit& unit = *layer.unit;
  const bool adapters = layer.adapters_train && layer.adapters_train();
  const bool differentiate = torch::GradMode::is_enabled() && (x.requires_grad() || unit.trains() || adapters);
  if (!differentiate) {
    torch::NoGradGuard no_grad;  // the gathered weights and the layer's output are plain values
    Bound bound(layer, unit.unpack(layer.gathers->take(unit, layer.gathers->pass(), layer.next), false));
    return layer.run(x, in);
  }
  if (in.cache) throw unsupported("a fully sharded layer differentiates no step with a KV cache");
  const torch::Tensor anchor = torch::empty({0}, x.options()).requires_grad_(!x.requires_grad() && !unit.trains());
  return ShardedLayerFunction::apply(x, in.cos, in.sin, unit.flat_shard(), anchor, &layer, in.scale);
}

}  // namespace rlloop::engine
