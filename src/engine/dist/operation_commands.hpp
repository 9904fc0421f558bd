// The group's side of "one description per operation" (include/rlloop/operations.hpp): which commands rank 0 of a
// data-parallel or expert-parallel group sends its workers (replica_ops.hpp's Command) for each session operation.
// Checked at compile time both ways:
//   - every operation a session runs has an entry (GroupCommands<Op>), so a new operation cannot reach a group
//     without someone deciding what the group does for it (the static_assert below);
//   - every command is some operation's or the replica's lifecycle (open, close, shutdown), so no command is sent
//     for nothing (the static_assert below; is_lifecycle names every enumerator, under -Wswitch-enum);
//   - the coordinator sends each command through command_for<C, Ops...> (coordinator.cpp), which fails to compile
//     unless every operation it names lists C.
#pragma once
#include <array>
#include <cstddef>

#include <rlloop/operations.hpp>

#include "dist/command.hpp"

namespace rlloop::engine::dist {

// The commands rank 0 may send while running Op (commands: a std::array of Command).
template <class Op>
struct GroupCommands;

template <>
struct GroupCommands<op::Forward> {
  static constexpr std::array commands{Command::forward};
};
template <>
struct GroupCommands<op::ForwardBackward> {
  static constexpr std::array commands{Command::forward};
};
template <>
struct GroupCommands<op::ForwardBackwardCustom> {
  static constexpr std::array commands{Command::forward_custom};
};
template <>
struct GroupCommands<op::OptimStep> {
  static constexpr std::array commands{Command::optim_step};
};
// Rank 0 writes sampler weights from its own replica (every rank's trainable weights are the same), with the other
// ranks' experts gathered (expert parallelism); a sampler loaded from the same path before is dropped everywhere.
template <>
struct GroupCommands<op::SaveWeightsForSampler> {
  static constexpr std::array commands{Command::gather_experts, Command::gather_shards, Command::drop_sampler};
};
// save_state also folds the gradients every rank accumulated since the last step into rank 0's (data parallelism).
template <>
struct GroupCommands<op::SaveState> {
  static constexpr std::array commands{Command::fold_gradients, Command::gather_experts, Command::gather_shards,
                                       Command::drop_sampler};
};
template <>
struct GroupCommands<op::LoadState> {
  static constexpr std::array commands{Command::sync_state, Command::load_state, Command::load_shards};
};
// Samples and logprobs: a share per rank (data parallelism) or every rank in lockstep (expert parallelism), from the
// sampler weights rank 0's cache holds, which the workers load and drop with it.
template <>
struct GroupCommands<op::Sample> {
  static constexpr std::array commands{Command::sample, Command::sample_lockstep, Command::load_sampler,
                                       Command::drop_sampler};
};
template <>
struct GroupCommands<op::ComputeLogprobs> {
  static constexpr std::array commands{Command::logprobs, Command::logprobs_lockstep, Command::load_sampler,
                                       Command::drop_sampler};
};

// Whether Op's entry lists `c`.
template <class Op>
constexpr bool sends(Command c) {
  for (Command listed : GroupCommands<Op>::commands)
    if (listed == c) return true;
  return false;
}

// The replica's own commands, which no operation sends.
constexpr bool is_lifecycle(Command c) {
  switch (c) {
    case Command::open:
    case Command::close:
    case Command::shutdown: return true;
    case Command::forward:
    case Command::forward_custom:
    case Command::optim_step:
    case Command::sync_state:
    case Command::fold_gradients:
    case Command::sample:
    case Command::logprobs:
    case Command::load_sampler:
    case Command::drop_sampler:
    case Command::gather_experts:
    case Command::load_state:
    case Command::gather_shards:
    case Command::load_shards:
    case Command::sample_lockstep:
    case Command::logprobs_lockstep: return false;
  }
  return false;
}

namespace detail {
template <class Op>
concept Bound = requires { GroupCommands<Op>::commands; };

template <class... Ops>
constexpr bool all_bound(op::List<Ops...>) {
  return (Bound<Ops> && ...);
}
template <class... Ops>
constexpr bool sent_by_some(Command c, op::List<Ops...>) {
  return (sends<Ops>(c) || ...);
}
// Every enumerator from open to the last one (logprobs_lockstep: is_lifecycle's switch names them all).
constexpr bool every_command_has_a_role() {
  for (int i = 0; i <= static_cast<int>(Command::logprobs_lockstep); ++i) {
    const auto c = static_cast<Command>(i);
    if (!is_lifecycle(c) && !sent_by_some(c, op::SessionOperations{})) return false;
  }
  return true;
}
}  // namespace detail

static_assert(detail::all_bound(op::SessionOperations{}),
              "a session operation has no GroupCommands entry: say which commands a group sends for it");
static_assert(detail::every_command_has_a_role(),
              "a dist::Command is neither the replica's lifecycle nor any operation's (GroupCommands)");

}  // namespace rlloop::engine::dist
