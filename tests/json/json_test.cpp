#include <gtest/gtest.h>

#include "wire/control_plane.hpp"
#include "wire/loss_config.hpp"
#include "wire/runtime.hpp"

using namespace rlloop;
using namespace rlloop::wire;

namespace {

// The message of the invalid_argument that fn throws (fails the test when nothing is thrown).
template <class Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const invalid_argument& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected rlloop::invalid_argument";
  return {};
}

Datum sft_datum() {
  Datum d;
  d.model_input = ModelInput::from_tokens({151644, 872, 198});
  d.loss_fn_inputs["target_tokens"] = TensorData::from_ints({872, 198, 151645});
  d.loss_fn_inputs["weights"] = TensorData::from_floats({0.0f, 1.0f, 1.0f});
  return d;
}

// ExecuteTrainingOperation with one forwardBackward datum whose weights are replaced by `weights`.
json fb_body(json weights) {
  json d = to_json(sft_datum());
  d["lossFnInputs"]["weights"] = std::move(weights);
  json fb = json::object();
  fb["datumList"] = json::array({to_json(sft_datum()), to_json(sft_datum()), d});
  fb["lossFnName"] = "cross_entropy";
  json body = json::object();
  body["sequenceNumber"] = 7;
  body["operationConfig"]["forwardBackward"] = fb;
  return body;
}

}  // namespace

TEST(WireJson, SpecDatumExampleParses) {
  const json j = json::parse(R"({ "modelInput": {"chunks": [{"type": "encoded_text", "tokens": [151644, 872, 198]}]},
    "lossFnInputs": {
      "target_tokens": {"data": [872, 198, 151645], "dtype": "int64",   "shape": [3]},
      "weights":       {"data": [0.0, 1.0, 1.0],    "dtype": "float32", "shape": [3]} } })");
  const Datum d = datum_from_json(j, "d");
  EXPECT_EQ(d, sft_datum());
  EXPECT_EQ(d.loss_fn_inputs.at("target_tokens").int_data, (std::vector<std::int64_t>{872, 198, 151645}));
  // And it writes back to the same JSON.
  EXPECT_EQ(to_json(d), j);
}

TEST(WireJson, TrainingOperationsRoundTrip) {
  // The ppo epsilons' wire thresholds 1 - e and 1 + e are exact in binary, so the spec comes back equal; other
  // epsilons may come back an ulp off (the bounds the engine applies: LossAndOptimizerSettingsAreValidated).
  std::vector<TrainingOperation> ops = {
      ForwardOp{{{sft_datum()}, LossSpec::cross_entropy()}},
      ForwardBackwardOp{{{sft_datum(), sft_datum()}, LossSpec::ppo(0.25, 0.375)}},
      OptimizerStepOp{AdamParams{.learning_rate = 1e-3, .beta1 = 0.8, .grad_clip_norm = 1.0, .lora_plus_lr_ratio = 16}},
      SaveWeightsOp{true, false, "merged"},
      SaveWeightsOp{false, true, "peft"},
      SaveStateOp{"step 10"},
      LoadStateOp{"arn:aws:sagemaker:us-west-2:111122223333:model-package/ckpts/3", false}};
  std::int64_t seq = 1;  // the model's min
  for (const auto& op : ops) {
    ExecuteTrainingRequest req{seq++, "tok-" + std::to_string(seq), op};
    const json j = json::parse(to_json(req).dump());
    const ExecuteTrainingRequest back = execute_training_request_from_json(j);
    EXPECT_EQ(back.sequence_number, req.sequence_number);
    EXPECT_EQ(back.client_token, req.client_token);
    EXPECT_EQ(back.operation, req.operation) << j.dump();
  }
}

TEST(WireJson, ThePeftAdapterExtensionIsWrittenOnlyWhenSetAndExcludesMerging) {
  EXPECT_EQ(to_json(ExecuteTrainingRequest{1, std::nullopt, SaveWeightsOp{}})["operationConfig"]["saveWeights"],
            json({{"mergeWeights", false}}));
  const json both = {{"sequenceNumber", 1},
                     {"operationConfig", {{"saveWeights", {{"mergeWeights", true}, {"rlloopPeftAdapter", true}}}}}};
  try {
    execute_training_request_from_json(both);
    ADD_FAILURE() << "accepted both";
  } catch (const invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()), "operationConfig.saveWeights.rlloopPeftAdapter: is exclusive with mergeWeights");
  }
}

TEST(WireJson, SpecSampleBodiesParse) {
  const json req = json::parse(R"({ "operationConfig": { "sample": {
    "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
    "numSamples": 4,
    "samplingParams": {"maxTokens": 512, "temperature": 1.0, "topK": -1, "topP": 1.0, "seed": 0, "stop": ["\n\n"]},
    "includePromptLogprobs": true, "topkPromptLogprobs": 5,
    "modelPackageArn": "arn:aws:sagemaker:us-west-2:111122223333:model-package/ckpts/3" } } })");
  const auto op = execute_sampling_request_from_json(req);
  const auto& s = std::get<SampleRequest>(op);
  EXPECT_EQ(s.prompt.tokens(), (std::vector<token_id>{1, 2, 3}));
  EXPECT_EQ(s.num_samples, 4);
  EXPECT_EQ(s.params.max_tokens, 512);
  EXPECT_EQ(s.params.top_k, -1);
  EXPECT_EQ(s.params.seed, 0);
  EXPECT_EQ(s.params.stop, (std::vector<std::string>{"\n\n"}));
  EXPECT_TRUE(s.include_prompt_logprobs);
  EXPECT_EQ(s.topk_prompt_logprobs, 5);
  EXPECT_EQ(s.model_path, "arn:aws:sagemaker:us-west-2:111122223333:model-package/ckpts/3");
  EXPECT_EQ(to_json(op), req["operationConfig"]);

  const json res = json::parse(R"({ "status": "Completed", "operationResult": { "sample": {
    "sequences": [{"stopReason": "length", "tokens": [9, 8], "logprobs": [-0.5, -1.2],
                   "tokenUsage": {"prefill": 3, "decode": 2}}],
    "promptLogprobs": [-3.1, -0.7, -0.2],
    "topkPromptLogprobs": [[{"tokenId": 1, "logprob": -0.1}], [{"tokenId": 2, "logprob": -0.3}]] } } })");
  const auto state = sampling_state_from_json(res);
  EXPECT_EQ(state.status, OperationStatus::completed);
  const auto& r = std::get<SampleResponse>(*state.result);
  ASSERT_EQ(r.sequences.size(), 1u);
  EXPECT_EQ(r.sequences[0].stop_reason, StopReason::length);
  EXPECT_EQ(r.sequences[0].tokens, (std::vector<token_id>{9, 8}));
  EXPECT_EQ(r.sequences[0].logprobs, (std::vector<double>{-0.5, -1.2}));
  EXPECT_EQ(r.sequences[0].prefill_tokens, 3);
  EXPECT_EQ(r.sequences[0].decode_tokens, 2);
  EXPECT_EQ(*r.prompt_logprobs, (std::vector<double>{-3.1, -0.7, -0.2}));
  ASSERT_EQ(r.topk_prompt_logprobs->size(), 2u);
  EXPECT_EQ((*r.topk_prompt_logprobs)[1][0], (TokenLogprob{2, -0.3}));
  EXPECT_EQ(to_json(state), res);
}

TEST(WireJson, SpecForwardBackwardResultParses) {
  const json res = json::parse(R"({ "status": "Completed",
  "operationResult": { "forwardBackward": {
      "lossFnOutputs": [ {"logprobs": {"data": [-0.1, -2.3], "dtype": "float32", "shape": [2]}} ],
      "lossFnOutputType": "string",
      "metrics": {"loss:sum": 1.23},
      "tokenUsage": {"trainingTokens": 128} } },
  "errorDetails": "string",
  "tokenUsage": {"trainingTokens": 128} })");
  const auto state = training_state_from_json(res);
  const auto& out = std::get<ForwardBackwardResult>(*state.result).output;
  ASSERT_EQ(out.loss_fn_outputs.size(), 1u);
  const auto lp = out.logprobs(0);
  ASSERT_EQ(lp.size(), 2u);
  EXPECT_NEAR(lp[1], -2.3, 1e-6);
  EXPECT_EQ(out.metrics.at("loss:sum"), 1.23);
  EXPECT_EQ(out.training_tokens, 128);
  EXPECT_EQ(state.training_tokens, 128);
  EXPECT_EQ(state.error_details, "string");
}

// AWS's JSON writes the doubles JSON has no literal for as strings; nlohmann's default (null) made botocore's
// parser raise on a result with a NaN metric.
TEST(WireJson, NonFiniteDoublesAreWrittenAsAwsStringsAndReadBack) {
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  OptimStepOutput step;
  step.metrics = {{"grad_norm", nan}, {"hi", inf}, {"lo", -inf}, {"lr", 0.5}};
  const json j = to_json(TrainingResult{step});
  EXPECT_EQ(j.dump(), R"({"optimizerStep":{"metrics":{"grad_norm":"NaN","hi":"Infinity","lo":"-Infinity","lr":0.5}}})");
  const auto back = std::get<OptimStepOutput>(training_result_from_json(j, "operationResult")).metrics;
  EXPECT_TRUE(std::isnan(back.at("grad_norm")));
  EXPECT_EQ(back.at("hi"), inf);
  EXPECT_EQ(back.at("lo"), -inf);
  EXPECT_EQ(back.at("lr"), 0.5);

  SampleResponse r;
  r.sequences.push_back({});
  r.sequences[0].tokens = {5};
  r.sequences[0].logprobs = {-inf};
  r.prompt_logprobs = std::vector<double>{nan, -1.0};
  const json sj = to_json(r);
  EXPECT_EQ(sj["sequences"][0]["logprobs"], json::array({"-Infinity"}));
  EXPECT_EQ(sj["promptLogprobs"], json::array({"NaN", -1.0}));
  // Any other string is still not a number.
  EXPECT_EQ(error_of([] { wire::read::number(json("nan"), "metrics.x"); }), "metrics.x: expected a number");
}

TEST(WireJson, NestedTensorDataIsFlattenedWithItsShape) {
  const TensorData t = tensor_from_json(json::parse(R"({"data": [[1, 2, 3], [4, 5, 6]], "dtype": "int64"})"), "t");
  EXPECT_EQ(t.shape, (std::vector<std::int64_t>{2, 3}));
  EXPECT_EQ(t.int_data, (std::vector<std::int64_t>{1, 2, 3, 4, 5, 6}));
  EXPECT_NE(error_of([] {
              tensor_from_json(json::parse(R"({"data": [[1, 2], [3]], "dtype": "int64"})"), "t");
            }).find("t.data[1]: ragged nested array"),
            std::string::npos);
  EXPECT_EQ(
      error_of([] { tensor_from_json(json::parse(R"({"data": [1, 2, 3], "dtype": "int64", "shape": [2]})"), "t"); }),
      "t.shape: shape holds 2 elements but data holds 3");
  EXPECT_EQ(error_of([] { tensor_from_json(json::parse(R"({"data": [1.5], "dtype": "int64"})"), "t"); }),
            "t.data: expected integers");
  EXPECT_EQ(error_of([] { tensor_from_json(json::parse(R"({"data": [1], "dtype": "bfloat16"})"), "t"); }),
            "t.dtype: unsupported dtype 'bfloat16' (expected float32 or int64)");
}

TEST(WireJson, ErrorsNameTheJsonPath) {
  EXPECT_EQ(error_of([] {
              execute_training_request_from_json(fb_body({{"data", {"a", "b", "c"}}, {"dtype", "float32"}}));
            }),
            "operationConfig.forwardBackward.datumList[2].lossFnInputs.weights.data: expected numbers");
  EXPECT_EQ(error_of([] { execute_training_request_from_json(fb_body("nope")); }),
            "operationConfig.forwardBackward.datumList[2].lossFnInputs.weights: expected an object");
  EXPECT_EQ(error_of([] {
              execute_training_request_from_json(json{{"operationConfig", {{"saveState", json::object()}}}});
            }),
            "sequenceNumber: required field is missing");
  EXPECT_EQ(error_of([] {
              execute_training_request_from_json(
                  json{{"sequenceNumber", -1}, {"operationConfig", {{"saveState", json::object()}}}});
            }),
            "sequenceNumber: must be in [1, 2147483647], got -1");
  EXPECT_EQ(error_of([] {
              execute_training_request_from_json(json{{"sequenceNumber", 1},
                                                      {"clientToken", "bad token!"},
                                                      {"operationConfig", {{"saveState", json::object()}}}});
            }),
            "clientToken: must be 1-128 characters of [a-zA-Z0-9-]");
  EXPECT_EQ(error_of([] { execute_training_request_from_json(json::array()); }), "request body: expected an object");
}

TEST(WireJson, UnknownUnionMembersAndLossInputsAreRejected) {
  EXPECT_EQ(
      error_of([] {
        execute_training_request_from_json(
            json{{"sequenceNumber", 1}, {"operationConfig", {{"train", json::object()}}}});
      }),
      "operationConfig.train: unknown member (expected one of forward, forwardBackward, optimizerStep, saveWeights, "
      "saveState, loadState)");
  EXPECT_NE(error_of([] {
              execute_training_request_from_json(
                  json{{"sequenceNumber", 1},
                       {"operationConfig", {{"saveState", json::object()}, {"loadState", json::object()}}}});
            }).find("operationConfig: expected exactly one of"),
            std::string::npos);
  json body = fb_body({{"data", {1, 1, 1}}, {"dtype", "float32"}});
  body["operationConfig"]["forwardBackward"]["datumList"][0]["lossFnInputs"]["mask"] = {{"data", {1, 1, 1}},
                                                                                        {"dtype", "float32"}};
  EXPECT_NE(error_of([&] {
              execute_training_request_from_json(body);
            }).find("operationConfig.forwardBackward.datumList[0].lossFnInputs.mask: unknown loss input"),
            std::string::npos);
  EXPECT_EQ(
      error_of([] {
        sampling_operation_from_json(json{{"generate", json::object()}}, "operationConfig");
      }),
      "operationConfig.generate: unknown member (expected one of sample, computeLogprobs, loadWeightsForSampling)");
}

TEST(WireJson, LossAndOptimizerSettingsAreValidated) {
  json body = fb_body({{"data", {1, 1, 1}}, {"dtype", "float32"}});
  body["operationConfig"]["forwardBackward"]["lossFnName"] = "kto";
  EXPECT_NE(error_of([&] {
              execute_training_request_from_json(body);
            }).find("operationConfig.forwardBackward: unknown loss function 'kto'"),
            std::string::npos);
  body["operationConfig"]["forwardBackward"]["lossFnName"] = "ppo";
  body["operationConfig"]["forwardBackward"]["lossFnConfig"] = {{"clip_low_threshold", "high"}};
  EXPECT_EQ(error_of([&] { execute_training_request_from_json(body); }),
            "operationConfig.forwardBackward.lossFnConfig.clip_low_threshold: expected a number");
  body["operationConfig"]["forwardBackward"]["lossFnConfig"] = {{"clip_low_threshold", 0.6},
                                                                {"clip_high_threshold", 1.4}};
  const auto ok = execute_training_request_from_json(body);
  // The wire's thresholds become the spec's epsilons, and the clip range the engine applies is the one sent.
  const LossSpec& loss = std::get<ForwardBackwardOp>(ok.operation).loss;
  EXPECT_EQ(loss.fn, LossFn::ppo);
  EXPECT_NEAR(loss.epsilon_low, 0.4, 1e-15);
  EXPECT_NEAR(loss.epsilon_high, 0.4, 1e-15);
  EXPECT_EQ(loss.min_ratio(), 0.6);
  EXPECT_EQ(loss.max_ratio(), 1.4);
  EXPECT_EQ(loss_config(loss),
            (std::map<std::string, double>{{"clip_low_threshold", 0.6}, {"clip_high_threshold", 1.4}}));

  EXPECT_EQ(error_of([] {
              adam_from_json(json{{"learningRate", 0.5}}, "adam");
            }),
            "adam.learningRate: must be in [0.0, 0.01], got 0.5");
  EXPECT_EQ(error_of([] {
              adam_from_json(json{{"beta1", 0.9}}, "adam");
            }),
            "adam.learningRate: required field is missing");
  EXPECT_EQ(error_of([] {
              adam_from_json(json{{"learningRate", 1e-3}, {"momentum", 0.9}}, "adam");
            }),
            "adam.momentum: unknown field");
  const AdamParams a = adam_from_json(json{{"learningRate", 1e-3}, {"gradClipNorm", 1.0}}, "adam");
  EXPECT_EQ(a.learning_rate, 1e-3);
  EXPECT_EQ(a.grad_clip_norm, 1.0);
  EXPECT_EQ(a.beta2, AdamParams{}.beta2);

  EXPECT_EQ(error_of([] {
              sampling_params_from_json(json{{"maxTokens", 16}, {"topP", 1.5}}, "p");
            }),
            "p.topP: must be in (0, 1], got 1.5");
  EXPECT_EQ(error_of([] {
              sampling_params_from_json(json{{"temperature", 1.0}}, "p");
            }),
            "p.maxTokens: required field is missing");
}

TEST(WireJson, SamplingRoundTripsAndResults) {
  SampleRequest req{ModelInput::from_tokens({5, 6}).append({7}),
                    3,
                    SamplingParams{.max_tokens = 8,
                                   .temperature = 0.5,
                                   .top_k = 4,
                                   .top_p = 0.9,
                                   .seed = 42,
                                   .stop = {"x"},
                                   .stop_token_ids = {256}},
                    true,
                    2,
                    std::nullopt};
  const auto back = std::get<SampleRequest>(sampling_operation_from_json(to_json(SamplingOperation{req}), "c"));
  EXPECT_EQ(back.prompt, req.prompt);
  EXPECT_EQ(back.params, req.params);
  EXPECT_EQ(back.num_samples, 3);
  EXPECT_FALSE(back.model_path);
  EXPECT_FALSE(back.include_routed_experts);
  EXPECT_FALSE(to_json(req).contains("includeRoutedExperts"));  // off by default, and then not sent

  // Routing replay (models with experts): the request's flag and each sequence's routes, with their shape.
  req.include_routed_experts = true;
  EXPECT_TRUE(std::get<SampleRequest>(sampling_operation_from_json(to_json(SamplingOperation{req}), "c"))
                  .include_routed_experts);
  SampleResponse resp;
  resp.sequences.resize(1);
  resp.sequences[0].tokens = {1, 2};
  resp.sequences[0].logprobs = {-0.5, -0.25};
  TensorData routes = TensorData::from_ints({0, 3, 1, 2, 7, 4, 5, 6});
  routes.shape = {2, 2, 2};
  resp.sequences[0].routed_experts = routes;
  const json rj = to_json(resp);
  EXPECT_EQ(rj["sequences"][0]["routedExperts"]["shape"], json::parse("[2, 2, 2]"));
  const SampleResponse rback = sample_response_from_json(json::parse(rj.dump()), "r");
  EXPECT_EQ(rback.sequences[0].routed_experts, routes);
  resp.sequences[0].routed_experts.reset();
  EXPECT_FALSE(to_json(resp)["sequences"][0].contains("routedExperts"));

  SamplingOperationState st{OperationStatus::completed, SamplingResult{ComputeLogprobsResult{{0.0, -1.5}}},
                            std::nullopt, std::nullopt};
  const auto st2 = sampling_state_from_json(json::parse(to_json(st).dump()));
  EXPECT_EQ(std::get<ComputeLogprobsResult>(*st2.result).logprobs, (std::vector<double>{0.0, -1.5}));

  TrainingOperationState failed{OperationStatus::failed, std::nullopt, "datum 0: model input is empty", std::nullopt};
  const json fj = to_json(failed);
  EXPECT_EQ(fj, json::parse(R"({"status":"Failed","errorDetails":"datum 0: model input is empty"})"));
  EXPECT_FALSE(training_state_from_json(fj).result);
}

TEST(WireJson, SessionInfoAndUsageRoundTrip) {
  SessionInfo info;
  info.name = "s1";
  info.base_model = "tiny";
  info.lora = LoraOptions{8, 16, {"q_proj"}};
  info.vocab_size = 260;
  info.eos_token_id = 256;
  info.step = 3;
  EXPECT_FALSE(to_json(info).contains("experts"));  // a dense model
  info.experts = {8, 2, 3};
  const SessionInfo back = session_info_from_json(to_json(info), "");
  EXPECT_EQ(back.experts, (ExpertShape{8, 2, 3}));
  EXPECT_EQ(back.name, "s1");
  EXPECT_EQ(back.lora, info.lora);
  EXPECT_EQ(back.vocab_size, 260);
  EXPECT_EQ(back.eos_token_id, 256);
  EXPECT_EQ(back.step, 3);
  const TokenUsage u{1, 2, 3};
  EXPECT_EQ(token_usage_from_json(to_json(u), ""), u);
}

// The status enums carry exactly the model's strings (docs/wire.md), which the journal keeps too.
TEST(WireJson, StatusStringsRoundTrip) {
  std::vector<std::string> names;
  for (SessionStatus s : session_statuses) {
    names.emplace_back(to_string(s));
    EXPECT_EQ(session_status_from_string(to_string(s)), s);
  }
  EXPECT_EQ(names, (std::vector<std::string>{"Created", "Blocked", "Running", "Failed", "Scheduled", "Stopping",
                                             "Stopped", "Expired", "Deleting", "DeletionFailed"}));
  EXPECT_FALSE(session_status_from_string("running"));
  EXPECT_FALSE(session_status_from_string(""));

  for (const char* name : {"Pending", "InProgress", "Completed", "Failed", "Skipped"}) {
    const auto s = operation_status_from_string(name);
    ASSERT_TRUE(s) << name;
    EXPECT_EQ(to_string(*s), name);
    EXPECT_EQ(is_terminal(*s), std::string(name) != "Pending" && std::string(name) != "InProgress") << name;
  }
  EXPECT_FALSE(operation_status_from_string("Done"));
  EXPECT_EQ(error_of([] {
              training_state_from_json(json{{"status", "Done"}});
            }),
            "status: unknown operation status 'Done'");
}
