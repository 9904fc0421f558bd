// "What it must show" 3 of issue 44: an operation is its descriptor. This test is built with RLLOOP_TEST_OPERATION,
// which appends the throwaway rlloop::op::Test (test_operation/test_operation.hpp) to rlloop::Operations and binds
// it to the SageMaker wire (test_operation/test_operation_wire.hpp), and compiles the wire's sources itself: with no
// other edit, the operation is in the wire's training union, read and written by its codecs, listed in the union's
// errors, classified by its flags, and a member of AnySession that reaches the concrete session.
#ifndef RLLOOP_TEST_OPERATION
#error "operation_list_test is built only with RLLOOP_TEST_OPERATION (tests/json/CMakeLists.txt)"
#endif
#include <gtest/gtest.h>

#include <rlloop/error.hpp>
#include <rlloop/session.hpp>

#include "wire/runtime.hpp"

using namespace rlloop;

namespace {

// A session with every built-in operation unimplemented (never called here) and the test operation.
struct EchoSession {
  std::vector<std::string> seen;
  template <class R>
  static Future<R> unused() {
    throw std::logic_error("not called by this test");
  }
  Future<op::TestOutput> test_operation(const std::string& text) {
    seen.push_back(text);
    Promise<op::TestOutput> p;
    p.set_value(op::TestOutput{"echo: " + text});
    return p.future();
  }
  Future<ForwardBackwardOutput> forward(const std::vector<Datum>&, const LossSpec&) {
    return unused<ForwardBackwardOutput>();
  }
  Future<ForwardBackwardOutput> forward_backward(const std::vector<Datum>&, const LossSpec&) {
    return unused<ForwardBackwardOutput>();
  }
  Future<ForwardBackwardOutput> forward_backward_custom(const std::vector<Datum>&, const CustomLossFn&) {
    return unused<ForwardBackwardOutput>();
  }
  Future<OptimStepOutput> optim_step(const AdamParams&) { return unused<OptimStepOutput>(); }
  Future<CheckpointRef> save_state(const std::string&) { return unused<CheckpointRef>(); }
  Future<LoadStateOutput> load_state(const std::string&, bool) { return unused<LoadStateOutput>(); }
  Future<CheckpointRef> save_weights_for_sampler(const std::string&) { return unused<CheckpointRef>(); }
  Future<SampleResponse> sample(const SampleRequest&) { return unused<SampleResponse>(); }
  Future<std::vector<double>> compute_logprobs(const ComputeLogprobsRequest&) {
    return unused<std::vector<double>>();
  }
  SessionInfo info() { return {}; }
  TokenUsage usage() { return {}; }
};

// The same session without the new operation's method no longer is a Session.
struct WithoutTest {
  Future<ForwardBackwardOutput> forward(const std::vector<Datum>&, const LossSpec&);
  Future<ForwardBackwardOutput> forward_backward(const std::vector<Datum>&, const LossSpec&);
  Future<ForwardBackwardOutput> forward_backward_custom(const std::vector<Datum>&, const CustomLossFn&);
  Future<OptimStepOutput> optim_step(const AdamParams&);
  Future<CheckpointRef> save_state(const std::string&);
  Future<LoadStateOutput> load_state(const std::string&, bool);
  Future<CheckpointRef> save_weights_for_sampler(const std::string&);
  Future<SampleResponse> sample(const SampleRequest&);
  Future<std::vector<double>> compute_logprobs(const ComputeLogprobsRequest&);
  SessionInfo info();
  TokenUsage usage();
};

static_assert(Session<EchoSession>);
static_assert(!Session<WithoutTest>, "a session without the new operation's method must not satisfy Session");
static_assert(std::is_same_v<std::variant_alternative_t<6, wire::TrainingOperation>, wire::TestOp>);
static_assert(std::variant_size_v<wire::TrainingOperation> == 7);
static_assert(std::variant_size_v<wire::SamplingOperation> == 3);

TEST(OperationList, AnySessionForwardsTheNewOperation) {
  auto session = std::make_shared<EchoSession>();
  AnySession any(session);
  EXPECT_EQ(any.test_operation("hi").get().echoed, "echo: hi");
  EXPECT_EQ(session->seen, std::vector<std::string>{"hi"});
}

TEST(OperationList, TheWireWritesAndReadsTheNewOperation) {
  const wire::TrainingOperation op = wire::TestOp{"hello"};
  const wire::json j = wire::to_json(op);
  EXPECT_EQ(j.dump(), R"({"testOperation":{"text":"hello"}})");
  const wire::TrainingOperation back = wire::training_operation_from_json(j, "operationConfig");
  ASSERT_TRUE(std::holds_alternative<wire::TestOp>(back));
  EXPECT_EQ(std::get<wire::TestOp>(back).text, "hello");

  const wire::TrainingResult result = wire::TestResult{"echo: hello"};
  EXPECT_EQ(wire::to_json(result).dump(), R"({"testOperation":{"echoed":"echo: hello"}})");
  const auto read = wire::training_result_from_json(wire::to_json(result), "operationResult");
  EXPECT_EQ(std::get<wire::TestResult>(read).echoed, "echo: hello");
}

TEST(OperationList, TheUnionReaderValidatesTheNewOperation) {
  try {
    wire::training_operation_from_json(wire::json::parse(R"({"nope": {}})"), "operationConfig");
    FAIL() << "expected invalid_argument";
  } catch (const invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()),
              "operationConfig.nope: unknown member (expected one of forward, forwardBackward, optimizerStep, "
              "saveWeights, saveState, loadState, testOperation)");
  }
  try {
    wire::training_operation_from_json(wire::json::parse(R"({"testOperation": {"text": 3}})"), "operationConfig");
    FAIL() << "expected invalid_argument";
  } catch (const invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()), "operationConfig.testOperation.text: expected a string");
  }
}

TEST(OperationList, TheServersClassificationReadsTheNewDescriptor) {
  const wire::Effect by_value = wire::effect<wire::Call::training>(wire::TrainingOperation{wire::TestOp{"x"}});
  EXPECT_TRUE(by_value.replayed);
  EXPECT_TRUE(by_value.mutates);
  EXPECT_FALSE(by_value.autosaved);
  EXPECT_TRUE(wire::effect<wire::Call::training>("testOperation").replayed);
  EXPECT_FALSE(wire::effect<wire::Call::sampling>("testOperation").replayed);  // not a sampling member
}

}  // namespace
