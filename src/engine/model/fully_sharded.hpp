// Fully sharded data parallelism's weights (ZeRO-3, as PyTorch's FSDP): each rank of a group keeps 1/W of every
// dense weight, and a unit of weights (one decoder layer, or the root: embedding, final norm, unembedding) is
// gathered from the ranks only while it computes.
//
// Each weight of N elements is flattened, zero-padded to W s elements (s = ceil(N / W)) and cut into W parts; rank
// r keeps part r, a leaf that trains (its gradient and the optimizer's state are then 1/W too). A unit gathers all
// its weights with one all-gather of its shards side by side ([W, S], S the sum of its weights' s), and its
// gradient goes back with one reduce-scatter of the same layout. Per weight rather than one flat buffer per unit
// so that the shards keep the weights' names: the optimizer, the checkpoints and the exports see the weights they
// see on one rank, cut.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <torch/types.h>

namespace rlloop::engine {

namespace dist {
class Group;
}
struct StepContext;

class ShardedUnit {
 public:
  // `slots`: the model's handles of the unit's weights by name (two handles of one tensor, a tied unembedding,
  // share one shard). Takes this rank's shards and frees the full tensors: every handle is left holding a
  // 0-element placeholder of its dtype and device until bind().
  ShardedUnit(std::vector<std::pair<std::string, torch::Tensor*>> slots, dist::Group& group);

  // The shards by weight name (each weight once), leaves that train.
  const std::vector<std::pair<std::string, torch::Tensor>>& shards() const { return shards_; }
  // Every shard side by side, [S]: differentiable, so a gradient of it reaches each shard's .grad.
  torch::Tensor flat_shard() const;
  // Every rank's flat shard, [W, S] (one all-gather; every rank of the group calls it together).
  torch::Tensor gather(const torch::Tensor& flat_shard) const;
  // Every weight whole from gather's [W, S], each a contiguous tensor of its own (a leaf that requires grad when
  // `trainable`: autograd then gives each weight its gradient apart).
  std::vector<torch::Tensor> unpack(const torch::Tensor& full, bool trainable) const;
  // Points the handles at `wholes` (unpack's) until unbind() puts the placeholders back.
  void bind(const std::vector<torch::Tensor>& wholes);
  void unbind();
  // The weights' gradients (undefined: zero) side by side as gather lays the weights out, [W, S].
  torch::Tensor pack(const std::vector<torch::Tensor>& grads) const;
  // This rank's part of the sum over the ranks of `grad_full` ([W, S]): [S] (one reduce-scatter).
  torch::Tensor reduce_scatter(const torch::Tensor& grad_full) const;
  // Adds `flat` ([S], reduce_scatter's) into the shards' .grad.
  void accumulate(const torch::Tensor& flat) const;

  // The index of weight `name` among shards(), or -1.
  int find(const std::string& name) const;
  // Weight i whole, from every rank's `part` of it (its shard, the shard's gradient or an optimizer moment of it:
  // one all-gather, every rank together), and rank `rank`'s part of a whole one (local; -1: this rank's).
  torch::Tensor whole(int i, const torch::Tensor& part) const;
  torch::Tensor part_of(int i, const torch::Tensor& whole, int rank) const;

  dist::Group& group() const { return *group_; }
  // The elements of the unit's weights whole (each weight once).
  std::int64_t elements() const;

 private:
  struct Weight {
    std::vector<torch::Tensor*> handles;
    torch::Tensor placeholder;
    std::vector<std::int64_t> shape;
    std::int64_t numel = 0, part = 0, offset = 0;  // elements, s, where its part starts in the unit's [S]
  };
  dist::Group* group_;
  std::vector<Weight> weights_;
  std::vector<std::pair<std::string, torch::Tensor>> shards_;
  std::int64_t width_ = 0;  // S
};

// A decoder layer of a fully sharded model as one autograd node: forward gathers the layer, runs `layer` without a
// graph and frees the weights; backward gathers them again, runs `layer` with its graph (the recompute of
// activation checkpointing, which this always is: a graph would hold the gathered weights until backward),
// differentiates it and reduce-scatters the weights' gradient into the shards. Without grad mode only the forward
// runs. `unit` and `layer` must outlive the graph (the model's, as for checkpointing).
using LayerFunction = std::function<torch::Tensor(const torch::Tensor& x, const StepContext& in)>;
torch::Tensor run_sharded_layer(ShardedUnit& unit, const LayerFunction& layer, const torch::Tensor& x,
                                const StepContext& in);

}  // namespace rlloop::engine
