// The commands rank 0 of a group sends its workers, one per message (replica_ops.hpp says what each does on every
// rank; operation_commands.hpp which session operation sends which).
#pragma once
#include <cstdint>

namespace rlloop::engine::dist {

enum class Command : std::uint8_t {
  open,
  close,
  forward,
  forward_custom,
  optim_step,
  sync_state,
  fold_gradients,
  shutdown,
  // Answered by replies (Group::post_reply), not by a collective: the worker runs them beside later commands.
  sample,
  logprobs,
  // Sampler weights from a checkpoint, as rank 0 holds them: loaded (a broadcast of their trainable weights) and
  // dropped (no answer), so the workers hold what rank 0's sampler cache holds.
  load_sampler,
  drop_sampler,
  // Expert parallelism's checkpoints: every rank's experts to rank 0 (save_state), rank 0's checkpoint to every
  // rank (load_state).
  gather_experts,
  load_state,
  // A fully sharded session's checkpoints: every rank's shards whole to rank 0 (save_state), each rank's part of
  // rank 0's checkpoint (load_state).
  gather_shards,
  load_shards,
  // An expert-parallel session's samples and logprobs: every rank runs its forwards in step with the others'.
  sample_lockstep,
  logprobs_lockstep,
  // (The last: operation_commands.hpp checks every enumerator up to it. A new command goes before it.)
};

}  // namespace rlloop::engine::dist
