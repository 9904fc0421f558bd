// The built-in mixture-of-experts model (rlloop-tiny-moe, qwen3_moe) through the session API: full fine-tuning and
// LoRA on attention, router and experts train, sampling (the model's own decoding step, with its KV cache) gives the
// logprobs the training forward computes, and a checkpoint restores the same numbers.
#include <gtest/gtest.h>

#include <cmath>

#include "model/experts.hpp"
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

// Six SFT steps on `batch` at `lr`: the first step's loss and the last's.
std::pair<double, double> train_six_steps(TrainingClient<LocalSession>& client, const std::vector<Datum>& batch,
                                          double lr) {
  double first = 0, last = 0;
  for (int step = 0; step < 6; ++step) {
    const double loss = client.forward_backward(batch, LossSpec::cross_entropy()).get().metrics.at("loss:sum");
    (step == 0 ? first : last) = loss;
    client.optim_step({.learning_rate = lr}).get();
  }
  return {first, last};
}

// Full fine-tuning of `model` (the router and every expert train with the rest): six steps cut the loss, sampled
// tokens' logprobs are the computed ones, and a checkpoint restores into a new session with the same numbers.
// Returns the session.
TrainingClient<LocalSession> expect_full_fine_tuning_trains_samples_and_restores(ServiceClient<LocalService>& service,
                                                                                 const std::string& model,
                                                                                 const std::vector<Datum>& batch,
                                                                                 const ModelInput& prompt) {
  auto full = service.create_full_training_client(model, 1);
  auto [first, last] = train_six_steps(full, batch, 1e-2);
  EXPECT_LT(last, 0.9 * first) << model;
  auto sampler = full.live_sampling_client();
  expect_sampled_logprobs_are_computed_ones(sampler, prompt);
  const auto saved = full.save_state(model + "-step-6").get();
  const auto before = sampler.compute_logprobs(prompt).get();
  auto restored = service.create_training_client_from_state(saved.path, {.base_model = model});
  EXPECT_EQ(restored.live_sampling_client().compute_logprobs(prompt).get(), before) << model;
  return full;
}

}  // namespace

TEST(ExpertsSession, TheTinyMoeTrainsSamplesAndRestores) {
  const auto dir = temp_dir("experts-session", "tiny-moe");
  LocalService svc(service_in(dir.string()));
  ServiceClient<LocalService> service(svc);
  const std::vector<Datum> batch = {sft_datum("experts route every token"), sft_datum("two of eight per token")};
  const auto prompt = ModelInput::from_tokens(bytes("moe: "));

  auto full = expect_full_fine_tuning_trains_samples_and_restores(service, "rlloop-tiny-moe", batch, prompt);
  EXPECT_EQ(full.get_info().model_type, "qwen3_moe");

  // LoRA on attention, the router and the experts (all-linear, as PEFT reads it on a model with experts).
  EXPECT_EQ(error_of([&] {
              service.create_lora_training_client("rlloop-tiny-moe", {.rank = 4, .alpha = 8,
                                                                      .target_modules = {"up_proj"}});
            }),
            "LoraOptions.target_modules: 'up_proj' needs 'gate_proj' too on qwen3_moe models: the experts' gate and "
            "up projections are one stacked weight, adapted as one");
  auto lora = service.create_lora_training_client(
      "rlloop-tiny-moe", {.rank = 4, .alpha = 8, .target_modules = {"all-linear"}, .seed = 2});
  auto [lora_first, lora_last] = train_six_steps(lora, batch, 2e-2);
  EXPECT_LT(lora_last, lora_first);
  auto lora_sampler = lora.live_sampling_client();
  expect_sampled_logprobs_are_computed_ones(lora_sampler, prompt);
}

// gpt-oss's layer (rlloop-tiny-gpt-oss: sinks, a sliding window of 8 on layer 0, YaRN, clamped SwiGLU experts with
// biases, softmax after top-k) through the session API: it trains, its decoding steps (the ATen step with sinks and
// the window, past the window here) give the logprobs the training forward computes, with LoRA on attention too;
// adapters on its experts or router are refused by name.
TEST(ExpertsSession, TheTinyGptOssTrainsAndSamplesPastItsWindow) {
  const auto dir = temp_dir("experts-session", "tiny-gpt-oss");
  LocalService svc(service_in(dir.string()));
  ServiceClient<LocalService> service(svc);
  const std::vector<Datum> batch = {sft_datum("sinks take a share of attention"),
                                    sft_datum("every other layer slides")};
  const auto prompt = ModelInput::from_tokens(bytes("a window of eight: "));  // 19 tokens, and 12 more sampled

  // (Its checkpoint restores the sinks, biases and experts.)
  auto full = expect_full_fine_tuning_trains_samples_and_restores(service, "rlloop-tiny-gpt-oss", batch, prompt);
  const SessionInfo info = full.get_info();
  EXPECT_EQ(info.model_type, "gpt_oss");
  EXPECT_EQ(info.experts, (ExpertShape{8, 2, 2}));

  // Adapters on its experts and router (PEFT's target_parameters layout): per layer gate_up's A [E 2r, H] and
  // B [2I, E 2r], down's A [E r, I] and B [H, E r], the router's A [r, H] and B [E, r].
  auto experts = service.create_lora_training_client(
      "rlloop-tiny-gpt-oss",
      {.rank = 4, .alpha = 8, .target_modules = {"gate_proj", "up_proj", "down_proj", "router"}, .seed = 3});
  EXPECT_EQ(experts.get_info().num_trainable_parameters,
            2 * (8 * 8 * (32 + 2 * 16) + 8 * 4 * (16 + 32) + 4 * (32 + 8)));
  auto [experts_first, experts_last] = train_six_steps(experts, batch, 2e-2);
  EXPECT_LT(experts_last, experts_first);
  auto experts_sampler = experts.live_sampling_client();
  expect_sampled_logprobs_are_computed_ones(experts_sampler, prompt);

  auto lora = service.create_lora_training_client(
      "rlloop-tiny-gpt-oss", {.rank = 4, .alpha = 8, .target_modules = {"all-linear"}, .seed = 2});
  EXPECT_EQ(lora.get_info().num_trainable_parameters, 2 * (4 * (32 + 32) + 4 * (32 + 16) * 2 + 4 * (32 + 32)));
  auto [lora_first, lora_last] = train_six_steps(lora, batch, 2e-2);
  EXPECT_LT(lora_last, lora_first);
  auto lora_sampler = lora.live_sampling_client();
  expect_sampled_logprobs_are_computed_ones(lora_sampler, prompt);
}

namespace {
// The datum a trainer builds from a sample: the prompt and every generated token but the last as input, the
// generated tokens as targets (the prompt's own positions weigh 0), the sampler's routes when `replay`.
Datum datum_of(const ModelInput& prompt, const SampledSequence& seq, bool replay) {
  std::vector<token_id> input = prompt.tokens(), targets(input.begin() + 1, input.end());
  input.insert(input.end(), seq.tokens.begin(), seq.tokens.end() - 1);
  targets.insert(targets.end(), seq.tokens.begin(), seq.tokens.end());
  std::vector<float> weights(input.size(), 0.0f);
  std::fill(weights.begin() + static_cast<std::ptrdiff_t>(prompt.length()) - 1, weights.end(), 1.0f);
  Datum d;
  d.model_input = ModelInput::from_tokens(input);
  d.loss_fn_inputs["target_tokens"] = TensorData::from_tokens(targets);
  d.loss_fn_inputs["weights"] = TensorData::from_floats(weights);
  if (replay) d.loss_fn_inputs["routed_experts"] = *seq.routed_experts;
  return d;
}

std::vector<double> forward_logprobs(TrainingClient<LocalSession>& client, const std::vector<Datum>& data,
                                     Metrics* metrics = nullptr) {
  const auto out = client.forward(data, LossSpec::cross_entropy()).get();
  if (metrics) *metrics = out.metrics;
  std::vector<double> all;
  for (std::size_t i = 0; i < data.size(); ++i) {
    const auto lp = out.logprobs(i);
    all.insert(all.end(), lp.begin(), lp.end());
  }
  return all;
}
}  // namespace

// The router's metrics (engine::router_metrics) on three tokens of hand-picked logits over E = 3 experts, k = 1, the
// third a padding token (mask 0) that must not count:
//   token 0: logits (0, ln 2, 0)  -> probabilities (1/4, 1/2, 1/4), routed to expert 1
//   token 1: logits (ln 3, 0, 0)  -> probabilities (3/5, 1/5, 1/5), routed to expert 0
//   token 2: logits (0, 0, ln 8)  -> (1/10, 1/10, 8/10), routed to expert 2: padding
// aux_loss = E * sum_e (routes to e / tokens) * (mean probability of e)
//          = 3 * (1/2 * 0.85/2 + 1/2 * 0.70/2 + 0 * 0.45/2) = 3 * 1.55 / 4 = 1.1625
// (the uniform load's value would be k = 1; counting the padding token, 3 * 3.0 / 9 = 1.0);
// z_loss = mean over real tokens of logsumexp(logits)^2 = ((ln 4)^2 + (ln 5)^2) / 2.
// Replayed to experts (1, 2, 2) instead: routes (0, 1, 1) -> aux 3 * (0.70 + 0.45) / 4 = 0.8625, and one real token
// of two routed otherwise than the router's own top 1: replay_mismatch 0.5.
TEST(RouterMetrics, AuxLossAndZLossAsComputedByHand) {
  namespace eng = rlloop::engine;
  const auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  const torch::Tensor logits =
      torch::tensor({0.0, std::log(2.0), 0.0, std::log(3.0), 0.0, 0.0, 0.0, 0.0, std::log(8.0)}, f64).reshape({3, 3});
  const torch::Tensor mask = torch::tensor({1.0, 1.0, 0.0}, f64);
  auto routes = [&](std::vector<std::int64_t> experts) {
    return eng::Routes{torch::tensor(experts, torch::kInt64).reshape({3, 1}), torch::ones({3, 1}, f64)};
  };
  eng::RouterTotals own;
  eng::add_router_totals(own, logits, routes({1, 0, 2}), mask, false);
  const auto metrics = eng::router_metrics(own);
  EXPECT_NEAR(metrics.at("router/aux_loss"), 1.1625, 1e-12);
  EXPECT_NEAR(metrics.at("router/z_loss"), (std::pow(std::log(4.0), 2) + std::pow(std::log(5.0), 2)) / 2, 1e-6);
  EXPECT_FALSE(metrics.count("router/replay_mismatch"));

  eng::RouterTotals replayed;
  eng::add_router_totals(replayed, logits, routes({1, 2, 2}), mask, true);
  const auto replay_metrics = eng::router_metrics(replayed);
  EXPECT_NEAR(replay_metrics.at("router/aux_loss"), 0.8625, 1e-12);
  EXPECT_NEAR(replay_metrics.at("router/replay_mismatch"), 0.5, 1e-12);
}

// Routing replay through the session API (issue 27, must-show 2). sample() returns every sequence's routes when
// asked; a datum carrying them makes forward route exactly so. Before any update the trainer's own routing agrees
// with the sampler's and replay changes nothing; after an optimizer step that moves the routers the trainer would
// route otherwise (router/replay_mismatch > 0) and its logprobs with the sampler's routes are not those without.
TEST(ExpertsSession, SampledRoutesReplayInTraining) {
  const auto dir = temp_dir("experts-session", "replay");
  LocalService svc(service_in(dir.string()));
  ServiceClient<LocalService> service(svc);
  auto trainer = service.create_full_training_client("rlloop-tiny-moe", 3);
  const SessionInfo info = trainer.get_info();
  EXPECT_EQ(info.experts, (ExpertShape{8, 2, 2}));
  auto sampler = trainer.live_sampling_client();

  const auto prompt = ModelInput::from_tokens(bytes("route me: "));
  SampleRequest req{prompt, 3, {.max_tokens = 9, .temperature = 1.0, .seed = 4}};
  req.include_routed_experts = true;
  const auto sampled = sampler.sample(req).get();
  const auto P = static_cast<std::int64_t>(prompt.length());
  for (const auto& seq : sampled.sequences) {
    ASSERT_TRUE(seq.routed_experts);
    const auto n = static_cast<std::int64_t>(seq.tokens.size());
    EXPECT_EQ(seq.routed_experts->shape, (std::vector<std::int64_t>{P + n - 1, 2, 2}));
    // The prompt is prefilled once for every sample: its routes are the same in each.
    const auto& first = sampled.sequences.front().routed_experts->int_data;
    EXPECT_TRUE(std::equal(first.begin(), first.begin() + P * 4, seq.routed_experts->int_data.begin()));
  }
  EXPECT_FALSE(sampler.sample(prompt, 1, {.max_tokens = 3}).get().sequences[0].routed_experts);

  std::vector<Datum> replayed, free;
  for (const auto& seq : sampled.sequences) {
    replayed.push_back(datum_of(prompt, seq, true));
    free.push_back(datum_of(prompt, seq, false));
  }
  Metrics metrics;
  const auto before = forward_logprobs(trainer, replayed, &metrics);
  // The decoding steps' arithmetic is not the training forward's, so a near tie could route otherwise; replay
  // takes the sampler's routes wherever that happens.
  EXPECT_LE(metrics.at("router/replay_mismatch"), 0.02);
  // Only that the session reports it within bounds (k = 2 for a uniform load, more the less even it is, at most
  // k * E = 16): the formula is checked against hand-computed values (RouterMetrics.AuxLossAndZLossAsComputedByHand
  // above) and against transformers' aux_loss (tests/hf, hf_parity_test's `router` check).
  const double aux = metrics.at("router/aux_loss");
  EXPECT_GT(aux, 1.0);
  EXPECT_LT(aux, 16.0);
  EXPECT_EQ(forward_logprobs(trainer, free, &metrics).size(), before.size());
  EXPECT_FALSE(metrics.count("router/replay_mismatch"));  // nothing replayed
  EXPECT_TRUE(metrics.count("router/aux_loss"));
  // The sampler's logprobs are the replayed forward's.
  std::size_t at = 0;
  for (const auto& seq : sampled.sequences) {
    for (std::size_t i = 0; i < seq.tokens.size(); ++i)
      EXPECT_NEAR(seq.logprobs[i], before[at + static_cast<std::size_t>(P) - 1 + i], lp_tol());
    at += static_cast<std::size_t>(P) + seq.tokens.size() - 1;
  }

  // A large step on other text moves the routers: some tokens now go elsewhere.
  trainer.forward_backward({sft_datum("the routers move"), sft_datum("experts trade tokens")},
                           LossSpec::cross_entropy());
  trainer.optim_step({.learning_rate = 5e-2}).get();
  const auto after_replayed = forward_logprobs(trainer, replayed, &metrics);
  const double mismatch = metrics.at("router/replay_mismatch");
  EXPECT_GT(mismatch, 0.0);
  const auto after_free = forward_logprobs(trainer, free);
  double differ = 0;
  for (std::size_t i = 0; i < after_free.size(); ++i)
    differ = std::max(differ, std::abs(after_free[i] - after_replayed[i]));
  EXPECT_GT(differ, 1e-4);
  EXPECT_NE(after_replayed, before);  // the weights moved too
}

// Routes that do not fit the datum or the model are refused by name, at submission, and the session goes on.
TEST(ExpertsSession, RoutesThatDoNotFitAreRefusedByName) {
  const auto dir = temp_dir("experts-session", "bad-routes");
  LocalService svc(service_in(dir.string()));
  ServiceClient<LocalService> service(svc);
  auto trainer = service.create_full_training_client("rlloop-tiny-moe", 3);
  Datum d = sft_datum("four tokens");  // 10 input tokens
  auto with_routes = [&](std::vector<std::int64_t> shape, std::int64_t fill) {
    Datum out = d;
    TensorData t;
    t.dtype = DType::int64;
    t.shape = shape;
    std::int64_t n = 1;
    for (auto s : shape) n *= s;
    for (std::int64_t i = 0; i < n; ++i) t.int_data.push_back(i % 2 + fill);
    out.loss_fn_inputs["routed_experts"] = t;
    return out;
  };
  auto refusal = [&](std::vector<Datum> batch) {
    return error_of([&] { trainer.forward(batch, LossSpec::cross_entropy()).get(); });
  };
  EXPECT_EQ(refusal({with_routes({9, 2, 2}, 0)}),
            "datum 0: loss input 'routed_experts' must be int64 [tokens = 10, sparse layers, experts per token], got "
            "int64 [9, 2, 2]");
  EXPECT_EQ(refusal({with_routes({10, 3, 2}, 0)}),
            "datum 0: loss input 'routed_experts' is [10, 3, 2] but the model routes each token to 2 experts in 2 "
            "sparse layers");
  EXPECT_EQ(refusal({with_routes({10, 2, 2}, 7)}),
            "datum 0: loss input 'routed_experts': expert id 8 at token 0, sparse layer 0 is out of range [0, 8)");
  Datum twice = with_routes({10, 2, 2}, 0);
  twice.loss_fn_inputs["routed_experts"].int_data[3] = 0;  // token 0, sparse layer 1: experts 0 and 0
  EXPECT_EQ(refusal({twice}),
            "datum 0: loss input 'routed_experts': expert 0 is given twice at token 0, sparse layer 1");
  Datum short_data = with_routes({10, 2, 2}, 0);
  short_data.loss_fn_inputs["routed_experts"].int_data.pop_back();  // a C++ TensorData need not fill its shape
  EXPECT_EQ(refusal({short_data}),
            "datum 0: loss input 'routed_experts' holds 39 values, not the product of its shape [10, 2, 2]");
  EXPECT_EQ(refusal({with_routes({10, 2, 2}, 0), d}),
            "datum 1: loss input 'routed_experts' is missing but datum 0's is given (routing replay routes every datum "
            "of a batch or none)");
  // The session is intact: the same batch with good routes runs.
  EXPECT_EQ(trainer.forward({with_routes({10, 2, 2}, 0), with_routes({10, 2, 2}, 2)}, LossSpec::cross_entropy())
                .get()
                .loss_fn_outputs.size(),
            2u);

  auto dense = service.create_full_training_client("rlloop-tiny", 3);
  const std::string type = dense.get_info().model_type;
  EXPECT_EQ(error_of([&] { dense.forward({with_routes({10, 2, 2}, 0)}, LossSpec::cross_entropy()).get(); }),
            "datum 0: loss input 'routed_experts': the model has no experts to route to");
  SampleRequest req{ModelInput::from_tokens(bytes("x")), 1, {.max_tokens = 2}};
  req.include_routed_experts = true;
  EXPECT_EQ(error_of([&] { dense.live_sampling_client().sample(req).get(); }),
            "SampleRequest.include_routed_experts: this " + type + " model has no experts");
  EXPECT_EQ(dense.get_info().experts, ExpertShape{});
}
