// The service metrics of a forward / forward_backward pass (src/engine/runtime/pass_metrics.hpp, docs/wire.md "Metrics"):
// their values, and that a batch split into chunks folded as the SageMaker SDK folds them (a datum-weighted mean
// of every metric, a sum of global_token_num) reports what the whole batch reports.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>

#include "model/model_config.hpp"
#include "runtime/pass_metrics.hpp"
#include "session_util.hpp"

using namespace rlloop;
using namespace test_util;

namespace {

// RL datums: a prompt (weight 0) then a completion with advantages of both signs and sampler logprobs off from
// the model's, so that some ratios leave PPO's clip range.
std::vector<Datum> policy_batch(int n) {
  std::vector<Datum> data;
  for (int i = 0; i < n; ++i) {
    Datum d = sft_datum("prompt " + std::to_string(i) + ": the answer is " + std::string(1 + i % 5, 'x'));
    const auto len = d.model_input.length();
    std::vector<float> w(len), adv(len), q(len);
    for (std::size_t j = 0; j < len; ++j) {
      w[j] = j >= 8 ? 1.0f : 0.0f;
      adv[j] = w[j] * static_cast<float>(std::sin(1.0 + 3 * i + j));
      q[j] = w[j] * static_cast<float>(-5.5 + 0.4 * std::cos(2.0 * i + j));
    }
    d.loss_fn_inputs["weights"] = TensorData::from_floats(w);
    d.loss_fn_inputs["advantages"] = TensorData::from_floats(adv);
    d.loss_fn_inputs["logprobs"] = TensorData::from_floats(q);
    data.push_back(std::move(d));
  }
  return data;
}

// The SDK's combine_forward_backward_results over chunk outputs of `sizes` datums.
Metrics sdk_fold(const std::vector<Metrics>& chunks, const std::vector<std::size_t>& sizes) {
  Metrics out;
  double total = 0;
  for (std::size_t c = 0; c < chunks.size(); ++c) total += static_cast<double>(sizes[c]);
  for (std::size_t c = 0; c < chunks.size(); ++c)
    for (const auto& [k, v] : chunks[c]) {
      if (k.ends_with("grad_norm"))
        out[k] = v;  // the accumulated gradient's: the last chunk's
      else
        out[k] += k == "global_token_num" ? v : v * static_cast<double>(sizes[c]) / total;
    }
  return out;
}

}  // namespace

TEST(PassMetrics, ForwardFlopsCountEveryProductOnce) {
  engine::ModelConfig cfg;
  cfg.vocab_size = 10, cfg.hidden_size = 4, cfg.intermediate_size = 6, cfg.num_hidden_layers = 2;
  cfg.num_attention_heads = 2, cfg.num_key_value_heads = 1, cfg.head_dim = 2;
  // Per layer: q 4x4, k and v 4x2 each, o 4x4, gate/up/down 3 x 4x6 = 16+16+16+72 = 120 multiply-adds per token;
  // the unembedding 40. Attention over 3 tokens: 6 query-key pairs, two products of width 4 each, per layer.
  const double per_token = 2 * (2 * 120 + 40);
  EXPECT_DOUBLE_EQ(engine::forward_flops(cfg, {3}), 3 * per_token + 2 * 2 * 4 * 6 * 2);
  EXPECT_DOUBLE_EQ(engine::forward_flops(cfg, {3, 1}),
                   4 * per_token + 2 * 2 * 4 * (6 + 1) * 2);  // the lengths attend apart
  // With experts in layer 1 (3 of width 5, 2 per token; layer 0 kept dense): its MLP is the router's 4x3 and two
  // experts' 3 x 4x5, 12 + 120 = 132 multiply-adds in place of 72.
  cfg.model_type = "qwen3_moe";
  cfg.num_experts = 3, cfg.num_experts_per_tok = 2, cfg.moe_intermediate_size = 5, cfg.mlp_only_layers = {0};
  EXPECT_DOUBLE_EQ(engine::forward_flops(cfg, {3}), 3 * 2 * (120 + (48 + 132) + 40) + 2 * 2 * 4 * 6 * 2);
}

TEST(PassMetrics, ValuesAndTheirDefinitions) {
  ::setenv("RLLOOP_PEAK_TFLOPS", "0.5", 1);
  auto dir = temp_dir("rlloop-metrics-test", "values");
  LocalService svc(service_in(dir.string()));
  auto s = svc.create_session(tiny(LoraOptions{4, 8, {"all-linear"}}, 3));
  const auto data = policy_batch(5);
  const auto out = s->forward(data, LossSpec::ppo(0.05, 0.05)).get();
  const auto& m = out.metrics;
  EXPECT_NEAR(m.at("loss"), m.at("loss:sum") / 5, 1e-12 * std::abs(m.at("loss:sum")));
  EXPECT_EQ(m.at("actor/pg_loss"), m.at("loss"));
  double tokens = 0;
  for (const auto& d : data) tokens += static_cast<double>(d.model_input.length());
  EXPECT_EQ(m.at("global_token_num"), tokens);
  EXPECT_EQ(m.at("promised_flops"), 0.5);  // TFLOP/s, as configured
  EXPECT_GT(m.at("estimated_flops"), 0.0);
  EXPECT_NEAR(m.at("mfu"), m.at("estimated_flops") / m.at("promised_flops"), 1e-12);
  // actor/ppo_kl: per datum, the mean over its loss-bearing tokens of (sampler logprob - logprob); then the mean.
  double kl = 0;
  for (std::size_t i = 0; i < data.size(); ++i) {
    const auto lp = out.logprobs(i);
    const auto q = data[i].loss_fn_inputs.at("logprobs").as_doubles();
    const auto w = data[i].loss_fn_inputs.at("weights").as_doubles();
    double sum = 0, n = 0;
    for (std::size_t j = 0; j < lp.size(); ++j)
      if (w[j] != 0) sum += q[j] - lp[j], n += 1;
    kl += sum / n / 5;
  }
  EXPECT_NEAR(m.at("actor/ppo_kl"), kl, 1e-9);
  // The clip range of 0.05 around sampler logprobs 0.4 away: some tokens clipped, not all.
  EXPECT_GT(m.at("actor/pg_clipfrac"), 0.0);
  EXPECT_LT(m.at("actor/pg_clipfrac"), 1.0);
  // Cross-entropy is not a policy loss: no actor/* metrics.
  const auto sft = s->forward(data, LossSpec::cross_entropy()).get().metrics;
  EXPECT_FALSE(sft.count("actor/pg_loss"));
  EXPECT_NEAR(sft.at("loss"), sft.at("loss:sum") / 5, 1e-12 * std::abs(sft.at("loss:sum")));
  ::unsetenv("RLLOOP_PEAK_TFLOPS");
}

TEST(PassMetrics, ChunksFoldedAsTheSdkFoldsThemEqualTheWholeBatch) {
  auto dir = temp_dir("rlloop-metrics-test", "chunks");
  LocalService svc(service_in(dir.string()));
  auto s = svc.create_session(tiny(std::nullopt, 4));
  const auto data = policy_batch(7);
  const auto whole = s->forward(data, LossSpec::ppo(0.05, 0.05)).get().metrics;
  const std::vector<Datum> a(data.begin(), data.begin() + 3), b(data.begin() + 3, data.end());
  const auto folded = sdk_fold({s->forward(a, LossSpec::ppo(0.05, 0.05)).get().metrics,
                                s->forward(b, LossSpec::ppo(0.05, 0.05)).get().metrics},
                               {3, 4});
  for (const char* k : {"loss", "actor/pg_loss", "actor/ppo_kl", "actor/pg_clipfrac"})
    EXPECT_NEAR(folded.at(k), whole.at(k), 1e-5 * std::max(1.0, std::abs(whole.at(k)))) << k;
  EXPECT_EQ(folded.at("global_token_num"), whole.at("global_token_num"));
  // rlloop's own loss:sum is a total: the SDK's mean of the chunks' totals is not the batch's.
  EXPECT_GT(std::abs(folded.at("loss:sum") - whole.at("loss:sum")), 0.1 * std::abs(whole.at("loss:sum")));
}

TEST(PassMetrics, GradNormIsTheAccumulatedGradientsAsTheStepSeesIt) {
  auto dir = temp_dir("rlloop-metrics-test", "grad-norm");
  LocalService svc(service_in(dir.string()));
  auto chunked = svc.create_session(tiny(std::nullopt, 4)), whole = svc.create_session(tiny(std::nullopt, 4));
  const auto data = policy_batch(7);
  const std::vector<Datum> a(data.begin(), data.begin() + 3), b(data.begin() + 3, data.end());
  const auto first = chunked->forward_backward(a, LossSpec::ppo(0.05, 0.05)).get().metrics;
  const auto second = chunked->forward_backward(b, LossSpec::ppo(0.05, 0.05)).get().metrics;
  const auto all = whole->forward_backward(data, LossSpec::ppo(0.05, 0.05)).get().metrics;
  EXPECT_GT(first.at("actor/grad_norm"), 0.0);
  EXPECT_NE(first.at("actor/grad_norm"), second.at("actor/grad_norm"));  // the second adds b's gradient to a's
  // Folded as the SDK folds a split batch (the last chunk's norm), it is the whole batch's.
  const auto folded = sdk_fold({first, second}, {3, 4});
  EXPECT_NEAR(folded.at("actor/grad_norm"), all.at("actor/grad_norm"), 1e-5 * all.at("actor/grad_norm"));
  // The step reports the same norm (before clipping); a forward pass, which computes no gradient, reports none.
  EXPECT_NEAR(chunked->optim_step({.learning_rate = 1e-3}).get().metrics.at("grad_norm"),
              second.at("actor/grad_norm"), 1e-12 * second.at("actor/grad_norm"));
  EXPECT_FALSE(chunked->forward(a, LossSpec::ppo(0.05, 0.05)).get().metrics.count("actor/grad_norm"));
}

TEST(PassMetrics, AnUnreadablePeakIsAnErrorNamingTheVariable) {
  ::setenv("RLLOOP_PEAK_TFLOPS", "fast", 1);
  auto dir = temp_dir("rlloop-metrics-test", "bad-peak");
  LocalService svc(service_in(dir.string()));
  auto s = svc.create_session(tiny());
  EXPECT_EQ(error_of([&] { s->forward({sft_datum("hello")}, LossSpec::cross_entropy()).get(); }),
            "RLLOOP_PEAK_TFLOPS: expected a positive number of TFLOP/s, got 'fast'");
  ::unsetenv("RLLOOP_PEAK_TFLOPS");
  EXPECT_GT(s->forward({sft_datum("hello")}, LossSpec::cross_entropy()).get().metrics.at("mfu"), 0.0);
}
