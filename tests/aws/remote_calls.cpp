// Every call of rlloop's C++ remote session, once, with inputs the service models allow (maxTokens >= 512 among
// them), against the endpoint given on the command line: the driver of remote_requests_test.py, which records
// the requests on their way and validates each against AWS's input shapes. Exits non-zero on any error.
// Usage: remote_calls URL   (SigV4 credentials from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, region us-west-2)
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include <rlloop/clients.hpp>
#include <rlloop/remote.hpp>

using namespace rlloop;

namespace {

Datum sft_datum(const std::vector<token_id>& tokens) {
  Datum d;
  d.model_input = ModelInput::from_tokens(std::vector<token_id>(tokens.begin(), tokens.end() - 1));
  d.loss_fn_inputs["target_tokens"] = TensorData::from_tokens(std::vector<token_id>(tokens.begin() + 1, tokens.end()));
  d.loss_fn_inputs["weights"] = TensorData::from_floats(std::vector<float>(tokens.size() - 1, 1.0f));
  return d;
}

Datum rl_datum(const std::vector<token_id>& tokens) {
  Datum d = sft_datum(tokens);
  const std::size_t n = tokens.size() - 1;
  d.loss_fn_inputs["logprobs"] = TensorData::from_floats(std::vector<float>(n, -5.0f));
  d.loss_fn_inputs["advantages"] = TensorData::from_floats(std::vector<float>(n, 0.5f));
  return d;
}

void check(bool ok, const char* what) {
  if (!ok) throw std::runtime_error(std::string("unexpected result: ") + what);
}

}  // namespace

int main(int argc, char** argv) try {
  if (argc != 2) {
    std::fprintf(stderr, "usage: remote_calls URL\n");
    return 2;
  }
  RemoteOptions options;
  options.endpoint = argv[1];
  options.region = "us-west-2";
  options.role_arn = "arn:aws:iam::111122223333:role/rlloop-test";
  options.s3_output_path = "s3://rlloop-test/out/";
  ServiceClient<RemoteService> service{RemoteService(options)};
  auto training = service.create_lora_training_client("rlloop-tiny", {.rank = 4, .alpha = 8});

  const std::vector<token_id> text{72, 105, 33, 10, 72, 105};
  const std::vector<Datum> batch{sft_datum(text)};
  check(training.forward(batch, LossSpec::cross_entropy()).get().loss_fn_outputs.size() == 1, "forward");
  training.forward_backward(batch, LossSpec::cross_entropy()).get();
  training.forward_backward({rl_datum(text)}, LossSpec::importance_sampling()).get();
  training.forward_backward({rl_datum(text)}, LossSpec::ppo()).get();
  training.forward_backward({rl_datum(text)}, LossSpec::cispo()).get();
  training
      .forward_backward_custom(batch,
                               [](const std::vector<Datum>&, const std::vector<std::vector<double>>& logprobs) {
                                 CustomLossResult r;  // -sum of logprobs: d/dlp = -1
                                 for (const auto& lp : logprobs) {
                                   r.grad_logprobs.emplace_back(lp.size(), -1.0);
                                   for (double v : lp) r.loss -= v;
                                 }
                                 return r;
                               })
      .get();
  training.optim_step(AdamParams{.learning_rate = 1e-3, .grad_clip_norm = 1.0}).get();
  const CheckpointRef state = training.save_state("driver-state").get();
  training.load_state(state.path, true).get();
  auto sampler = training.save_weights_and_get_sampling_client("driver-weights");

  const ModelInput prompt = ModelInput::from_tokens({72, 105});
  const SamplingParams params{.max_tokens = 512, .temperature = 1.0, .seed = 3, .stop = {"!"}};
  const SampleResponse samples = sampler.sample(prompt, 2, params, {.include = true, .top_k = 2}).get();
  check(samples.sequences.size() == 2, "sample");
  check(sampler.compute_logprobs(prompt).get().size() == 2, "compute_logprobs");
  training.live_sampling_client().sample(prompt, 1, params).get();
  check(!training.get_info().base_model.empty(), "info");
  check(training.usage().training > 0, "usage");
  training.session().stop();
  std::printf("remote_calls: every call answered\n");
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "remote_calls: %s\n", e.what());
  return 1;
}
