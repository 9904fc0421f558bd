// How a local session's operations meet the ranks: one interface, one implementation per parallel mode.
//
// LocalSession (local_session.cpp) does what every mode does alike: it queues each operation on its lane, checks
// requests, bills tokens, adds the service metrics, keeps the sampler cache and reads and writes checkpoints (all in
// SessionCore). Whatever depends on where the model's tensors live is the executor's, asked at one point per
// operation, so that the session holds no branch on the mode and a new mode is a new executor:
//   single_rank_executor      the whole model on this process
//   data_parallel_executor    a replica on every rank of a dist::Coordinator; samples and prompts shared out
//   expert_parallel_executor  the experts spread over the ranks: every forward runs on all ranks in step
//   fully_sharded_executor    1/W of every weight on each rank, gathered layer by layer as a pass needs it; a
//                             checkpoint gathers the shards (gather_state) or scatters its parts (load_parts)
//
// The training and state calls run on the session's lane (the session submits them), with the session's model and
// optimizer (`SessionCore`). sample and compute_logprobs submit to the lane themselves: a mode decides how a request
// is queued (a decode run stepped beside other requests, a deferred wait for other ranks, a batch of requests
// decoded in step), while the request's checks and billing stay the session's (SessionCore::check_sample,
// bill_sample, checked_logprob_tokens).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <rlloop/future.hpp>
#include <rlloop/types.hpp>

#include "dist/replica_ops.hpp"
#include "io/checkpoint.hpp"
#include "runtime/base_models.hpp"
#include "runtime/optimizer.hpp"

namespace rlloop::engine {

struct SessionCore;

class Executor {
 public:
  using SampleProgress = std::function<void(const SampleResponse& so_far)>;
  virtual ~Executor() = default;

  // How many ranks' devices run a training pass (its cost is measured against their summed peak).
  virtual int ranks() const = 0;
  // A pass of the session's model over `data` with a built-in loss (`backward`: gradients accumulated), or with a
  // custom loss (always backward). Outputs and metrics as one rank computing the whole batch would give.
  virtual ForwardBackwardOutput forward(const std::vector<Datum>& data, const LossSpec& loss, bool backward) = 0;
  virtual ForwardBackwardOutput forward_custom(const std::vector<Datum>& data, const CustomLossFn& fn) = 0;
  // Whether this rank's accumulated gradient is the whole batch's (actor/grad_norm is reported only then).
  virtual bool holds_whole_gradient() const = 0;
  // The optimizer step over the gradients accumulated on every rank; its metrics.
  virtual Metrics optim_step(const AdamParams& params) = 0;

  // save_state: every rank's pending gradients into this rank's accumulation, before the session reads them.
  virtual void collect_gradients() = 0;
  // save_state: what other ranks hold and this rank does not (weights; with `with_optimizer` their optimizer state,
  // with `with_gradients` their pending gradients), added to `state`, so that a checkpoint holds the whole model.
  virtual void gather_state(dist::NamedState& state, bool with_optimizer, bool with_gradients) = 0;
  // load_state: after this rank loaded `checkpoint` (and rebuilt or loaded its optimizer), the other ranks.
  virtual void distribute_state(const StateContents& checkpoint, bool with_optimizer) = 0;
  // load_state where every rank holds a part of each tensor (fully sharded): each rank loads its part of
  // `checkpoint` (weights; with `with_optimizer` the optimizer state and the pending gradients) and this returns
  // true. Elsewhere false: the session loads the checkpoint itself, then distribute_state.
  virtual bool load_parts(const StateContents& checkpoint, bool with_optimizer) {
    (void)checkpoint;
    (void)with_optimizer;
    return false;
  }

  // The sampler cache: a model the session loaded from checkpoint `checkpoint` under `key`, and one it dropped.
  virtual void load_sampler(const std::string& key, Transformer& model, const TensorMap& checkpoint) = 0;
  virtual void drop_sampler(const std::string& key) = 0;
  virtual Future<SampleResponse> sample(const SampleRequest& request, SampleProgress on_step) = 0;
  virtual Future<std::vector<double>> compute_logprobs(const ComputeLogprobsRequest& request) = 0;

  // Throws `unsupported` naming `operation` where this rank does not hold the whole model (an export needs it).
  virtual void require_whole_model(const std::string& operation) const = 0;
  // get_info: the parameters other ranks hold and this rank's model does not, added to `info`'s counts.
  virtual void count_other_ranks(SessionInfo& info) const = 0;
  // The session closes, after its lane ran its last operation: the other ranks drop its replicas.
  virtual void close() = 0;
};

// The group a session's model spreads its experts over (make_session_model), null unless the service runs expert
// parallelism.
dist::Group* expert_group_of(const BaseModelRegistry& bases);
// The group a LoRA session's base is sharded over (make_session_model), null unless the service shards sessions.
dist::Group* shard_group_of(const BaseModelRegistry& bases);
// The service's data-parallel group's stats and failure (LocalService's), empty without one.
DataParallelStats data_parallel_stats_of(const BaseModelRegistry& bases);
std::string data_parallel_failure_of(const BaseModelRegistry& bases);
// The executor of `core`'s mode, chosen from its service's group and its model (made already): the one place that
// tells the modes apart.
std::unique_ptr<Executor> make_executor(SessionCore& core);

}  // namespace rlloop::engine
