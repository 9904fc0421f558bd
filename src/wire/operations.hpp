// The SageMaker runtime API's binding of the session operations (rlloop/operations.hpp): for each descriptor, the
// union member that names it, the call that carries it (ExecuteTrainingOperation or ExecuteSamplingOperation), its
// request and result shapes, and their JSON codecs (defined in runtime.cpp). The unions, their readers and writers
// (runtime.hpp) are derived from these bindings; another protocol binds the same descriptors in its own header.
//
// Every descriptor must say how this protocol carries it: a Binding specialization, or NotOnTheWire. A descriptor
// with neither stops the wire from compiling (tests/json: wire_unbound_operation_compile_fail).
#pragma once
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <variant>
#include <vector>

#include <rlloop/operations.hpp>
#include <rlloop/types.hpp>

#include "wire/read.hpp"

namespace rlloop::wire {

// ---- operation shapes (the service model's unions) -----------------------------------------------

struct BatchOp {
  std::vector<Datum> data;
  LossSpec loss;
  bool operator==(const BatchOp&) const = default;
};
struct ForwardOp : BatchOp {};
struct ForwardBackwardOp : BatchOp {};
struct OptimizerStepOp {
  AdamParams adam;
  bool operator==(const OptimizerStepOp&) const = default;
};
struct SaveWeightsOp {
  bool merge_weights = false;
  // rlloop's extension (docs/wire.md): the LoRA adapters as a PEFT adapter directory (Tinker's
  // save_weights_external); exclusive with merge_weights.
  bool peft_adapter = false;
  std::string description;
  bool operator==(const SaveWeightsOp&) const = default;
};
struct SaveStateOp {
  std::string description;
  bool operator==(const SaveStateOp&) const = default;
};
struct LoadStateOp {
  std::string model_package_arn;
  bool load_optimizer = true;
  bool operator==(const LoadStateOp&) const = default;
};
struct LoadWeightsForSamplingOp {
  std::string model_package_arn;
};

struct ForwardResult {
  ForwardBackwardOutput output;
};
struct ForwardBackwardResult {
  ForwardBackwardOutput output;
};
struct SaveWeightsResult {
  std::optional<std::string> model_package_arn;
};
struct SaveStateResult {
  std::string model_package_arn;
};
struct ComputeLogprobsResult {
  std::vector<double> logprobs;
};
struct LoadWeightsForSamplingResult {};

// ---- the bindings ------------------------------------------------------------------------------------------

// The runtime API's two calls: ExecuteTrainingOperation (sequenced) and ExecuteSamplingOperation.
enum class Call { training, sampling };

template <class Op>
inline constexpr bool unbound = false;

// The primary template is the error for a descriptor nobody bound.
template <class Op>
struct Binding {
  static_assert(unbound<Op>, "an operation without a SageMaker binding: add Binding<op::...> or NotOnTheWire "
                             "(src/wire/operations.hpp)");
};

// An operation that no SageMaker call carries.
struct NotOnTheWire {
  static constexpr bool bound = false;
};

// What every bound operation declares besides its member name; the four codecs are defined in runtime.cpp.
// `read` sees the member's object `c` at `path` (operationConfig.<name>); `read_result` likewise.
template <Call C, class Req, class Res>
struct Bound {
  static constexpr bool bound = true;
  static constexpr Call call = C;
  using Request = Req;
  using Result = Res;
};

template <>
struct Binding<op::Forward> : Bound<Call::training, ForwardOp, ForwardResult> {
  static constexpr const char* name = "forward";
  static json write(const Request& r);
  static Request read(const json& c, const std::string& path);
  static json write_result(const Result& r);
  static Result read_result(const json& c, const std::string& path);
};
template <>
struct Binding<op::ForwardBackward> : Bound<Call::training, ForwardBackwardOp, ForwardBackwardResult> {
  static constexpr const char* name = "forwardBackward";
  static json write(const Request& r);
  static Request read(const json& c, const std::string& path);
  static json write_result(const Result& r);
  static Result read_result(const json& c, const std::string& path);
};
// A remote session runs it as forward + forwardBackward with a linear loss (remote_session.cpp).
template <>
struct Binding<op::ForwardBackwardCustom> : NotOnTheWire {};
template <>
struct Binding<op::OptimStep> : Bound<Call::training, OptimizerStepOp, OptimStepOutput> {
  static constexpr const char* name = "optimizerStep";
  static json write(const Request& r);
  static Request read(const json& c, const std::string& path);
  static json write_result(const Result& r);
  static Result read_result(const json& c, const std::string& path);
};
template <>
struct Binding<op::SaveWeightsForSampler> : Bound<Call::training, SaveWeightsOp, SaveWeightsResult> {
  static constexpr const char* name = "saveWeights";
  static json write(const Request& r);
  static Request read(const json& c, const std::string& path);
  static json write_result(const Result& r);
  static Result read_result(const json& c, const std::string& path);
};
template <>
struct Binding<op::SaveState> : Bound<Call::training, SaveStateOp, SaveStateResult> {
  static constexpr const char* name = "saveState";
  static json write(const Request& r);
  static Request read(const json& c, const std::string& path);
  static json write_result(const Result& r);
  static Result read_result(const json& c, const std::string& path);
};
template <>
struct Binding<op::LoadState> : Bound<Call::training, LoadStateOp, LoadStateOutput> {
  static constexpr const char* name = "loadState";
  static json write(const Request& r);
  static Request read(const json& c, const std::string& path);
  static json write_result(const Result& r);
  static Result read_result(const json& c, const std::string& path);
};
template <>
struct Binding<op::Sample> : Bound<Call::sampling, SampleRequest, SampleResponse> {
  static constexpr const char* name = "sample";
  static json write(const Request& r);
  static Request read(const json& c, const std::string& path);
  static json write_result(const Result& r);
  static Result read_result(const json& c, const std::string& path);
};
template <>
struct Binding<op::ComputeLogprobs> : Bound<Call::sampling, ComputeLogprobsRequest, ComputeLogprobsResult> {
  static constexpr const char* name = "computeLogprobs";
  static json write(const Request& r);
  static Request read(const json& c, const std::string& path);
  static json write_result(const Result& r);
  static Result read_result(const json& c, const std::string& path);
};
template <>
struct Binding<op::LoadWeightsForSampling>
    : Bound<Call::sampling, LoadWeightsForSamplingOp, LoadWeightsForSamplingResult> {
  static constexpr const char* name = "loadWeightsForSampling";
  static json write(const Request& r);
  static Request read(const json& c, const std::string& path);
  static json write_result(const Result& r);
  static Result read_result(const json& c, const std::string& path);
};

}  // namespace rlloop::wire

// The test-only build (tests/json, RLLOOP_TEST_OPERATION) binds its throwaway operation here.
#if defined(RLLOOP_TEST_OPERATION) && !defined(RLLOOP_TEST_OPERATION_UNBOUND)
#include "test_operation_wire.hpp"
#endif

namespace rlloop::wire {

// ---- derived from the bindings --------------------------------------------------------------------------------

// The operations one call carries, in the list's order.
template <Call C>
struct CarriedBy {
  template <class Op>
  struct Pred {
    static constexpr bool value = [] {
      if constexpr (Binding<Op>::bound)
        return Binding<Op>::call == C;
      else
        return false;
    }();
  };
  using type = typename op::Filter<Pred, Operations>::type;
};
template <Call C>
using CarriedOperations = typename CarriedBy<C>::type;

template <class L>
struct Unions;
template <class... Ops>
struct Unions<op::List<Ops...>> {
  using Request = std::variant<typename Binding<Ops>::Request...>;
  using Result = std::variant<typename Binding<Ops>::Result...>;
  // The union's member names, as read::union_member lists them in its errors.
  static constexpr const char* names[] = {Binding<Ops>::name...};
};

// The descriptor whose request (or result) shape is T, among the operations of L.
template <class T, class L>
struct OperationOf;
template <class T, class Op, class... Rest>
struct OperationOf<T, op::List<Op, Rest...>> {
  using type = std::conditional_t<std::is_same_v<T, typename Binding<Op>::Request> ||
                                      std::is_same_v<T, typename Binding<Op>::Result>,
                                  Op, typename OperationOf<T, op::List<Rest...>>::type>;
};
template <class T>
struct OperationOf<T, op::List<>> {
  using type = void;
};
template <class T, Call C>
using OperationOfShape = typename OperationOf<T, CarriedOperations<C>>::type;

// ---- what an operation does to the session's state (the descriptors' flags) ---------------------------------------

struct Effect {
  bool mutates = false;
  bool replayed = false;
  bool autosaved = false;
};
template <class Op>
constexpr Effect effect_of() {
  return {Op::mutates, Op::replayed, Op::autosaved};
}

// The effect of the operation a union holds, and of the one call C names `member` (none for a name it does not
// carry: the journal reads members of requests a server accepted).
template <Call C>
Effect effect(const typename Unions<CarriedOperations<C>>::Request& v) {
  return std::visit([](const auto& o) { return effect_of<OperationOfShape<std::decay_t<decltype(o)>, C>>(); }, v);
}
template <class... Ops>
constexpr Effect effect_of_member(std::string_view member, op::List<Ops...>) {
  Effect out;
  ((member == Binding<Ops>::name ? (out = effect_of<Ops>(), true) : false) || ...);
  return out;
}
template <Call C>
constexpr Effect effect(std::string_view member) {
  return effect_of_member(member, CarriedOperations<C>{});
}

}  // namespace rlloop::wire
