#include "model/fully_sharded.hpp"

#include <map>

#include <torch/torch.h>

#include <rlloop/error.hpp>

#include "comm/group.hpp"
#include "model/step_context.hpp"

namespace rlloop::engine {

ShardedUnit::ShardedUnit(std::vector<std::pair<std::string, torch::Tensor*>> slots, dist::Group& group)
    : group_(&group) {
  const std::int64_t W = group.size();
  std::map<const void*, std::size_t> seen;  // a tensor's storage -> its weight (tied handles)
  torch::NoGradGuard no_grad;
  for (auto& [name, handle] : slots) {
    const torch::Tensor& t = *handle;
    if (auto it = seen.find(t.unsafeGetTensorImpl()); it != seen.end()) {
      weights_[it->second].handles.push_back(handle);
      continue;
    }
    seen[t.unsafeGetTensorImpl()] = weights_.size();
    Weight w;
    w.handles = {handle};
    w.shape = t.sizes().vec();
    w.numel = t.numel();
    w.part = (w.numel + W - 1) / W;
    w.offset = width_;
    width_ += w.part;
    w.placeholder = torch::empty({0}, t.options());
    weights_.push_back(std::move(w));
    shards_.emplace_back(name, part_of(static_cast<int>(shards_.size()), t, group.rank()).requires_grad_(true));
  }
  // The full tensors go: a handle's old tensor may be registered elsewhere too (the module's parameter list), so
  // its storage is emptied rather than the handle moved.
  for (Weight& w : weights_) {
    w.handles.front()->set_data(w.placeholder);
    w.handles.front()->set_requires_grad(false);
    for (torch::Tensor* h : w.handles) *h = w.placeholder;
  }
}

torch::Tensor ShardedUnit::flat_shard() const {
  std::vector<torch::Tensor> parts;
  for (const auto& [name, shard] : shards_) parts.push_back(shard);
  return torch::cat(parts);
}

torch::Tensor ShardedUnit::gather(const torch::Tensor& flat_shard) const {
  return group_->all_gather(flat_shard.detach()).view({group_->size(), width_});
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

void ShardedUnit::bind(const std::vector<torch::Tensor>& wholes) {
  for (std::size_t i = 0; i < weights_.size(); ++i)
    for (torch::Tensor* h : weights_[i].handles) *h = wholes.at(i);
}

void ShardedUnit::unbind() {
  for (const Weight& w : weights_)
    for (torch::Tensor* h : w.handles) *h = w.placeholder;
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
  torch::Tensor padded = torch::zeros({group_->size() * w.part}, whole.options());
  padded.narrow(0, 0, w.numel).copy_(whole.detach().reshape(-1));
  if (rank < 0) rank = group_->rank();
  return padded.narrow(0, rank * w.part, w.part).clone();
}

namespace {

// The unit's handles point at `wholes` while it lives.
class Bound {
 public:
  Bound(ShardedUnit& unit, const std::vector<torch::Tensor>& wholes) : unit_(unit) { unit_.bind(wholes); }
  ~Bound() { unit_.unbind(); }
  Bound(const Bound&) = delete;
  Bound& operator=(const Bound&) = delete;

 private:
  ShardedUnit& unit_;
};

// See run_sharded_layer. Inputs: the layer's input, the RoPE rows, and the unit's flat shard (whose gradient is
// the reduce-scattered one); the unit and the layer function by address (they outlive the graph).
class ShardedLayer : public torch::autograd::Function<ShardedLayer> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor x, torch::Tensor cos,
                               torch::Tensor sin, torch::Tensor flat_shard, ShardedUnit* unit,
                               const LayerFunction* layer, double scale) {
    ctx->save_for_backward({x, cos, sin});
    ctx->saved_data["unit"] = static_cast<std::int64_t>(reinterpret_cast<std::intptr_t>(unit));
    ctx->saved_data["layer"] = static_cast<std::int64_t>(reinterpret_cast<std::intptr_t>(layer));
    ctx->saved_data["scale"] = scale;
    Bound bound(*unit, unit->unpack(unit->gather(flat_shard), /*trainable=*/false));
    return (*layer)(x, StepContext{cos, sin, scale, nullptr, 0});
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto* unit = reinterpret_cast<ShardedUnit*>(static_cast<std::intptr_t>(ctx->saved_data["unit"].toInt()));
    const auto* layer =
        reinterpret_cast<const LayerFunction*>(static_cast<std::intptr_t>(ctx->saved_data["layer"].toInt()));
    torch::AutoGradMode enable(true);
    // Each weight a leaf of its own: autograd gives each its gradient alone (views of one gathered buffer would
    // each produce a zero-filled buffer's worth of gradient).
    std::vector<torch::Tensor> wholes = unit->unpack(unit->gather(unit->flat_shard()), /*trainable=*/true);
    const torch::Tensor x = saved[0].detach().requires_grad_(ctx->needs_input_grad(0));
    torch::Tensor out;
    {
      Bound bound(*unit, wholes);
      out = (*layer)(x, StepContext{saved[1], saved[2], ctx->saved_data["scale"].toDouble(), nullptr, 0});
    }
    std::vector<torch::Tensor> inputs = wholes;
    if (x.requires_grad()) inputs.push_back(x);
    // allow_unused: a weight the layer's output does not depend on gets a zero gradient.
    auto g = torch::autograd::grad({out}, inputs, {grads[0]}, /*retain_graph=*/false, /*create_graph=*/false,
                                   /*allow_unused=*/true);
    const torch::Tensor grad_x = x.requires_grad() ? g.back() : torch::Tensor();
    g.resize(wholes.size());
    const torch::Tensor grad_shard = unit->reduce_scatter(unit->pack(g));
    return {grad_x, torch::Tensor(), torch::Tensor(), grad_shard, torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor run_sharded_layer(ShardedUnit& unit, const LayerFunction& layer, const torch::Tensor& x,
                                const StepContext& in) {
  if (in.cache) throw unsupported("a fully sharded model decodes no cache yet (sampling it is not built)");
  if (!torch::GradMode::is_enabled()) {
    Bound bound(unit, unit.unpack(unit.gather(unit.flat_shard()), /*trainable=*/false));
    return layer(x, in);
  }
  return ShardedLayer::apply(x, in.cos, in.sin, unit.flat_shard(), &unit, &layer, in.scale);
}

}  // namespace rlloop::engine
