// rlloop::wire: a core request written as the SageMaker runtime's JSON reads back equal, and a bad field is named.
#include <cstdio>
#include <string>
#include <variant>

#include <rlloop/error.hpp>
#include <rlloop/wire/runtime.hpp>

int main() {
  rlloop::SampleRequest request;
  request.prompt = rlloop::ModelInput::from_tokens({1, 2, 3});
  request.params.max_tokens = 8;
  const auto body =
      rlloop::wire::json{{"operationConfig", rlloop::wire::to_json(rlloop::wire::SamplingOperation{request})}};
  const auto back = std::get<rlloop::SampleRequest>(rlloop::wire::execute_sampling_request_from_json(body));
  bool named = false;
  try {
    rlloop::wire::sampling_params_from_json({{"maxTokens", "8"}}, "samplingParams");
  } catch (const rlloop::invalid_argument& e) {
    named = std::string(e.what()) == "samplingParams.maxTokens: expected an integer";
  }
  std::printf("wire: %s\n", body.dump().c_str());
  return back.prompt == request.prompt && back.params.max_tokens == 8 && named ? 0 : 1;
}
