// The built-in mixture-of-experts model (rlloop-tiny-moe, qwen3_moe) through the session API: full fine-tuning and
// LoRA on attention, router and experts train, sampling (the model's own decoding step, with its KV cache) gives the
// logprobs the training forward computes, and a checkpoint restores the same numbers.
#include <gtest/gtest.h>

#include "session_util.hpp"

namespace {
using namespace rlloop;
using namespace test_util;

// Sampled tokens' logprobs against compute_logprobs over prompt + sample: the decoding step's routing and experts
// against the training forward's.
template <class Client>
void expect_sampled_logprobs_are_computed_ones(Client& sampler, const ModelInput& prompt) {
  const auto sampled = sampler.sample(prompt, 3, {.max_tokens = 12, .temperature = 1.0, .seed = 5}).get();
  ASSERT_EQ(sampled.sequences.size(), 3u);
  for (std::size_t s = 0; s < sampled.sequences.size(); ++s) {
    const auto& seq = sampled.sequences[s];
    auto full = prompt.tokens();
    full.insert(full.end(), seq.tokens.begin(), seq.tokens.end());
    const auto scored = sampler.compute_logprobs(ModelInput::from_tokens(full)).get();
    for (std::size_t i = 0; i < seq.tokens.size(); ++i)
      EXPECT_NEAR(seq.logprobs[i], scored[prompt.length() + i], lp_tol()) << "sample " << s << " token " << i;
  }
}

}  // namespace

TEST(ExpertsSession, TheTinyMoeTrainsSamplesAndRestores) {
  const auto dir = temp_dir("experts-session", "tiny-moe");
  LocalService svc(service_in(dir.string()));
  ServiceClient<LocalService> service(svc);
  const std::vector<Datum> batch = {sft_datum("experts route every token"), sft_datum("two of eight per token")};
  const auto prompt = ModelInput::from_tokens(bytes("moe: "));

  // Full fine-tuning: the router and every expert train with the rest.
  auto full = service.create_full_training_client("rlloop-tiny-moe", 1);
  EXPECT_EQ(full.get_info().model_type, "qwen3_moe");
  double first = 0, last = 0;
  for (int step = 0; step < 6; ++step) {
    const double loss = full.forward_backward(batch, LossSpec::cross_entropy()).get().metrics.at("loss:sum");
    (step == 0 ? first : last) = loss;
    full.optim_step({.learning_rate = 1e-2}).get();
  }
  EXPECT_LT(last, 0.9 * first);
  auto full_sampler = full.live_sampling_client();
  expect_sampled_logprobs_are_computed_ones(full_sampler, prompt);

  // A checkpoint restores into a new session with the same numbers.
  const auto saved = full.save_state("moe-step-6").get();
  const auto before = full_sampler.compute_logprobs(prompt).get();
  auto restored = service.create_training_client_from_state(saved.path, {.base_model = "rlloop-tiny-moe"});
  EXPECT_EQ(restored.live_sampling_client().compute_logprobs(prompt).get(), before);

  // LoRA on attention, the router and the experts (all-linear, as PEFT reads it on a model with experts).
  EXPECT_EQ(error_of([&] {
              service.create_lora_training_client("rlloop-tiny-moe", {.rank = 4, .alpha = 8,
                                                                      .target_modules = {"up_proj"}});
            }),
            "LoraOptions.target_modules: 'up_proj' needs 'gate_proj' too on qwen3_moe models: the experts' gate and "
            "up projections are one stacked weight, adapted as one");
  auto lora = service.create_lora_training_client(
      "rlloop-tiny-moe", {.rank = 4, .alpha = 8, .target_modules = {"all-linear"}, .seed = 2});
  first = last = 0;
  for (int step = 0; step < 6; ++step) {
    const double loss = lora.forward_backward(batch, LossSpec::cross_entropy()).get().metrics.at("loss:sum");
    (step == 0 ? first : last) = loss;
    lora.optim_step({.learning_rate = 2e-2}).get();
  }
  EXPECT_LT(last, first);
  auto lora_sampler = lora.live_sampling_client();
  expect_sampled_logprobs_are_computed_ones(lora_sampler, prompt);
}
