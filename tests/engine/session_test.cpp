// LocalSession end to end on the tiny built-in model: consistency of logprobs, LoRA, learning, bad input.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "session_util.hpp"

using namespace rlloop;
using namespace test_util;
namespace fs = std::filesystem;

namespace {
fs::path temp_dir(const std::string& name) { return test_util::temp_dir("rlloop-session-test", name); }
bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

const ModelInput kPrompt = ModelInput::from_tokens(bytes("12+34="));
}  // namespace

TEST(LocalSession, SampleLogprobsEqualComputeLogprobsAndForward) {
  LocalService svc(service_in(temp_dir("consistency")));
  auto tc = ServiceClient<LocalService>(svc).create_full_training_client("rlloop-tiny");
  SamplingParams params{.max_tokens = 12, .temperature = 1.0, .seed = 7};
  auto resp = tc.live_sampling_client().sample(kPrompt, 4, params, {.include = true, .top_k = 2}).get();
  ASSERT_EQ(resp.sequences.size(), 4u);
  // The prompt's own logprobs come with the samples when asked for: one per prompt token, the first 0.
  const auto prompt_scored = tc.live_sampling_client().compute_logprobs(kPrompt).get();
  ASSERT_TRUE(resp.prompt_logprobs && resp.topk_prompt_logprobs);
  ASSERT_EQ(resp.prompt_logprobs->size(), kPrompt.length());
  EXPECT_EQ((*resp.prompt_logprobs)[0], 0.0);
  for (std::size_t i = 1; i < kPrompt.length(); ++i)
    EXPECT_NEAR((*resp.prompt_logprobs)[i], prompt_scored[i], lp_tol());
  EXPECT_EQ(resp.topk_prompt_logprobs->size(), kPrompt.length());
  for (std::size_t i = 1; i < kPrompt.length(); ++i) EXPECT_EQ((*resp.topk_prompt_logprobs)[i].size(), 2u) << i;
  for (const auto& seq : resp.sequences) {
    ASSERT_EQ(seq.tokens.size(), seq.logprobs.size());
    auto full = kPrompt.tokens();
    full.insert(full.end(), seq.tokens.begin(), seq.tokens.end());
    auto scored = tc.live_sampling_client().compute_logprobs(ModelInput::from_tokens(full)).get();
    // forward with a built-in loss on the same tokens gives the same per-token logprobs.
    Datum d;
    d.model_input = ModelInput::from_tokens(std::vector<token_id>(full.begin(), full.end() - 1));
    d.loss_fn_inputs["target_tokens"] = TensorData::from_tokens(std::vector<token_id>(full.begin() + 1, full.end()));
    d.loss_fn_inputs["weights"] = TensorData::from_floats(std::vector<float>(full.size() - 1, 1.0f));
    auto fwd = tc.forward({d}, LossSpec::cross_entropy()).get().logprobs(0);
    const std::size_t p = kPrompt.length();
    for (std::size_t i = 0; i < seq.tokens.size(); ++i) {
      EXPECT_NEAR(seq.logprobs[i], scored[p + i], lp_tol()) << "token " << i;
      EXPECT_NEAR(seq.logprobs[i], fwd[p + i - 1], lp_tol()) << "token " << i;
    }
  }
}

LocalServiceOptions bf16_service_in(const fs::path& dir) {
  auto service = service_in(dir);
  service.sampling_precision = SamplingPrecision::bf16;
  return service;
}

// The largest |sampled - compute_logprobs| over the tokens of `resp` (sampled after kPrompt), and the same
// tokens' compute_logprobs.
template <class Client>
std::pair<double, std::vector<double>> sampled_vs_scored(Client& sc, const SampleResponse& resp) {
  double largest = 0.0;
  std::vector<double> scored_all;
  for (const auto& seq : resp.sequences) {
    auto full = kPrompt.tokens();
    full.insert(full.end(), seq.tokens.begin(), seq.tokens.end());
    const auto scored = sc.compute_logprobs(ModelInput::from_tokens(full)).get();
    for (std::size_t i = 0; i < seq.tokens.size(); ++i) {
      largest = std::max(largest, std::abs(seq.logprobs[i] - scored[kPrompt.length() + i]));
      scored_all.push_back(scored[kPrompt.length() + i]);
    }
  }
  return {largest, scored_all};
}

TEST(LocalSession, Bf16SamplingPrecisionStaysCloseToComputeLogprobs) {
  if (!test_device::cpu_fp32()) GTEST_SKIP() << "bf16 sampling precision is an option of fp32 models on the CPU";
  LocalService svc(bf16_service_in(temp_dir("bf16")));
  auto tc = ServiceClient<LocalService>(svc).create_full_training_client("rlloop-tiny");
  auto sc = tc.live_sampling_client();
  SamplingParams params{.max_tokens = 12, .temperature = 1.0, .seed = 7};
  auto resp = sc.sample(kPrompt, 4, params).get();
  for (const auto& seq : resp.sequences) ASSERT_EQ(seq.tokens.size(), 12u);
  const auto [largest, scored] = sampled_vs_scored(sc, resp);  // fp32 compute_logprobs, as training sees them
  EXPECT_LT(largest, 0.01);
  EXPECT_GT(largest, 1e-4);  // fp32 sampling stays within 1e-4 (the test above); bf16 shows its rounding
  auto again = sc.sample(kPrompt, 4, params).get();
  for (int i = 0; i < 4; ++i) EXPECT_EQ(again.sequences[i].tokens, resp.sequences[i].tokens);

  const std::string err = error_of([&] { sampling_precision_from("fp16"); });
  EXPECT_TRUE(contains(err, "sampling_precision") && contains(err, "'fp16'")) << err;
}

TEST(LocalSession, Bf16SamplingFollowsOptimizerStepsAndLoads) {
  if (!test_device::cpu_fp32()) GTEST_SKIP() << "bf16 sampling precision is an option of fp32 models on the CPU";
  // The session keeps the bf16-rounded weights across sample() calls; an optimizer step or a load must make
  // it round again. A stale snapshot would sample from the old weights, whose logprobs are far from the new
  // model's compute_logprobs on the same tokens.
  LocalService svc(bf16_service_in(temp_dir("bf16-steps")));
  auto tc = ServiceClient<LocalService>(svc).create_full_training_client("rlloop-tiny");
  auto sc = tc.live_sampling_client();
  const SamplingParams params{.max_tokens = 8, .temperature = 1.0, .seed = 3};
  // The decoder (and its snapshot) run from the second token on: every check needs samples that get there.
  const auto decoded = [](const SampleResponse& r) { return r.sequences[0].tokens.size() >= 2; };
  const auto first = sc.sample(kPrompt, 2, params).get();
  ASSERT_TRUE(decoded(first));
  const auto [before, scored_before] = sampled_vs_scored(sc, first);
  EXPECT_LT(before, 0.01);
  const std::string before_step = tc.save_state("before-step").get().path;

  tc.forward_backward({sft_datum("12+34=46")}, LossSpec::cross_entropy());
  tc.optim_step(AdamParams{.learning_rate = 0.05}).get();
  // The step moved these tokens' logprobs by far more than bf16 rounding does.
  const auto [moved, scored_after] = sampled_vs_scored(sc, first);
  double change = 0.0;
  for (std::size_t i = 0; i < scored_after.size(); ++i)
    change = std::max(change, std::abs(scored_after[i] - scored_before[i]));
  EXPECT_GT(change, 0.1);
  const auto stepped = sc.sample(kPrompt, 2, params).get();
  ASSERT_TRUE(decoded(stepped));
  EXPECT_LT(sampled_vs_scored(sc, stepped).first, 0.01);

  tc.load_state(before_step).get();
  const auto loaded = sc.sample(kPrompt, 2, params).get();
  ASSERT_TRUE(decoded(loaded));
  EXPECT_LT(sampled_vs_scored(sc, loaded).first, 0.01);
}

// The same for the default fp32 decoding: live sampling after optimizer steps uses the new weights.
TEST(LocalSession, Fp32SamplingFollowsOptimizerSteps) {
  LocalService svc(service_in(temp_dir("fp32-steps")));
  auto tc = ServiceClient<LocalService>(svc).create_full_training_client("rlloop-tiny");
  auto sc = tc.live_sampling_client();
  const SamplingParams params{.max_tokens = 8, .temperature = 1.0, .seed = 3};
  const auto first = sc.sample(kPrompt, 2, params).get();
  EXPECT_LT(sampled_vs_scored(sc, first).first, lp_tol());
  for (int i = 0; i < 3; ++i) {
    tc.forward_backward({sft_datum("12+34=46")}, LossSpec::cross_entropy());
    tc.optim_step(AdamParams{.learning_rate = 0.05}).get();
    const auto stepped = sc.sample(kPrompt, 2, params).get();
    EXPECT_LT(sampled_vs_scored(sc, stepped).first, lp_tol()) << "after step " << i + 1;
  }
}

TEST(LocalSession, OnlyAFewCheckpointModelsStayLoadedForSampling) {
  // A loop that saves sampler weights under a new name every step must not keep every model in memory: the
  // least recently used ones are dropped and read again from disk when asked for. Deleting checkpoints shows
  // which models were still loaded.
  LocalService svc(service_in(temp_dir("samplers")));
  auto tc = ServiceClient<LocalService>(svc).create_full_training_client("rlloop-tiny");
  const SamplingParams params{.max_tokens = 2, .seed = 1};
  std::vector<decltype(tc.live_sampling_client())> clients;
  for (int i = 0; i < 5; ++i) {
    clients.push_back(tc.save_weights_and_get_sampling_client("step-" + std::to_string(i)));
    clients.back().sample(kPrompt, 1, params).get();          // loads it
    if (i == 3) clients[0].sample(kPrompt, 1, params).get();  // step-0 used again: step-1 is now the oldest use
  }
  for (auto& c : clients) fs::remove_all(*c.model_path());
  // Loading step-4 dropped step-1 (least recently used), not step-0 (loaded first, used since).
  for (int i : {0, 2, 3, 4})
    EXPECT_EQ(clients[i].sample(kPrompt, 1, params).get().sequences.size(), 1u) << "step-" << i;
  const std::string err = error_of([&] { clients[1].sample(kPrompt, 1, params).get(); });
  EXPECT_TRUE(contains(err, "does not exist") && contains(err, "step-1")) << err;
}

TEST(LocalSession, SameSeedSameSamplesAndGreedyIsArgmax) {
  LocalService svc(service_in(temp_dir("seed")));
  auto tc = ServiceClient<LocalService>(svc).create_full_training_client("rlloop-tiny");
  auto sc = tc.live_sampling_client();
  SamplingParams p{.max_tokens = 16, .temperature = 1.0, .seed = 42};
  auto a = sc.sample(kPrompt, 3, p).get();
  auto b = sc.sample(kPrompt, 3, p).get();
  for (int i = 0; i < 3; ++i) EXPECT_EQ(a.sequences[i].tokens, b.sequences[i].tokens);
  p.seed = 43;
  auto c = sc.sample(kPrompt, 3, p).get();
  EXPECT_NE(a.sequences[0].tokens, c.sequences[0].tokens);

  // temperature 0, top_k 1 and a tiny top_p all give the argmax path.
  SamplingParams greedy{.max_tokens = 8, .temperature = 0.0};
  auto g = sc.sample(kPrompt, 2, greedy).get();
  EXPECT_EQ(g.sequences[0].tokens, g.sequences[1].tokens);
  auto k1 = sc.sample(kPrompt, 1, SamplingParams{.max_tokens = 8, .top_k = 1, .seed = 1}).get();
  auto p0 = sc.sample(kPrompt, 1, SamplingParams{.max_tokens = 8, .top_p = 1e-6, .seed = 2}).get();
  EXPECT_EQ(k1.sequences[0].tokens, g.sequences[0].tokens);
  EXPECT_EQ(p0.sequences[0].tokens, g.sequences[0].tokens);
  // The greedy first token is the argmax of the next-token distribution.
  auto prompt = kPrompt.tokens();
  double best = -1e30;
  token_id best_id = -1;
  for (token_id t = 0; t < 260; ++t) {
    auto with = prompt;
    with.push_back(t);
    double lp = sc.compute_logprobs(ModelInput::from_tokens(with)).get().back();
    if (lp > best) best = lp, best_id = t;
  }
  EXPECT_EQ(g.sequences[0].tokens[0], best_id);
}

TEST(LocalSession, StopStringsStopTokensAndMaxTokens) {
  LocalService svc(service_in(temp_dir("stop")));
  auto tc = ServiceClient<LocalService>(svc).create_full_training_client("rlloop-tiny");
  auto sc = tc.live_sampling_client();
  auto free_run = sc.sample(kPrompt, 1, SamplingParams{.max_tokens = 10, .temperature = 0.0}).get().sequences[0];
  EXPECT_EQ(free_run.stop_reason, StopReason::length);
  EXPECT_EQ(free_run.tokens.size(), 10u);
  EXPECT_EQ(free_run.decode_tokens, 10);
  EXPECT_EQ(free_run.prefill_tokens, static_cast<std::int64_t>(kPrompt.length()));
  // Stop on the third greedy token, by id and by string: the stopping token is kept.
  const token_id third = free_run.tokens[2];
  auto by_id =
      sc.sample(kPrompt, 1, SamplingParams{.max_tokens = 10, .temperature = 0.0, .stop_token_ids = {third}}).get();
  auto first_at = std::find(free_run.tokens.begin(), free_run.tokens.end(), third) - free_run.tokens.begin();
  EXPECT_EQ(by_id.sequences[0].stop_reason, StopReason::stop);
  EXPECT_EQ(by_id.sequences[0].tokens.size(), static_cast<std::size_t>(first_at + 1));
  if (third < 256) {
    auto by_str = sc.sample(kPrompt, 1,
                            SamplingParams{.max_tokens = 10, .temperature = 0.0, .stop = {std::string(1, char(third))}})
                      .get();
    EXPECT_EQ(by_str.sequences[0].stop_reason, StopReason::stop);
    EXPECT_EQ(by_str.sequences[0].tokens, by_id.sequences[0].tokens);
  }
}

TEST(LocalSession, LoraStartsEqualToBaseOnlyAdaptersTrainAndMergedExportMatches) {
  auto dir = temp_dir("lora");
  LocalService svc(service_in(dir.string()));
  ServiceClient<LocalService> service(svc);
  auto base = service.create_full_training_client("rlloop-tiny");
  auto lora = service.create_lora_training_client("rlloop-tiny", {.rank = 4, .alpha = 8, .seed = 3});
  std::vector<Datum> batch{sft_datum("7+8=15\n"), sft_datum("2+2=4\n")};
  auto lp_base = base.forward(batch, LossSpec::cross_entropy()).get();
  auto lp_lora = lora.forward(batch, LossSpec::cross_entropy()).get();
  for (std::size_t i = 0; i < batch.size(); ++i) EXPECT_EQ(lp_base.logprobs(i), lp_lora.logprobs(i));  // bit for bit

  auto info = lora.get_info();
  EXPECT_LT(info.num_trainable_parameters, info.num_parameters / 4);
  for (int s = 0; s < 3; ++s) {
    lora.forward_backward(batch, LossSpec::cross_entropy());
    lora.optim_step(AdamParams{.learning_rate = 1e-2});
  }
  auto trained = lora.forward(batch, LossSpec::cross_entropy()).get();
  EXPECT_NE(trained.logprobs(0), lp_base.logprobs(0));

  // Merged weights in HF layout load as a plain model with the adapted logits.
  auto merged_dir = (dir / "merged").string();
  lora.session().export_merged_model(merged_dir).get();
  auto merged = service.create_full_training_client(merged_dir);
  auto lp_merged = merged.forward(batch, LossSpec::cross_entropy()).get();
  // (Merged in bf16, each weight W + BA is rounded once more: the dtype's tolerance then.)
  const double merged_tol = test_device::dtype() == "fp32" ? 1e-5 : lp_tol();
  for (std::size_t i = 0; i < batch.size(); ++i) {
    auto a = lp_merged.logprobs(i), b = trained.logprobs(i);
    for (std::size_t j = 0; j < a.size(); ++j) EXPECT_NEAR(a[j], b[j], merged_tol);
  }
  // The PEFT adapter directory has the files PEFT reads.
  auto peft_dir = dir / "peft";
  lora.session().export_peft_adapter(peft_dir.string()).get();
  EXPECT_TRUE(fs::exists(peft_dir / "adapter_config.json"));
  EXPECT_TRUE(fs::exists(peft_dir / "adapter_model.safetensors"));
}

TEST(LocalSession, SftDrivesTheLossNearZero) {
  LocalService svc(service_in(temp_dir("sft")));
  auto tc = ServiceClient<LocalService>(svc).create_full_training_client("rlloop-tiny", 1);
  std::vector<Datum> batch{sft_datum("3+4=7\n"), sft_datum("9+1=10\n"), sft_datum("5+5=10\n"), sft_datum("8+6=14\n")};
  std::int64_t tokens = 0;
  for (const auto& d : batch) tokens += static_cast<std::int64_t>(d.model_input.length());
  double first = 0, last = 0;
  for (int step = 0; step < 150; ++step) {
    auto fb = tc.forward_backward(batch, LossSpec::cross_entropy());
    tc.optim_step(AdamParams{.learning_rate = 1e-2, .beta2 = 0.99});
    const double per_token = fb.get().metrics.at("loss:sum") / static_cast<double>(tokens);
    if (step == 0) first = per_token;
    last = per_token;
  }
  EXPECT_GT(first, 4.0);  // ~ln(260) at random init
  EXPECT_LT(last, 0.05);
  EXPECT_EQ(tc.get_info().step, 150);
  EXPECT_EQ(tc.usage().training, 150 * tokens);
}

namespace {
// Policy-gradient toy: one token after a fixed prompt; reward 1 if it is a digit. Returns the mean reward of
// the first and the last three steps.
std::pair<double, double> policy_gradient_toy(const LossSpec& loss) {
  LocalService svc(service_in(temp_dir("pg-" + std::string(to_string(loss.fn)))));
  auto tc = ServiceClient<LocalService>(svc).create_full_training_client("rlloop-tiny", 5);
  const auto prompt = bytes("n=");
  std::vector<double> mean_reward;
  for (int step = 0; step < 40; ++step) {
    auto resp = tc.live_sampling_client()
                    .sample(ModelInput::from_tokens(prompt), 32, SamplingParams{.max_tokens = 1, .seed = 1000 + step})
                    .get();
    std::vector<double> rewards;
    for (const auto& s : resp.sequences) rewards.push_back(s.tokens[0] >= '0' && s.tokens[0] <= '9' ? 1.0 : 0.0);
    double mean = 0;
    for (double r : rewards) mean += r / static_cast<double>(rewards.size());
    mean_reward.push_back(mean);
    std::vector<Datum> batch;
    for (std::size_t i = 0; i < rewards.size(); ++i) {
      Datum d;
      d.model_input = ModelInput::from_tokens(prompt);
      const std::size_t n = prompt.size();
      std::vector<std::int64_t> targets(n, 0);
      std::vector<float> adv(n, 0.0f), q(n, 0.0f);
      targets[0] = prompt[1];
      targets[n - 1] = resp.sequences[i].tokens[0];
      adv[n - 1] = static_cast<float>(rewards[i] - mean);
      q[n - 1] = static_cast<float>(resp.sequences[i].logprobs[0]);
      d.loss_fn_inputs["target_tokens"] = TensorData::from_ints(targets);
      d.loss_fn_inputs["advantages"] = TensorData::from_floats(adv);
      d.loss_fn_inputs["logprobs"] = TensorData::from_floats(q);
      batch.push_back(std::move(d));
    }
    tc.forward_backward(batch, loss);
    tc.optim_step(AdamParams{.learning_rate = 2e-2});
  }
  auto avg = [&](std::size_t from) { return (mean_reward[from] + mean_reward[from + 1] + mean_reward[from + 2]) / 3; };
  return {avg(0), avg(mean_reward.size() - 3)};
}
}  // namespace

TEST(LocalSession, PolicyGradientRaisesRewardWithImportanceSampling) {
  auto [before, after] = policy_gradient_toy(LossSpec::importance_sampling());
  EXPECT_LT(before, 0.2);
  EXPECT_GT(after, before + 0.5);
}

TEST(LocalSession, PolicyGradientRaisesRewardWithPpo) {
  auto [before, after] = policy_gradient_toy(LossSpec::ppo());
  EXPECT_LT(before, 0.2);
  EXPECT_GT(after, before + 0.5);
}

TEST(LocalSession, BadInputIsRejectedByNameAndTheSessionKeepsWorking) {
  auto dir = temp_dir("bad");
  LocalService svc(service_in(dir.string()));
  ServiceClient<LocalService> service(svc);
  auto tc = service.create_full_training_client("rlloop-tiny");
  const std::vector<Datum> good{sft_datum("1+1=2\n")};
  const double loss_before = tc.forward(good, LossSpec::cross_entropy()).get().metrics.at("loss:sum");

  auto out_of_range = good;
  out_of_range[0].model_input.chunks[0].tokens[1] = 999;
  EXPECT_TRUE(contains(error_of([&] { tc.forward_backward(out_of_range, LossSpec::cross_entropy()).get(); }),
                       "token id 999 at position 1 is out of range [0, 260)"));
  auto empty = good;
  empty[0] = Datum{};
  EXPECT_TRUE(contains(error_of([&] { tc.forward_backward(empty, LossSpec::cross_entropy()).get(); }),
                       "datum 0: model input is empty"));
  auto mismatch = good;
  mismatch[0].loss_fn_inputs["weights"] = TensorData::from_floats({1.0f, 1.0f});
  EXPECT_TRUE(contains(error_of([&] { tc.forward_backward(mismatch, LossSpec::cross_entropy()).get(); }),
                       "loss input 'weights' has 2 values but the model input has 5 tokens"));
  EXPECT_TRUE(contains(error_of([&] { loss_fn_from_string("reinforce"); }), "unknown loss function 'reinforce'"));
  EXPECT_TRUE(contains(error_of([&] { tc.forward_backward(good, LossSpec::ppo(-0.5)).get(); }),
                       "LossSpec::epsilon_low must be in [0, 1], got -0.500000"));
  auto nan_adv = good;
  const std::size_t n = nan_adv[0].model_input.length();
  std::vector<float> adv(n, 0.5f);
  adv[2] = std::nanf("");
  nan_adv[0].loss_fn_inputs["advantages"] = TensorData::from_floats(adv);
  nan_adv[0].loss_fn_inputs["logprobs"] = TensorData::from_floats(std::vector<float>(n, -1.0f));
  EXPECT_TRUE(contains(error_of([&] { tc.forward_backward(nan_adv, LossSpec::ppo()).get(); }),
                       "loss input 'advantages' holds a non-finite value at position 2"));
  EXPECT_TRUE(
      contains(error_of([&] { tc.optim_step(AdamParams{.learning_rate = -1e-3}).get(); }), "AdamParams.learning_rate"));
  EXPECT_TRUE(contains(error_of([&] { tc.live_sampling_client().sample(kPrompt, 0, SamplingParams{}).get(); }),
                       "SampleRequest.num_samples: must be in [1, 1000]"));

  // Missing and truncated weights files name the file.
  auto model_dir = dir / "exported";
  tc.session().export_merged_model(model_dir.string()).get();
  const auto weights = model_dir / "model.safetensors";
  fs::resize_file(weights, fs::file_size(weights) / 2);
  auto truncated = error_of([&] { service.create_full_training_client(model_dir.string()); });
  EXPECT_TRUE(contains(truncated, "model.safetensors")) << truncated;
  EXPECT_TRUE(contains(truncated, "truncated")) << truncated;
  fs::remove(weights);
  auto missing = error_of([&] { service.create_full_training_client(model_dir.string()); });
  EXPECT_TRUE(contains(missing, "model.safetensors")) << missing;
  EXPECT_TRUE(contains(error_of([&] { service.create_full_training_client("no-such-model"); }),
                       "unknown base model 'no-such-model'"));

  // Nothing above changed the weights or broke the session.
  EXPECT_EQ(tc.forward(good, LossSpec::cross_entropy()).get().metrics.at("loss:sum"), loss_before);
  tc.forward_backward(good, LossSpec::cross_entropy());
  EXPECT_NO_THROW(tc.optim_step(AdamParams{.learning_rate = 1e-3}).get());
}

TEST(LocalSession, CustomLossGradientMatchesTheBuiltinOne) {
  LocalService svc(service_in(temp_dir("custom")));
  ServiceClient<LocalService> service(svc);
  auto a = service.create_full_training_client("rlloop-tiny");
  auto b = service.create_full_training_client("rlloop-tiny");
  std::vector<Datum> batch{sft_datum("6+6=12\n"), sft_datum("1+2=3\n")};
  // Custom cross entropy: loss = -sum(lp), d loss / d lp = -1 for every token.
  CustomLossFn ce = [](const std::vector<Datum>&, const std::vector<std::vector<double>>& lps) {
    CustomLossResult r;
    for (const auto& lp : lps) {
      for (double v : lp) r.loss -= v;
      r.grad_logprobs.emplace_back(lp.size(), -1.0);
    }
    return r;
  };
  auto custom = a.forward_backward_custom(batch, ce).get();
  auto builtin = b.forward_backward(batch, LossSpec::cross_entropy()).get();
  EXPECT_NEAR(custom.metrics.at("loss:sum"), builtin.metrics.at("loss:sum"), lp_tol());
  a.optim_step(AdamParams{.learning_rate = 1e-2});
  b.optim_step(AdamParams{.learning_rate = 1e-2});
  auto la = a.forward(batch, LossSpec::cross_entropy()).get().logprobs(0);
  auto lb = b.forward(batch, LossSpec::cross_entropy()).get().logprobs(0);
  for (std::size_t i = 0; i < la.size(); ++i) EXPECT_NEAR(la[i], lb[i], lp_tol() / 10);
  // A gradient of the wrong length is refused by name.
  CustomLossFn bad = [](const std::vector<Datum>&, const std::vector<std::vector<double>>&) {
    return CustomLossResult{0.0, {{1.0}}, {}};
  };
  EXPECT_TRUE(contains(error_of([&] { a.forward_backward_custom(batch, bad).get(); }),
                       "returned gradients for 1 datums, expected 2"));
}

TEST(LocalSession, TypeErasedSessionBehavesLikeTheConcreteOne) {
  LocalService svc(service_in(temp_dir("any")));
  auto concrete = svc.create_session(tiny());
  AnySession erased(svc.create_session(tiny()));
  std::vector<Datum> batch{sft_datum("4+4=8\n")};
  TrainingClient<AnySession> any_client(std::make_shared<AnySession>(erased));
  TrainingClient<LocalSession> local_client(concrete);
  for (int s = 0; s < 2; ++s) {
    any_client.forward_backward(batch, LossSpec::cross_entropy());
    any_client.optim_step(AdamParams{.learning_rate = 1e-2});
    local_client.forward_backward(batch, LossSpec::cross_entropy());
    local_client.optim_step(AdamParams{.learning_rate = 1e-2});
  }
  EXPECT_EQ(any_client.forward(batch, LossSpec::cross_entropy()).get().logprobs(0),
            local_client.forward(batch, LossSpec::cross_entropy()).get().logprobs(0));
  EXPECT_EQ(any_client.get_info().step, 2);
  EXPECT_EQ(any_client.usage(), local_client.usage());
}

TEST(LocalSession, ValueHeadLearnsReturnsAndRoundTripsThroughCheckpoints) {
  auto dir = temp_dir("value");
  LocalService svc(service_in(dir.string()));
  ServiceClient<LocalService> service(svc);
  auto opts = tiny(LoraOptions{4, 8, {"all-linear"}}, 2);
  opts.value_head = true;
  auto tc = service.create_training_client(opts);
  EXPECT_TRUE(tc.get_info().value_head);
  Datum d;
  d.model_input = ModelInput::from_tokens(bytes("3+4=7"));
  d.loss_fn_inputs["returns"] = TensorData::from_floats({0.0f, 0.0f, 0.0f, 1.0f, 1.0f});
  std::vector<Datum> batch{d};
  double first = 0, last = 0;
  for (int s = 0; s < 60; ++s) {
    auto fb = tc.forward_backward(batch, LossSpec::value());
    tc.optim_step(AdamParams{.learning_rate = 1e-2});
    (s == 0 ? first : last) = fb.get().metrics.at("loss:sum");
  }
  EXPECT_GT(first, 0.5 * 0.9);  // values start near 0: 0.5 * (1 + 1) = 1
  EXPECT_LT(last, 0.05);
  auto values = tc.forward(batch, LossSpec::value()).get().loss_fn_outputs[0].at("values").as_doubles();
  ASSERT_EQ(values.size(), 5u);
  EXPECT_NEAR(values[4], 1.0, 0.2);
  EXPECT_NEAR(values[0], 0.0, 0.2);

  // The head is part of the trainable state: a new session loading the checkpoint predicts the same values.
  auto path = tc.save_state("critic").get().path;
  auto restored = service.create_training_client_from_state(path, opts);
  EXPECT_EQ(restored.forward(batch, LossSpec::value()).get().loss_fn_outputs[0].at("values").as_doubles(), values);
  // A session without a value head refuses the loss and the checkpoint, by name.
  auto plain = service.create_training_client(tiny(LoraOptions{4, 8, {"all-linear"}}, 2));
  EXPECT_TRUE(contains(error_of([&] { plain.forward(batch, LossSpec::value()).get(); }),
                       "needs a session created with a value head"));
  EXPECT_TRUE(contains(error_of([&] { plain.load_state(path, true).get(); }), "with a value head"));
}
