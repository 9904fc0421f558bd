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
//
// A unit's shards are shared by every model over one sharded base (LoRA sessions sharing a frozen base): each model
// binds the gathered weights to its own handles (UnitSlots) while one of its layers runs. A frozen unit (its
// weights did not require grad when cut) is gathered the same way and reduce-scatters nothing.
//
// A unit's gather is started one layer ahead (GatherPipeline), so that its transfer overlaps the layer before it.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <torch/types.h>

#include "comm/group.hpp"

namespace rlloop::engine {

struct StepContext;

// A model's handles of a unit's weights, by weight name (two handles of one tensor, a tied unembedding, name one
// weight twice).
using UnitSlots = std::vector<std::pair<std::string, torch::Tensor*>>;

class ShardedUnit {
 public:
  // Takes this rank's shards of the weights `slots` hold and frees the full tensors: their storage is emptied in
  // place, so every handle of them (this model's, the module's parameter list, other models sharing them) holds a
  // 0-element placeholder of its dtype and device, except while bound. The shards train when the weights required
  // grad.
  ShardedUnit(const UnitSlots& slots, dist::Group& group);
  // The same from the weights' shapes alone (`slots` may hold tensors without storage, on the meta device): the
  // shards are zeros of `options` that fill() writes, one weight at a time, so that no rank ever holds the whole
  // unit; the slots are pointed at new placeholders of `options` (a module list holding the slots' old tensors is
  // the caller's to update). The shards train when `trains`.
  ShardedUnit(const UnitSlots& slots, dist::Group& group, const torch::TensorOptions& options, bool trains);
  // Writes this rank's part of weight `name` from the whole of it (its shape; any dtype and device).
  void fill(const std::string& name, const torch::Tensor& whole) const;

  // The shards by weight name (each weight once): leaves, which require grad when the unit trains.
  const std::vector<std::pair<std::string, torch::Tensor>>& shards() const { return shards_; }
  bool trains() const { return trains_; }
  // Every shard side by side, [S]: differentiable, so a gradient of it reaches each shard's .grad.
  torch::Tensor flat_shard() const;
  // Every rank's flat shard, [W, S] (one all-gather; every rank of the group calls it together).
  torch::Tensor gather(const torch::Tensor& flat_shard) const;
  // The same all-gather of the shards as they are now, started; finish_gather waits for it and returns [W, S].
  dist::PendingGather start_gather() const;
  torch::Tensor finish_gather(dist::PendingGather& pending) const;
  // Every weight whole from gather's [W, S], each a contiguous tensor of its own (a leaf that requires grad when
  // `trainable`: autograd then gives each weight its gradient apart).
  std::vector<torch::Tensor> unpack(const torch::Tensor& full, bool trainable) const;
  // Every weight as a tensor of its shape, dtype and no storage (the meta device): what a model reads the weights'
  // shapes from while it is built on the shards (its adapters).
  std::vector<torch::Tensor> stand_ins() const;
  // Points a model's handles at `wholes` (unpack's) until unbind() puts the placeholders back.
  void bind(const UnitSlots& slots, const std::vector<torch::Tensor>& wholes) const;
  void unbind(const UnitSlots& slots) const;
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
  // Weight `name`'s index (invalid_argument when the unit has none).
  std::size_t index(const std::string& name) const;
  // The weights' layout from `slots` (each tensor once), and their tensors made 0-element placeholders.
  void lay_out(const UnitSlots& slots);
  void empty_placeholders();

  struct Weight {
    torch::Tensor placeholder;  // the weight's own tensor, emptied
    std::vector<std::int64_t> shape;
    std::int64_t numel = 0, part = 0, offset = 0;  // elements, s, where its part starts in the unit's [S]
  };
  dist::Group* group_;
  std::vector<Weight> weights_;
  std::vector<std::pair<std::string, torch::Tensor>> shards_;
  std::int64_t width_ = 0;  // S
  bool trains_ = false;
};

// The all-gathers of one model's sharded layers, each started a layer ahead (FSDP's forward and backward
// prefetch): before a layer computes, the gather of the layer that runs after it (the next one in a forward, the
// previous one in a backward) is started, so that its transfer overlaps this layer's compute. One gather is in
// flight at a time, so at most two layers are whole at once. A gather is used only in the pass that started it (a
// ShardedPass, within which the weights do not change); one an interrupted pass left in flight is waited out and
// dropped when the next pass begins. Every rank runs the same passes, so all start the same gathers in the same
// order. Prefetch is on unless RLLOOP_SHARD_PREFETCH=0 (each gather then issued where its layer runs).
class GatherPipeline {
 public:
  GatherPipeline();
  ~GatherPipeline();
  GatherPipeline(const GatherPipeline&) = delete;
  GatherPipeline& operator=(const GatherPipeline&) = delete;

  // Starts a pass (waits out a gather an earlier one left in flight).
  void begin_pass();
  std::uint64_t pass() const { return pass_; }
  // `unit`'s weights whole as gather lays them out ([W, S]) in pass `pass`: from the gather started ahead for
  // it, or one now; then starts `ahead`'s (none when null).
  torch::Tensor take(const ShardedUnit& unit, std::uint64_t pass, const ShardedUnit* ahead);

 private:
  void drop_in_flight();

  bool prefetch_;
  std::uint64_t pass_ = 0;
  const ShardedUnit* in_flight_unit_ = nullptr;
  std::uint64_t in_flight_pass_ = 0;
  dist::PendingGather in_flight_;
};

// A decoder layer of a fully sharded model as one autograd node: forward gathers the layer, runs it without a
// graph and frees the weights; backward gathers them again, runs it with its graph (the recompute of activation
// checkpointing, which this always is: a graph would hold the gathered weights until backward), differentiates it
// (the layer's adapters, leaves of their own, get their gradients there as in a reentrant checkpoint) and
// reduce-scatters the weights' gradient into the shards when the unit trains. Without grad mode, or with nothing to
// differentiate, only the forward runs (a step with a KV cache among them).
using LayerFunction = std::function<torch::Tensor(const torch::Tensor& x, const StepContext& in)>;
struct ShardedLayer {
  const ShardedUnit* unit;
  UnitSlots slots;      // the model's handles of the unit's weights
  LayerFunction run;    // the model's layer over those handles
  // Whether the model trains tensors of the layer outside the unit (its LoRA adapters).
  std::function<bool()> adapters_train;
  GatherPipeline* gathers;                 // the model's
  const ShardedUnit* next = nullptr;       // the units of the layers after and before it (null: none)
  const ShardedUnit* previous = nullptr;
};
// `layer` must outlive the graph (the model's, as for checkpointing).
torch::Tensor run_sharded_layer(const ShardedLayer& layer, const torch::Tensor& x, const StepContext& in);

}  // namespace rlloop::engine
