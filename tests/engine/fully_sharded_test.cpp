// Fully sharded data parallelism at the model (issue 46, must-shows 1 and 2 for the model): two ranks in this
// process, each keeping half of every weight, gathering a layer only while it computes, train rlloop-tiny in fp64
// as one rank does over the whole batch: losses, gradient norms, weights and Adam moments after three steps within
// 1e-10, with and without activation checkpointing, full fine-tuning and LoRA adapters over a sharded frozen base;
// each rank holds about half of the weights, gradients and optimizer state; and a sharded model decodes with a KV
// cache (prefill, decode_step) to the logits of the whole model. Each layer's all-gather is started while the layer
// before it computes (prefetch), which changes no value: the same run without it is equal bit for bit.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <thread>

#include <rlloop/error.hpp>

#include "comm/group.hpp"
#include "io/model_io.hpp"
#include "model/builtin_models.hpp"
#include "model/transformer.hpp"
#include "decode_util.hpp"
#include "ranks_util.hpp"
#include "runtime/optimizer.hpp"
#include "session_util.hpp"
#include "tiny_gguf_base.hpp"

using namespace rlloop;
using namespace rlloop::engine;
using test_util::error_of;

namespace {

constexpr int kSteps = 3;
const AdamParams kAdam{.learning_rate = 1e-3, .eps = 1e-3, .weight_decay = 0.01};

std::shared_ptr<Transformer> tiny_fp64() {
  auto model = init_model(*builtin_model("rlloop-tiny"), 7, torch::kCPU, torch::kFloat64);
  torch::NoGradGuard no_grad;  // weights away from init's, so that every layer matters
  // A generator of its own: the ranks build their models on two threads at once.
  auto gen = at::detail::createCPUGenerator(3);
  for (auto& p : model->parameters()) p.add_(0.05 * at::randn(p.sizes(), gen, p.options()));
  return model;
}

// The summed fp64 logprob loss of `ids` predicting `targets` (position-weighted), backward included.
double pass(Transformer& model, const torch::Tensor& ids, const torch::Tensor& targets) {
  ShardedPass gathered(model);
  const torch::Tensor lp = torch::log_softmax(model.logits(model.hidden_states(ids)), -1)
                               .gather(-1, targets.unsqueeze(-1))
                               .squeeze(-1);
  const torch::Tensor loss = -(lp * torch::linspace(0.5, 1.5, lp.size(1), lp.options())).sum();
  loss.backward();
  gathered.reduce_gradients();
  return loss.item<double>();
}

// The sum of the squares of the model's gradients, in fp64 (AdamW::grad_norm sums in fp32).
double squared_gradients(Transformer& model) {
  double sum = 0;
  for (auto& [name, p] : model.named_trainable_parameters())
    if (p.grad().defined()) sum += p.grad().to(torch::kFloat64).pow(2).sum().item<double>();
  return sum;
}

std::vector<NamedParameter> named(Transformer& model) {
  std::vector<NamedParameter> out;
  for (auto& [name, p] : model.named_trainable_parameters()) out.push_back({name, p});
  return out;
}

// Rank r's part of `full` as the shards cut it: flattened, zero-padded to a multiple of W, the r-th of W.
torch::Tensor part_of(const torch::Tensor& full, int r, int W) {
  const std::int64_t n = full.numel(), s = (n + W - 1) / W;
  torch::Tensor padded = torch::zeros({W * s}, full.options());
  padded.narrow(0, 0, n).copy_(full.reshape(-1));
  return padded.narrow(0, r * s, s);
}

struct Run {
  std::vector<double> losses, norms;
  std::map<std::string, torch::Tensor> weights, state;  // after the last step; the sharded runs' are shards
  std::int64_t trainable_elements = 0, full_elements = 0;
  dist::CollectiveStats stats;  // the sharded runs'
};

Run one_rank(const torch::Tensor& ids, const torch::Tensor& targets) {
  auto model = tiny_fp64();
  AdamW opt(named(*model));
  Run run;
  for (int step = 0; step < kSteps; ++step) {
    run.losses.push_back(pass(*model, ids, targets));
    const double norm = std::sqrt(squared_gradients(*model));
    run.norms.push_back(norm);
    opt.step(kAdam, norm);
  }
  for (auto& [name, p] : model->named_trainable_parameters()) {
    run.weights[name] = p.detach().clone();
    run.trainable_elements += p.numel();
  }
  for (auto& [name, t] : opt.state_tensors()) run.state[name] = t;
  return run;
}

Run sharded_rank(dist::Group& g, const torch::Tensor& ids, const torch::Tensor& targets, bool checkpointing) {
  auto model = tiny_fp64();
  model->set_activation_checkpointing(checkpointing);
  model->set_fully_sharded(g);
  AdamW opt(named(*model));
  Run run;
  for (int step = 0; step < kSteps; ++step) {
    double loss = pass(*model, ids, targets);
    // The global norm: every rank's shards' squares summed over the group.
    torch::Tensor sums = torch::tensor({loss, squared_gradients(*model)}, torch::kFloat64);
    g.allreduce_sum(sums);
    run.losses.push_back(sums[0].item<double>());
    run.norms.push_back(std::sqrt(sums[1].item<double>()));
    opt.step(kAdam, run.norms.back());
  }
  for (auto& [name, p] : model->named_trainable_parameters()) {
    run.weights[name] = p.detach().clone();
    run.trainable_elements += p.numel();
  }
  for (auto& p : model->parameters()) run.full_elements += p.numel();
  run.stats = g.stats();
  for (auto& [name, t] : opt.state_tensors()) run.state[name] = t;
  return run;
}

void expect_two_sharded_ranks_equal_one(bool checkpointing) {
  const ModelConfig cfg = *builtin_model("rlloop-tiny");
  torch::manual_seed(4);
  const torch::Tensor ids = torch::randint(0, cfg.vocab_size, {4, 10}, torch::kLong);
  const torch::Tensor targets = torch::randint(0, cfg.vocab_size, {4, 10}, torch::kLong);
  const Run one = one_rank(ids, targets);

  Run ranks[2];
  const auto errors = test_util::on_ranks(2, [&](int r, dist::Group& g) {
    ranks[r] = sharded_rank(g, ids.narrow(0, 2 * r, 2), targets.narrow(0, 2 * r, 2), checkpointing);
  });
  ASSERT_EQ(errors[0], "");
  ASSERT_EQ(errors[1], "");

  for (int step = 0; step < kSteps; ++step) {
    EXPECT_NEAR(ranks[0].losses[step], one.losses[step], 1e-10) << "step " << step;
    EXPECT_NEAR(ranks[0].norms[step], one.norms[step], 1e-10) << "step " << step;
  }
  EXPECT_GT(one.losses[0] - one.losses[kSteps - 1], 0.1);  // the steps train
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(ranks[r].weights.size(), one.weights.size());
    for (const auto& [name, w] : one.weights) {
      ASSERT_TRUE(ranks[r].weights.count(name)) << name;
      EXPECT_LT((ranks[r].weights.at(name) - part_of(w, r, 2)).abs().max().item<double>(), 1e-10)
          << "rank " << r << " " << name;
    }
    ASSERT_EQ(ranks[r].state.size(), one.state.size());
    for (const auto& [name, t] : one.state)
      EXPECT_LT((ranks[r].state.at(name) - part_of(t, r, 2)).abs().max().item<double>(), 1e-10)
          << "rank " << r << " " << name;
    // Memory: the weights this rank keeps (and so its gradients and both moments) are half the model's, give or
    // take the padding; the full tensors are gone (0-element placeholders).
    EXPECT_LE(ranks[r].trainable_elements, one.trainable_elements / 2 + static_cast<std::int64_t>(one.weights.size()));
    EXPECT_LE(static_cast<double>(ranks[r].trainable_elements), 0.55 * static_cast<double>(one.trainable_elements));
    EXPECT_EQ(ranks[r].full_elements, 0);
  }
  // Volume: per step, every weight reduce-scattered once, the root (embedding, final norm) gathered once and each
  // layer twice (its forward, its backward's recompute); W - 1 = 1 shard of each received or sent, fp64.
  std::uint64_t all = 0, layers = 0;
  for (const auto& [name, w] : one.weights) {
    const auto shard_bytes = static_cast<std::uint64_t>((w.numel() + 1) / 2 * 8);
    all += shard_bytes;
    if (name.find(".layers.") != std::string::npos) layers += shard_bytes;
  }
  EXPECT_EQ(ranks[0].stats.reduce_scatter_bytes, kSteps * all);
  EXPECT_EQ(ranks[0].stats.reduce_scatter_sent_bytes, kSteps * all);
  EXPECT_EQ(ranks[0].stats.allgather_bytes, kSteps * (all + layers));
  // Prefetch: every layer's gather but the first in a forward (and the last in a backward) started a layer ahead.
  EXPECT_EQ(ranks[0].stats.allgather_prefetches, kSteps * 2 * static_cast<std::uint64_t>(cfg.num_hidden_layers - 1));
  std::printf("per step and rank: all-gathered %llu bytes, reduce-scattered %llu (model %llu bytes in fp64)\n",
              static_cast<unsigned long long>(ranks[0].stats.allgather_bytes / kSteps),
              static_cast<unsigned long long>(ranks[0].stats.reduce_scatter_bytes / kSteps),
              static_cast<unsigned long long>(one.trainable_elements * 8));
}

// LoRA adapters (every linear and the unembedding) over a frozen base, sharded over `g` (null: one rank, whole).
// The adapters are replicated: their gradients are summed over the ranks before the step, as data parallelism does.
Run lora_rank(dist::Group* g, const torch::Tensor& ids, const torch::Tensor& targets, bool checkpointing) {
  auto base = tiny_fp64();
  for (auto& p : base->parameters()) p.set_requires_grad(false);
  if (g) base->set_fully_sharded(*g);
  auto model = Transformer::sharing_base(*base);
  model->set_activation_checkpointing(checkpointing);
  model->enable_lora(LoraOptions{4, 8, {"all-linear", "lm_head"}}, 5);
  AdamW opt(named(*model));
  Run run;
  for (int step = 0; step < kSteps; ++step) {
    double loss = pass(*model, ids, targets);
    if (g) {
      torch::Tensor l = torch::tensor({loss}, torch::kFloat64);
      g->allreduce_sum(l);
      loss = l.item<double>();
      for (auto& [name, p] : model->named_trainable_parameters()) g->allreduce_sum(p.mutable_grad());
    }
    run.losses.push_back(loss);
    run.norms.push_back(std::sqrt(squared_gradients(*model)));
    opt.step(kAdam, run.norms.back());
  }
  for (auto& [name, p] : model->named_trainable_parameters()) run.weights[name] = p.detach().clone();
  for (auto& [name, t] : opt.state_tensors()) run.state[name] = t;
  if (g) run.stats = g->stats();
  return run;
}

void expect_lora_over_a_sharded_base_equals_one_rank(bool checkpointing) {
  const ModelConfig cfg = *builtin_model("rlloop-tiny");
  torch::manual_seed(4);
  const torch::Tensor ids = torch::randint(0, cfg.vocab_size, {4, 10}, torch::kLong);
  const torch::Tensor targets = torch::randint(0, cfg.vocab_size, {4, 10}, torch::kLong);
  const Run one = lora_rank(nullptr, ids, targets, checkpointing);
  Run ranks[2];
  const auto errors = test_util::on_ranks(2, [&](int r, dist::Group& g) {
    ranks[r] = lora_rank(&g, ids.narrow(0, 2 * r, 2), targets.narrow(0, 2 * r, 2), checkpointing);
  });
  ASSERT_EQ(errors[0], "");
  ASSERT_EQ(errors[1], "");
  for (int step = 0; step < kSteps; ++step) {
    EXPECT_NEAR(ranks[0].losses[step], one.losses[step], 1e-10) << "step " << step;
    EXPECT_NEAR(ranks[0].norms[step], one.norms[step], 1e-10) << "step " << step;
  }
  EXPECT_GT(one.losses[0] - one.losses[kSteps - 1], 0.01);  // the adapters train
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(ranks[r].weights.size(), one.weights.size());
    for (const auto& [name, w] : one.weights)
      EXPECT_LT((ranks[r].weights.at(name) - w).abs().max().item<double>(), 1e-10) << "rank " << r << " " << name;
    for (const auto& [name, t] : one.state)
      EXPECT_LT((ranks[r].state.at(name) - t).abs().max().item<double>(), 1e-10) << "rank " << r << " " << name;
    // The frozen base is gathered (the root once a pass, each layer twice) and reduce-scatters nothing.
    EXPECT_GT(ranks[r].stats.allgather_calls, 0u);
    EXPECT_EQ(ranks[r].stats.reduce_scatter_calls, 0u);
  }
}

// `tiny_fp64`'s model (its base sharded over `g` when given), with trained-looking LoRA adapters when `lora`.
std::shared_ptr<Transformer> decoding_model(dist::Group* g, bool lora) {
  auto model = tiny_fp64();
  if (!lora) {
    if (g) model->set_fully_sharded(*g);
    return model;
  }
  for (auto& p : model->parameters()) p.set_requires_grad(false);
  if (g) model->set_fully_sharded(*g);
  auto adapted = Transformer::sharing_base(*model);
  adapted->enable_lora(LoraOptions{4, 8, {"all-linear", "lm_head"}}, 5);
  torch::NoGradGuard no_grad;
  auto gen = at::detail::createCPUGenerator(9);
  for (auto& b : adapted->lora_b_parameters()) b.copy_(0.05 * at::randn(b.sizes(), gen, b.options()));
  return adapted;  // keeps its base's tensors (and shards) alive
}

void expect_sharded_decoding_equals_one_rank(bool lora) {
  const ModelConfig cfg = *builtin_model("rlloop-tiny");
  torch::manual_seed(6);
  const torch::Tensor prompt = torch::randint(0, cfg.vocab_size, {2, 5}, torch::kLong);
  const auto one = test_util::greedy_decode_logits(*decoding_model(nullptr, lora), prompt, 3);
  std::vector<std::vector<torch::Tensor>> ranks(2);
  const auto errors = test_util::on_ranks(2, [&](int r, dist::Group& g) {
    ranks[r] = test_util::greedy_decode_logits(*decoding_model(&g, lora), prompt, 3);
  });
  ASSERT_EQ(errors[0], "");
  ASSERT_EQ(errors[1], "");
  EXPECT_LT(test_util::max_logit_difference(ranks, one), 1e-10);
}

// Two sharded ranks trained with each layer's gather started a layer ahead and without: the same values bit for bit.
void expect_prefetch_changes_no_value() {
  const ModelConfig cfg = *builtin_model("rlloop-tiny");
  torch::manual_seed(4);
  const torch::Tensor ids = torch::randint(0, cfg.vocab_size, {4, 10}, torch::kLong);
  const torch::Tensor targets = torch::randint(0, cfg.vocab_size, {4, 10}, torch::kLong);
  Run runs[2][2];  // [prefetch off, on][rank]
  for (int prefetch = 0; prefetch < 2; ++prefetch) {
    ::setenv("RLLOOP_SHARD_PREFETCH", prefetch ? "1" : "0", 1);  // read when a model is sharded
    const auto errors = test_util::on_ranks(2, [&](int r, dist::Group& g) {
      runs[prefetch][r] = sharded_rank(g, ids.narrow(0, 2 * r, 2), targets.narrow(0, 2 * r, 2), true);
    });
    ::unsetenv("RLLOOP_SHARD_PREFETCH");
    ASSERT_EQ(errors[0], "");
    ASSERT_EQ(errors[1], "");
  }
  EXPECT_EQ(runs[0][0].stats.allgather_prefetches, 0u);
  EXPECT_GT(runs[1][0].stats.allgather_prefetches, 0u);
  EXPECT_EQ(runs[0][0].stats.allgather_bytes, runs[1][0].stats.allgather_bytes);  // the same gathers, started earlier
  EXPECT_EQ(runs[0][0].losses, runs[1][0].losses);
  EXPECT_EQ(runs[0][0].norms, runs[1][0].norms);
  for (int r = 0; r < 2; ++r)
    for (const auto& [name, w] : runs[0][r].weights) EXPECT_TRUE(torch::equal(runs[1][r].weights.at(name), w)) << name;
}

// A model made sharded (init_sharded_model: built on the meta device, each weight drawn whole and cut, one at a
// time): each rank's shards are exactly its parts of init_model's weights, no whole weight is left on a rank, and
// it decodes (its KV pools and placeholders on the real device) to the whole model's logits.
void expect_a_model_made_sharded_to_hold_the_whole_models_parts() {
  const ModelConfig cfg = *builtin_model("rlloop-tiny");
  auto whole = init_model(cfg, 5, torch::kCPU, torch::kFloat64);
  torch::manual_seed(6);
  const torch::Tensor prompt = torch::randint(0, cfg.vocab_size, {2, 5}, torch::kLong);
  const auto logits = test_util::greedy_decode_logits(*whole, prompt, 3);
  std::map<std::string, torch::Tensor> shards[2];
  std::int64_t whole_elements[2] = {0, 0};
  std::vector<std::vector<torch::Tensor>> decoded(2);
  const auto errors = test_util::on_ranks(2, [&](int r, dist::Group& g) {
    auto model = init_sharded_model(cfg, 5, torch::kCPU, torch::kFloat64, g);
    for (auto& [name, p] : model->named_trainable_parameters()) shards[r][name] = p.detach().clone();
    for (auto& p : model->parameters()) whole_elements[r] += p.numel();
    decoded[r] = test_util::greedy_decode_logits(*model, prompt, 3);
  });
  ASSERT_EQ(errors[0], "");
  ASSERT_EQ(errors[1], "");
  const auto weights = whole->named_trainable_parameters();
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(shards[r].size(), weights.size());
    for (const auto& [name, w] : weights) {
      ASSERT_TRUE(shards[r].count(name)) << name;
      EXPECT_TRUE(torch::equal(shards[r].at(name), part_of(w.detach(), r, 2))) << "rank " << r << " " << name;
    }
    EXPECT_EQ(whole_elements[r], 0);
  }
  EXPECT_LT(test_util::max_logit_difference(decoded, logits), 1e-10);
}

// A model read sharded from `path` (load_sharded_model: each tensor read from its file, this rank's part kept) for
// `use`: the same hash of what was read on both ranks, no whole weight left, shards that train only for full
// fine-tuning and are then exactly the parts of load_model's weights, and the whole model's logits when decoding.
void expect_read_sharded_to_hold_the_parts_of(const std::string& path, ShardedUse use) {
  auto whole = load_model(path, torch::kCPU, torch::kFloat64);
  torch::manual_seed(6);
  const torch::Tensor prompt = torch::randint(0, whole->config().vocab_size, {2, 5}, torch::kLong);
  const auto logits = test_util::greedy_decode_logits(*whole, prompt, 3);
  std::map<std::string, torch::Tensor> shards[2];
  std::uint64_t hashes[2] = {0, 1};
  std::int64_t whole_elements[2] = {0, 0};
  bool trains[2] = {use != ShardedUse::trained, use != ShardedUse::trained};
  std::vector<std::vector<torch::Tensor>> decoded(2);
  const auto errors = test_util::on_ranks(2, [&](int r, dist::Group& g) {
    auto model = load_sharded_model(path, torch::kCPU, torch::kFloat64, g, &hashes[r], use);
    trains[r] = model->trains_shards();
    if (trains[r])
      for (auto& [name, p] : model->named_trainable_parameters()) shards[r][name] = p.detach().clone();
    for (auto& p : model->parameters()) whole_elements[r] += p.numel();
    decoded[r] = test_util::greedy_decode_logits(*model, prompt, 3);
  });
  ASSERT_EQ(errors[0], "");
  ASSERT_EQ(errors[1], "");
  EXPECT_EQ(hashes[0], hashes[1]);
  const auto weights = whole->named_trainable_parameters();
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(trains[r], use == ShardedUse::trained);
    EXPECT_EQ(whole_elements[r], 0);
    if (use != ShardedUse::trained) continue;
    ASSERT_EQ(shards[r].size(), weights.size());
    for (const auto& [name, w] : weights)
      EXPECT_TRUE(torch::equal(shards[r].at(name), part_of(w.detach(), r, 2))) << "rank " << r << " " << name;
  }
  EXPECT_LT(test_util::max_logit_difference(decoded, logits), 1e-10);
}

// A model directory read sharded holds load_model's parts; a file holding a tensor the model has not is refused,
// naming it.
void expect_a_model_read_sharded_to_hold_the_whole_models_parts() {
  const std::string dir = test_util::temp_dir("rlloop-fsdp-read", "tiny").string();
  save_model(*tiny_fp64(), dir);
  expect_read_sharded_to_hold_the_parts_of(dir, ShardedUse::trained);
  TensorMap extra = read_safetensors(dir + "/model.safetensors");
  extra["model.layers.0.mlp.extra.weight"] = torch::zeros({2}, torch::kFloat32);
  write_safetensors(dir + "/model.safetensors", extra);
  const auto refused = test_util::on_ranks(2, [&](int, dist::Group& g) {
    load_sharded_model(dir, torch::kCPU, torch::kFloat64, g);
  });
  EXPECT_NE(refused[0].find("holds tensor 'model.layers.0.mlp.extra.weight', which the model has not"),
            std::string::npos)
      << refused[0];
}

}  // namespace

TEST(FullySharded, AModelReadShardedHoldsTheWholeModelsParts) {
  expect_a_model_read_sharded_to_hold_the_whole_models_parts();
}
// A GGUF file (a Llama, whose q/k rows llama.cpp's converter reorders, with Q8_0 matrices) read sharded, each tensor
// dequantized on its own: for full fine-tuning the parts of the dequantized whole model exactly, and as the frozen
// base of LoRA sessions its logits.
TEST(FullySharded, AGgufBaseReadShardedHoldsTheWholeModelsParts) {
  const std::string path = (test_util::temp_dir("rlloop-fsdp-read", "gguf") / "base.gguf").string();
  test_gguf::save_tiny_base(path, gguf::TensorType::q8_0);
  expect_read_sharded_to_hold_the_parts_of(path, ShardedUse::trained);
  expect_read_sharded_to_hold_the_parts_of(path, ShardedUse::frozen_base);
}
TEST(FullySharded, AModelMadeShardedHoldsTheWholeModelsParts) {
  expect_a_model_made_sharded_to_hold_the_whole_models_parts();
}
TEST(FullySharded, TwoRanksTrainAsOneRank) { expect_two_sharded_ranks_equal_one(false); }
TEST(FullySharded, TwoRanksTrainAsOneRankWithActivationCheckpointing) { expect_two_sharded_ranks_equal_one(true); }

TEST(FullySharded, LoraOverAShardedBaseTrainsAsOneRank) { expect_lora_over_a_sharded_base_equals_one_rank(false); }
TEST(FullySharded, LoraOverAShardedBaseTrainsAsOneRankWithActivationCheckpointing) {
  expect_lora_over_a_sharded_base_equals_one_rank(true);
}
TEST(FullySharded, AShardedModelDecodesAsTheWholeModel) { expect_sharded_decoding_equals_one_rank(false); }
TEST(FullySharded, LoraOverAShardedBaseDecodesAsTheWholeModel) { expect_sharded_decoding_equals_one_rank(true); }

TEST(FullySharded, PrefetchChangesNoValue) { expect_prefetch_changes_no_value(); }

TEST(FullySharded, APrefetchSettingOtherThanZeroOrOneIsRefused) {
  ::setenv("RLLOOP_SHARD_PREFETCH", "yes", 1);
  const auto errors = test_util::on_ranks(2, [&](int, dist::Group& g) { tiny_fp64()->set_fully_sharded(g); });
  ::unsetenv("RLLOOP_SHARD_PREFETCH");
  EXPECT_NE(errors[0].find("RLLOOP_SHARD_PREFETCH must be 0 or 1, got 'yes'"), std::string::npos) << errors[0];
}

TEST(FullySharded, WhatItCannotShardIsRefusedByName) {
  std::unique_ptr<dist::Group> group0 = dist::Group::listen({.rank = 0, .world_size = 2});
  std::thread worker([&] { dist::Group::join({.rank = 1, .world_size = 2, .port = group0->port()}); });
  group0->wait_for_ranks();
  worker.join();  // (only rank 0's group is used: nothing below is a collective)
  auto lora = init_model(*builtin_model("rlloop-tiny"), 7, torch::kCPU, torch::kFloat32);
  lora->enable_lora(LoraOptions{4, 8, {"all-linear"}}, 1);
  EXPECT_EQ(error_of([&] { lora->set_fully_sharded(*group0); }),
            "fully sharded parallelism: a LoRA model is sharded through its base (shard the base before sharing it)");
  auto moe = init_model(*builtin_model("rlloop-tiny-moe"), 7, torch::kCPU, torch::kFloat32);
  EXPECT_EQ(error_of([&] { moe->set_fully_sharded(*group0); }),
            "fully sharded parallelism: Mixture-of-Experts models are not sharded yet");
}
