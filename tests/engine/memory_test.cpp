// Memory that grows linearly: the logits of a training pass exist one chunk of rows at a time
// (target_logprobs.hpp) and attention keeps no [heads, T, T] tensor, so one forward_backward's peak grows with
// tokens x hidden size, not with tokens x vocabulary or with the square of the length. Measured with the caching CPU
// allocator's statistics (blocks of 1 MiB and more); bench/engine/memory_bench.cpp gives the figures at Qwen3's
// vocabulary.
#include <gtest/gtest.h>

#include <ATen/record_function.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <optional>
#include <string_view>

#include <nlohmann/json.hpp>

#include <rlloop/local.hpp>

#include "runtime/batch.hpp"
#include "model/builtin_models.hpp"
#include "kernels/cpu_allocator.hpp"
#include "model/model_config.hpp"
#include "io/model_io.hpp"
#include "runtime/target_logprobs.hpp"

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
                                     std::int64_t chunk_values, torch::Tensor* logprobs,
                                     ExpertRouting* routing = nullptr) {
  for (auto& [name, p] : model.named_trainable_parameters()) p.mutable_grad().reset();
  const auto lp = target_logprobs(model, model.hidden_states(ids, nullptr, routing), targets, chunk_values);
  const auto w = torch::linspace(-1.0, 2.0, lp.numel()).view(lp.sizes());
  (lp * w).sum().backward();
  *logprobs = lp.detach();
  std::vector<torch::Tensor> out;
  for (auto& [name, p] : model.named_trainable_parameters()) out.push_back(p.grad().clone());
  return out;
}

// An fp64 model of `cfg` (differences are then wrong gradients, not rounding); with LoRA adapters on `lora_targets`
// drawn at random (B = 0 would hide bugs) when any are given.
std::shared_ptr<Transformer> fp64_model(const ModelConfig& cfg, const std::vector<std::string>& lora_targets) {
  auto model = init_model(cfg, 4, torch::kCPU, torch::kFloat64);
  if (!lora_targets.empty()) {
    model->enable_lora(LoraOptions{.rank = 4, .alpha = 8, .target_modules = lora_targets}, 2);
    torch::NoGradGuard g;
    for (auto& [name, p] : model->named_trainable_parameters()) p.normal_(0, 0.1);
  }
  return model;
}

// Every gradient of `a` within 1e-12 of `b`'s, and the logprobs too.
void expect_same_gradients(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b,
                           const torch::Tensor& a_lp, const torch::Tensor& b_lp, const std::string& what) {
  EXPECT_LT((a_lp - b_lp).abs().max().item<double>(), 1e-12) << what;
  ASSERT_EQ(a.size(), b.size()) << what;
  for (std::size_t i = 0; i < a.size(); ++i)
    EXPECT_LT((a[i] - b[i]).abs().max().item<double>(), 1e-12) << what << " parameter " << i;
}

}  // namespace

TEST(TargetLogprobs, ChunksGiveThePlainGraphsValuesAndGradients) {
  const ModelConfig cfg = qwen3_shaped(96);
  const torch::Tensor ids = torch::randint(0, 96, {3, 11}, torch::kLong);
  const torch::Tensor targets = torch::randint(0, 96, {3, 11}, torch::kLong);
  // Full fine-tuning (the tied embedding gets gradients from the lookup and from the logits), then LoRA with an
  // adapter on the lm_head itself.
  for (const bool lora : {false, true}) {
    auto model = fp64_model(cfg, lora ? std::vector<std::string>{"all-linear", "lm_head"} : std::vector<std::string>{});
    torch::Tensor plain_lp, chunked_lp;
    const auto plain = gradients(*model, ids, targets, kLogitChunkValues, &plain_lp);
    const auto chunked = gradients(*model, ids, targets, 5 * 96, &chunked_lp);  // 5 rows per chunk: 7 chunks
    expect_same_gradients(plain, chunked, plain_lp, chunked_lp, lora ? "lora" : "full");
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

// Activation checkpointing (Transformer::set_activation_checkpointing): the same values and gradients as the plain
// graph, full fine-tuning and LoRA (whose first layer's input does not require grad).
TEST(ActivationCheckpointing, GivesThePlainGraphsValuesAndGradients) {
  const ModelConfig cfg = qwen3_shaped(96);
  const torch::Tensor ids = torch::randint(0, 96, {3, 11}, torch::kLong);
  const torch::Tensor targets = torch::randint(0, 96, {3, 11}, torch::kLong);
  for (const bool lora : {false, true}) {
    auto model = fp64_model(cfg, lora ? std::vector<std::string>{"all-linear"} : std::vector<std::string>{});
    torch::Tensor plain_lp, checkpointed_lp;
    const auto plain = gradients(*model, ids, targets, kLogitChunkValues, &plain_lp);
    model->set_activation_checkpointing(true);
    const auto checkpointed = gradients(*model, ids, targets, kLogitChunkValues, &checkpointed_lp);
    expect_same_gradients(plain, checkpointed, plain_lp, checkpointed_lp, lora ? "lora" : "full");
    // Without grad mode nothing is checkpointed (no graph to save memory in): the plain forward's values.
    torch::NoGradGuard no_grad;
    EXPECT_FALSE(model->hidden_states(ids).requires_grad());
  }
  // Nor in a frozen model under grad mode: no layer trains, so there is nothing to differentiate and no graph.
  auto frozen = fp64_model(cfg, {});
  for (auto& p : frozen->parameters()) p.set_requires_grad(false);
  frozen->set_activation_checkpointing(true);
  EXPECT_FALSE(frozen->hidden_states(ids).requires_grad());
}

// With experts, a checkpointed layer's recompute routes by the routes its forward took (CheckpointedLayer), and a
// forward given routes (routing replay) takes them under checkpointing too: the plain graph's values and gradients.
TEST(ActivationCheckpointing, LayersWithExpertsRecomputeWithTheForwardsRoutes) {
  const ModelConfig cfg = with_experts(qwen3_shaped(96), 4, 2, 16);
  const torch::Tensor ids = torch::randint(0, 96, {3, 11}, torch::kLong);
  const torch::Tensor targets = torch::randint(0, 96, {3, 11}, torch::kLong);
  // Routes of other weights, to replay: not the ones the model would pick itself.
  ExpertRouting theirs, own;
  {
    torch::NoGradGuard no_grad;
    init_model(cfg, 9, torch::kCPU, torch::kFloat64)->hidden_states(ids, nullptr, &theirs);
    fp64_model(cfg, {})->hidden_states(ids, nullptr, &own);
  }
  ASSERT_FALSE(torch::equal(theirs.recorded, own.recorded));
  for (const bool lora : {false, true}) {
    for (const bool replay : {false, true}) {
      const std::string what = std::string(lora ? "lora" : "full") + (replay ? ", replayed" : "");
      auto model = fp64_model(cfg, lora ? std::vector<std::string>{"all-linear"} : std::vector<std::string>{});
      ExpertRouting plain_routing{replay ? theirs.recorded : torch::Tensor()};
      ExpertRouting checkpointed_routing{replay ? theirs.recorded : torch::Tensor()};
      torch::Tensor plain_lp, checkpointed_lp;
      const auto plain = gradients(*model, ids, targets, kLogitChunkValues, &plain_lp, &plain_routing);
      model->set_activation_checkpointing(true);
      const auto checkpointed =
          gradients(*model, ids, targets, kLogitChunkValues, &checkpointed_lp, &checkpointed_routing);
      expect_same_gradients(plain, checkpointed, plain_lp, checkpointed_lp, what);
      EXPECT_TRUE(torch::equal(checkpointed_routing.recorded, plain_routing.recorded)) << what;
      if (replay) {
        EXPECT_TRUE(torch::equal(plain_routing.recorded, theirs.recorded)) << what;
      }
    }
  }
}

// Checkpointed layers keep one [tokens, hidden] input each instead of every activation of every layer: on a
// model whose MLP is 8x its width, at 2048 tokens, the pass's peak falls to well under half.
TEST(ActivationCheckpointing, HoldsLessThanHalfThePlainGraphsPeak) {
  configure_engine_process({.num_threads = 2});
  ASSERT_NE(installed_caching_cpu_allocator(), nullptr) << "the caching CPU allocator is off (RLLOOP_CPU_CACHE_MB=0)";
  nlohmann::json j = {{"model_type", "qwen3"},       {"vocab_size", 1024},          {"hidden_size", 64},
                      {"intermediate_size", 512},    {"num_hidden_layers", 8},      {"num_attention_heads", 4},
                      {"num_key_value_heads", 2},    {"head_dim", 16},              {"tie_word_embeddings", true},
                      {"max_position_embeddings", 4096}, {"rope_theta", 1000000.0}, {"rms_norm_eps", 1e-6}};
  const ModelConfig cfg = ModelConfig::from_json(j);
  const auto data = batch_of(1, 2048, 1024);
  double peak[2], seconds[2];
  for (const bool checkpointed : {false, true}) {
    CachingCpuAllocator* allocator = installed_caching_cpu_allocator();
    auto model = init_model(cfg, 1, torch::kCPU, torch::kFloat32);
    model->set_activation_checkpointing(checkpointed);
    const std::size_t before = allocator->stats().in_use_bytes;
    allocator->reset_peak();
    const auto start = std::chrono::steady_clock::now();
    run_builtin_loss(*model, data, LossSpec::cross_entropy(), /*backward=*/true);
    seconds[checkpointed] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    peak[checkpointed] = static_cast<double>(allocator->stats().peak_in_use_bytes - before) / (1 << 20);
  }
  // (The seconds are printed for bench/engine/README.md, not checked.)
  std::printf("8 layers, 2048 tokens, peak MiB: plain %.0f, checkpointed %.0f; seconds: plain %.2f, "
              "checkpointed %.2f\n",
              peak[0], peak[1], seconds[0], seconds[1]);
  EXPECT_LT(peak[1], 0.5 * peak[0]);
}

// Counts the backward steps of checkpointed layers while it exists: the autograd engine records each node it runs
// (RecordFunction, scope BACKWARD_FUNCTION) under a name that holds its Function's type.
class CheckpointedLayerBackwards {
 public:
  CheckpointedLayerBackwards() {
    count_ = 0;
    at::enableRecordFunction(true);
    handle_ = at::addGlobalCallback(at::RecordFunctionCallback(&CheckpointedLayerBackwards::on_enter)
                                        .scopes({at::RecordScope::BACKWARD_FUNCTION}));
  }
  ~CheckpointedLayerBackwards() { at::removeCallback(handle_); }
  int value() const { return count_.load(); }

 private:
  static std::unique_ptr<at::ObserverContext> on_enter(const at::RecordFunction& fn) {
    if (std::string_view(fn.name()).find("CheckpointedLayer") != std::string_view::npos) ++count_;
    return nullptr;
  }
  at::CallbackHandle handle_;
  static inline std::atomic<int> count_{0};
};

// The service option reaches the sessions' models (each layer's backward is a checkpointed one), and a
// checkpointed session trains exactly as a plain one.
TEST(ActivationCheckpointing, ASessionWithTheOptionTrainsAsOneWithout) {
  std::vector<std::vector<double>> after;
  std::vector<int> backwards;
  for (const bool checkpointed : {false, true}) {
    LocalServiceOptions service;
    service.device = "cpu";
    service.activation_checkpointing = checkpointed;
    service.checkpoint_dir = (std::filesystem::temp_directory_path() / "rlloop-memory-test-checkpointing").string();
    LocalSession session(SessionOptions{.base_model = "rlloop-tiny", .seed = 3}, service);
    const auto data = batch_of(2, 24, 256);
    for (int step = 0; step < 3; ++step) {
      std::optional<CheckpointedLayerBackwards> counter;
      if (step == 0) counter.emplace();
      session.forward_backward(data, LossSpec::cross_entropy()).get();
      if (counter) backwards.push_back(counter->value());
      session.optim_step(AdamParams{.learning_rate = 1e-2}).get();
    }
    after.push_back(session.forward(data, LossSpec::cross_entropy()).get().logprobs(0));
  }
  EXPECT_EQ(backwards[0], 0);
  EXPECT_EQ(backwards[1], builtin_model("rlloop-tiny")->num_hidden_layers) << "one checkpointed backward per layer";
  ASSERT_EQ(after[0].size(), after[1].size());
  for (std::size_t i = 0; i < after[0].size(); ++i) EXPECT_NEAR(after[0][i], after[1][i], 1e-6) << i;
}
