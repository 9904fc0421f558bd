// Memory that grows linearly: the logits of a training pass exist one chunk of rows at a time
// (target_logprobs.hpp) and attention keeps no [heads, T, T] tensor, so one forward_backward's peak grows with
// tokens x hidden size, not with tokens x vocabulary or with the square of the length. Measured with the caching CPU
// allocator's statistics (blocks of 1 MiB and more); bench/engine/memory_bench.cpp gives the figures at Qwen3's
// vocabulary.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <rlloop/local.hpp>

#include "batch.hpp"
#include "cpu_allocator.hpp"
#include "model_config.hpp"
#include "model_io.hpp"
#include "target_logprobs.hpp"

using namespace rlloop;
using namespace rlloop::engine;

namespace {

// Qwen3's shape (q/k norms, tied embeddings, grouped-query heads) at a small width.
ModelConfig qwen3_shaped(std::int64_t vocab, std::int64_t positions = 4096) {
  return ModelConfig::from_json({{"model_type", "qwen3"},
                                 {"vocab_size", vocab},
                                 {"hidden_size", 64},
                                 {"intermediate_size", 128},
                                 {"num_hidden_layers", 2},
                                 {"num_attention_heads", 4},
                                 {"num_key_value_heads", 2},
                                 {"head_dim", 16},
                                 {"tie_word_embeddings", true},
                                 {"max_position_embeddings", positions},
                                 {"rope_theta", 1000000.0},
                                 {"rms_norm_eps", 1e-6}});
}

std::vector<Datum> batch_of(int rows, int tokens, std::int64_t vocab) {
  std::vector<Datum> out;
  for (int r = 0; r < rows; ++r) {
    std::vector<token_id> ids, targets;
    for (int t = 0; t < tokens; ++t) {
      ids.push_back(static_cast<token_id>((r * 7919 + t * 104729) % vocab));
      targets.push_back(static_cast<token_id>((r * 31 + t * 17 + 5) % vocab));
    }
    Datum d;
    d.model_input = ModelInput::from_tokens(ids);
    d.loss_fn_inputs["target_tokens"] = TensorData::from_tokens(targets);
    d.loss_fn_inputs["weights"] = TensorData::from_floats(std::vector<float>(ids.size(), 1.0f));
    out.push_back(std::move(d));
  }
  return out;
}

// The most memory in large blocks one forward_backward held beyond what was held before it.
double peak_mib(std::int64_t vocab, int rows, int tokens, torch::ScalarType dtype = torch::kFloat32) {
  CachingCpuAllocator* allocator = installed_caching_cpu_allocator();
  auto model = init_model(qwen3_shaped(vocab), 1, torch::kCPU, dtype);
  const auto data = batch_of(rows, tokens, vocab);
  const std::size_t before = allocator->stats().in_use_bytes;
  allocator->reset_peak();
  run_builtin_loss(*model, data, LossSpec::cross_entropy(), /*backward=*/true);
  return static_cast<double>(allocator->stats().peak_in_use_bytes - before) / (1 << 20);
}

// Every trainable parameter's gradient after backward of sum(w * logprobs).
std::vector<torch::Tensor> gradients(Transformer& model, const torch::Tensor& ids, const torch::Tensor& targets,
                                     std::int64_t chunk_values, torch::Tensor* logprobs) {
  for (auto& [name, p] : model.named_trainable_parameters()) p.mutable_grad().reset();
  const auto lp = target_logprobs(model, model.hidden_states(ids), targets, chunk_values);
  const auto w = torch::linspace(-1.0, 2.0, lp.numel()).view(lp.sizes());
  (lp * w).sum().backward();
  *logprobs = lp.detach();
  std::vector<torch::Tensor> out;
  for (auto& [name, p] : model.named_trainable_parameters()) out.push_back(p.grad().clone());
  return out;
}

}  // namespace

TEST(TargetLogprobs, ChunksGiveThePlainGraphsValuesAndGradients) {
  const ModelConfig cfg = qwen3_shaped(96);
  const torch::Tensor ids = torch::randint(0, 96, {3, 11}, torch::kLong);
  const torch::Tensor targets = torch::randint(0, 96, {3, 11}, torch::kLong);
  // Full fine-tuning (the tied embedding gets gradients from the lookup and from the logits), then LoRA with an
  // adapter on the lm_head itself.
  for (const bool lora : {false, true}) {
    auto model = init_model(cfg, 4, torch::kCPU, torch::kFloat64);
    if (lora) {
      model->enable_lora(LoraOptions{.rank = 4, .alpha = 8, .target_modules = {"all-linear", "lm_head"}}, 2);
      torch::NoGradGuard g;
      for (auto& [name, p] : model->named_trainable_parameters()) p.normal_(0, 0.1);  // B = 0 would hide bugs
    }
    torch::Tensor plain_lp, chunked_lp;
    const auto plain = gradients(*model, ids, targets, kLogitChunkValues, &plain_lp);
    const auto chunked = gradients(*model, ids, targets, 5 * 96, &chunked_lp);  // 5 rows per chunk: 7 chunks
    EXPECT_LT((plain_lp - chunked_lp).abs().max().item<double>(), 1e-12) << "lora " << lora;
    ASSERT_EQ(plain.size(), chunked.size());
    for (std::size_t i = 0; i < plain.size(); ++i)
      EXPECT_LT((plain[i] - chunked[i]).abs().max().item<double>(), 1e-12) << "lora " << lora << " parameter " << i;
  }
  // Without grad mode: values only, no graph.
  auto model = init_model(cfg, 4, torch::kCPU, torch::kFloat32);
  torch::NoGradGuard no_grad;
  EXPECT_FALSE(target_logprobs(*model, model->hidden_states(ids), targets, 96).requires_grad());
}

TEST(TrainingMemory, OneForwardBackwardGrowsWithTokensTimesHiddenNotVocabularyOrLengthSquared) {
  configure_engine_process({.num_threads = 2});
  ASSERT_NE(installed_caching_cpu_allocator(), nullptr) << "the caching CPU allocator is off (RLLOOP_CPU_CACHE_MB=0)";
  for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    const char* name = dtype == torch::kFloat32 ? "fp32" : "bf16";
    // The vocabulary: 4096 tokens over 16k and 64k entries. Whole fp32 logits would add 4096 x 48k x 4 bytes =
    // 768 MiB per copy (three or four copies); parameters and their gradients (tied: [V, 64] each) add 24 MiB.
    const double small_vocab = peak_mib(16384, 1, 4096, dtype), large_vocab = peak_mib(65536, 1, 4096, dtype);
    std::printf("%s peak MiB: vocabulary 16k %.0f, 64k %.0f\n", name, small_vocab, large_vocab);
    EXPECT_LT(large_vocab - small_vocab, 300.0) << name;
    // The length: 2 rows of 1024, 2048 and 3072 tokens. Linear growth gives equal increments; a [heads, T, T] term
    // would make the second 5/3 of the first.
    // (Over 16k entries every length's logits take several chunks of 1024 rows.)
    const double t1 = peak_mib(16384, 2, 1024, dtype), t2 = peak_mib(16384, 2, 2048, dtype),
                 t3 = peak_mib(16384, 2, 3072, dtype);
    std::printf("%s peak MiB: 1024 tokens %.0f, 2048 %.0f, 3072 %.0f\n", name, t1, t2, t3);
    EXPECT_LT(t3 - t2, 1.25 * (t2 - t1)) << name;
    EXPECT_GT(t2 - t1, 0.0) << name;
  }
}
