// One description per session operation. Each descriptor below says what the operation takes and returns, how a
// session runs it, and what it does to the session's state; the Session concept and AnySession (session.hpp), the
// wire's unions, readers and writers (src/wire) and the server's replay and autosave rules (src/server) are derived
// from the list `Operations` at the end. A protocol names and encodes the operations apart from this file (the
// SageMaker runtime API: src/wire/operations.hpp), so a second wire format binds the same descriptors.
//
// A descriptor that a session runs has
//   Result                     the value of the operation's future
//   Params                     the session method's parameters, as Params<...>
//   call(s, args...)           how a concrete session runs it (its method, spelled once here)
//   Method<Self>               the same method as a member of a type-erased session (AnySession derives from it)
// and every descriptor has
//   name                       the session method's name (or the operation's, for one no session runs)
//   mutates                    it changes the trainable state (weights, optimizer, pending gradients, sampler choice)
//   replayed                   a restarted server runs it again on top of the last autosave
//   autosaved                  the state is saved before its completion is reported
// Adding an operation = its descriptor here, its wire binding (src/wire/operations.hpp), its group commands (src/
// engine/dist/operation_commands.hpp), engine implementation, server execution and tests: a missing one fails to build.
#pragma once
#include <concepts>
#include <cstddef>
#include <functional>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <rlloop/future.hpp>
#include <rlloop/loss.hpp>
#include <rlloop/types.hpp>

namespace rlloop {

// d loss / d logprob for each datum and token, given the logprobs; see CustomLossResult.
using CustomLossFn =
    std::function<CustomLossResult(const std::vector<Datum>& data, const std::vector<std::vector<double>>& logprobs)>;

namespace op {

template <class... Ops>
struct List {};
template <class... A>
struct Params {};

// A descriptor's Method<Self> reaches the type-erased session through this: Self::run<Op>(args...).
template <class Op, class Self, class... A>
Future<typename Op::Result> run(Self& self, A&&... a) {
  return self.template run<Op>(std::forward<A>(a)...);
}

struct Forward {
  static constexpr std::string_view name = "forward";
  static constexpr bool mutates = false, replayed = false, autosaved = false;
  using Result = ForwardBackwardOutput;
  using Params = op::Params<const std::vector<Datum>&, const LossSpec&>;
  static auto call(auto& s, const std::vector<Datum>& data, const LossSpec& loss) -> decltype(s.forward(data, loss)) {
    return s.forward(data, loss);
  }
  template <class Self>
  struct Method {
    Future<Result> forward(const std::vector<Datum>& data, const LossSpec& loss) {
      return run<Forward>(static_cast<Self&>(*this), data, loss);
    }
  };
};

// Accumulates gradients until the next optim_step.
struct ForwardBackward {
  static constexpr std::string_view name = "forward_backward";
  static constexpr bool mutates = true, replayed = true, autosaved = false;
  using Result = ForwardBackwardOutput;
  using Params = op::Params<const std::vector<Datum>&, const LossSpec&>;
  static auto call(auto& s, const std::vector<Datum>& data, const LossSpec& loss)
      -> decltype(s.forward_backward(data, loss)) {
    return s.forward_backward(data, loss);
  }
  template <class Self>
  struct Method {
    Future<Result> forward_backward(const std::vector<Datum>& data, const LossSpec& loss) {
      return run<ForwardBackward>(static_cast<Self&>(*this), data, loss);
    }
  };
};

// A user objective on the per-token logprobs. A remote session runs it as forward + forwardBackward, so no wire
// carries it and no server replays it as such.
struct ForwardBackwardCustom {
  static constexpr std::string_view name = "forward_backward_custom";
  static constexpr bool mutates = true, replayed = false, autosaved = false;
  using Result = ForwardBackwardOutput;
  using Params = op::Params<const std::vector<Datum>&, const CustomLossFn&>;
  static auto call(auto& s, const std::vector<Datum>& data, const CustomLossFn& fn)
      -> decltype(s.forward_backward_custom(data, fn)) {
    return s.forward_backward_custom(data, fn);
  }
  template <class Self>
  struct Method {
    Future<Result> forward_backward_custom(const std::vector<Datum>& data, const CustomLossFn& fn) {
      return run<ForwardBackwardCustom>(static_cast<Self&>(*this), data, fn);
    }
  };
};

// AdamW on the accumulated gradients, then zeroes them. A server saves the state after each step, so a restart
// never runs a step twice.
struct OptimStep {
  static constexpr std::string_view name = "optim_step";
  static constexpr bool mutates = true, replayed = false, autosaved = true;
  using Result = OptimStepOutput;
  using Params = op::Params<const AdamParams&>;
  static auto call(auto& s, const AdamParams& adam) -> decltype(s.optim_step(adam)) { return s.optim_step(adam); }
  template <class Self>
  struct Method {
    Future<Result> optim_step(const AdamParams& adam) { return run<OptimStep>(static_cast<Self&>(*this), adam); }
  };
};

// Weights that a sampler can load by the returned path.
struct SaveWeightsForSampler {
  static constexpr std::string_view name = "save_weights_for_sampler";
  static constexpr bool mutates = false, replayed = false, autosaved = false;
  using Result = CheckpointRef;
  using Params = op::Params<const std::string&>;
  static auto call(auto& s, const std::string& name) -> decltype(s.save_weights_for_sampler(name)) {
    return s.save_weights_for_sampler(name);
  }
  template <class Self>
  struct Method {
    Future<Result> save_weights_for_sampler(const std::string& name) {
      return run<SaveWeightsForSampler>(static_cast<Self&>(*this), name);
    }
  };
};

// Weights + optimizer (+ step, RNG, gradients pending since the last step).
struct SaveState {
  static constexpr std::string_view name = "save_state";
  static constexpr bool mutates = false, replayed = false, autosaved = false;
  using Result = CheckpointRef;
  using Params = op::Params<const std::string&>;
  static auto call(auto& s, const std::string& name) -> decltype(s.save_state(name)) { return s.save_state(name); }
  template <class Self>
  struct Method {
    Future<Result> save_state(const std::string& name) { return run<SaveState>(static_cast<Self&>(*this), name); }
  };
};

// A saved state; without the optimizer it starts with no gradients pending.
struct LoadState {
  static constexpr std::string_view name = "load_state";
  static constexpr bool mutates = true, replayed = true, autosaved = false;
  using Result = LoadStateOutput;
  using Params = op::Params<const std::string&, bool>;
  static auto call(auto& s, const std::string& path, bool with_optimizer)
      -> decltype(s.load_state(path, with_optimizer)) {
    return s.load_state(path, with_optimizer);
  }
  template <class Self>
  struct Method {
    Future<Result> load_state(const std::string& path, bool with_optimizer) {
      return run<LoadState>(static_cast<Self&>(*this), path, with_optimizer);
    }
  };
};

// Rollouts, optionally from saved sampler weights.
struct Sample {
  static constexpr std::string_view name = "sample";
  static constexpr bool mutates = false, replayed = false, autosaved = false;
  using Result = SampleResponse;
  using Params = op::Params<const SampleRequest&>;
  static auto call(auto& s, const SampleRequest& req) -> decltype(s.sample(req)) { return s.sample(req); }
  template <class Self>
  struct Method {
    Future<Result> sample(const SampleRequest& req) { return run<Sample>(static_cast<Self&>(*this), req); }
  };
};

// Scoring of a prompt, optionally with saved sampler weights.
struct ComputeLogprobs {
  static constexpr std::string_view name = "compute_logprobs";
  static constexpr bool mutates = false, replayed = false, autosaved = false;
  using Result = std::vector<double>;
  using Params = op::Params<const ComputeLogprobsRequest&>;
  static auto call(auto& s, const ComputeLogprobsRequest& req) -> decltype(s.compute_logprobs(req)) {
    return s.compute_logprobs(req);
  }
  template <class Self>
  struct Method {
    Future<Result> compute_logprobs(const ComputeLogprobsRequest& req) {
      return run<ComputeLogprobs>(static_cast<Self&>(*this), req);
    }
  };
};

// A server's choice of the weights its later samples use: no session method runs it (a session's sample names the
// weights itself); the server's journal remembers the choice, so it is neither replayed nor autosaved.
struct LoadWeightsForSampling {
  static constexpr std::string_view name = "load_weights_for_sampling";
  static constexpr bool mutates = true, replayed = false, autosaved = false;
};

}  // namespace op
}  // namespace rlloop

// The test-only build of tests/core (RLLOOP_TEST_OPERATION) appends one throwaway operation, rlloop::op::Test, to
// show that a descriptor alone reaches AnySession and the wire.
#ifdef RLLOOP_TEST_OPERATION
#include "test_operation.hpp"
#define RLLOOP_TEST_OPERATION_ENTRY , op::Test
#else
#define RLLOOP_TEST_OPERATION_ENTRY
#endif

namespace rlloop {

// Every operation, in the order the wire lists them.
using Operations = op::List<op::Forward, op::ForwardBackward, op::ForwardBackwardCustom, op::OptimStep,
                            op::SaveWeightsForSampler, op::SaveState, op::LoadState, op::Sample, op::ComputeLogprobs,
                            op::LoadWeightsForSampling RLLOOP_TEST_OPERATION_ENTRY>;

namespace op {

// Whether a session runs the operation (it has a session method).
template <class Op>
concept SessionOperation = requires { typename Op::Params; };

// A restart can only bring back what changed the state; a saved state only makes sense after a change.
template <class Op>
concept Consistent = (!Op::replayed || Op::mutates) && (!Op::autosaved || Op::mutates) &&
                     !(Op::replayed && Op::autosaved);

// The operations of `L` for which Pred<Op>::value holds, as a List.
template <template <class> class Pred, class L>
struct Filter;
template <template <class> class Pred>
struct Filter<Pred, List<>> {
  using type = List<>;
};
template <template <class> class Pred, class Op, class... Rest>
struct Filter<Pred, List<Op, Rest...>> {
  template <class Head, class Tail>
  struct Prepend;
  template <class Head, class... T>
  struct Prepend<Head, List<T...>> {
    using type = List<Head, T...>;
  };
  using rest = typename Filter<Pred, List<Rest...>>::type;
  using type = std::conditional_t<Pred<Op>::value, typename Prepend<Op, rest>::type, rest>;
};

template <class Op>
struct RunBySession : std::bool_constant<SessionOperation<Op>> {};
// The operations a Session provides, in the list's order.
using SessionOperations = Filter<RunBySession, Operations>::type;

// Whether S runs Op with exactly the descriptor's parameters and result.
template <class S, class Op, class P = typename Op::Params>
inline constexpr bool runs = false;
template <class S, class Op, class... A>
inline constexpr bool runs<S, Op, Params<A...>> = requires(S& s, A... a) {
  { Op::call(s, a...) } -> std::same_as<Future<typename Op::Result>>;
};

template <class S, class L>
inline constexpr bool runs_all = false;
template <class S, class... Ops>
inline constexpr bool runs_all<S, List<Ops...>> = (runs<S, Ops> && ...);

template <class... Ops>
constexpr bool all_consistent(List<Ops...>) {
  return (Consistent<Ops> && ...);
}
static_assert(all_consistent(Operations{}), "an operation replayed or autosaved must mutate, and not be both");

}  // namespace op
}  // namespace rlloop
