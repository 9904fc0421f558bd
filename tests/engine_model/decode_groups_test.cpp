// Transformer::decode_step: several batches of sequences over one base, each with its own cache (so its own
// positions) and its own adapters, stepped together must give what each gives stepped alone through the model's own
// forward with its cache (the path the grouped step replaced for CUDA and bf16 decoding).
#include <gtest/gtest.h>

#include "io/model_io.hpp"
#include "tiny_models.hpp"
#include "model/transformer.hpp"

using namespace rlloop;
using namespace rlloop::engine;
using namespace rlloop::engine::test_models;

namespace {

// Weights far from init_model's, and adapters whose B is not zero, so every product matters.
std::shared_ptr<Transformer> random_base(torch::ScalarType dtype = torch::kFloat32,
                                         const ModelConfig& cfg = tiny_config("qwen3")) {
  auto model = init_model(cfg, 7, torch::kCPU, dtype);
  torch::NoGradGuard no_grad;
  for (auto& p : model->parameters()) p.uniform_(p.dim() == 1 ? 0.7 : -0.4, p.dim() == 1 ? 1.3 : 0.4);
  return model;
}

std::shared_ptr<Transformer> adapted(Transformer& base, const LoraOptions& lora, std::int64_t seed) {
  auto model = Transformer::sharing_base(base);
  model->enable_lora(lora, seed);
  torch::NoGradGuard no_grad;
  for (auto& b : model->lora_b_parameters()) b.uniform_(-0.2, 0.2);
  return model;
}

// One group: a prompt prefilled into a cache of `rows` copies, and the tokens its rows feed next.
struct Group {
  std::shared_ptr<Transformer> model;
  KVCache cache;
  torch::Tensor tokens;
};

Group prefilled(std::shared_ptr<Transformer> model, std::int64_t prompt_length, std::int64_t rows, int seed) {
  torch::manual_seed(seed);
  const ModelConfig& cfg = model->config();
  Group g{std::move(model), {}, torch::randint(cfg.vocab_size, {rows}, torch::kLong)};
  g.cache = KVCache(g.model->kv_pools(), g.model->parameters().front().scalar_type(), 1, prompt_length + 4);
  g.model->hidden_states(torch::randint(cfg.vocab_size, {1, prompt_length}, torch::kLong), &g.cache);
  g.cache.repeat_batch(rows);
  return g;
}

double max_difference(const torch::Tensor& a, const torch::Tensor& b) { return (a - b).abs().max().item<double>(); }

// One decode_step of every group together against each group through its model's forward with a copy of its cache:
// the same logits and the same caches afterwards. Then every row feeds its most likely token next.
void step_together_and_compare(std::vector<Group>& groups, const std::string& what, double tolerance = 1e-5) {
  std::vector<torch::Tensor> alone;
  std::vector<KVCache> alone_caches;
  for (Group& g : groups) {
    alone_caches.push_back(g.cache);  // copy on write: as independent as a deep copy
    alone.push_back(g.model->forward(g.tokens.unsqueeze(1), &alone_caches.back()).squeeze(1));
  }
  std::vector<DecodeGroup> together;
  std::int64_t rows = 0;
  for (Group& g : groups) {
    together.push_back({g.model.get(), &g.tokens, &g.cache});
    rows += g.tokens.size(0);
  }
  const torch::Tensor logits = groups[0].model->decode_step(together);
  ASSERT_EQ(logits.sizes(), (std::vector<std::int64_t>{rows, 64})) << what;
  std::int64_t row = 0;
  for (std::size_t i = 0; i < groups.size(); ++i) {
    const std::int64_t n = groups[i].tokens.size(0);
    EXPECT_LT(max_difference(logits.narrow(0, row, n).to(torch::kFloat32), alone[i].to(torch::kFloat32)), tolerance)
        << what << ", group " << i;
    // Each cache grew by the same position, holding what the model's own forward wrote there.
    const KVCache& c = groups[i].cache;
    ASSERT_EQ(c.length, alone_caches[i].length) << what;
    for (std::size_t l = 0; l < c.layers(); ++l) {
      for (auto [together, own] :
           {std::pair{c.keys(l), alone_caches[i].keys(l)}, {c.values(l), alone_caches[i].values(l)}})
        EXPECT_LT(max_difference(together.to(torch::kFloat32), own.to(torch::kFloat32)), tolerance)
            << what << ", group " << i << ", layer " << l;
    }
    groups[i].tokens = alone[i].argmax(-1);
    row += n;
  }
}

}  // namespace

TEST(DecodeStep, GroupsSteppedTogetherEqualEachSteppedAloneThroughForward) {
  c10::InferenceMode inference;
  auto base = random_base();
  // Three sessions over the base (adapters on every projection and lm_head, on two of them, none), at other
  // positions and with other row counts.
  std::vector<Group> groups;
  groups.push_back(prefilled(adapted(*base, {4, 8, {"all-linear", "lm_head"}}, 1), 5, 1, 1));
  groups.push_back(prefilled(adapted(*base, {2, 4, {"q_proj", "down_proj"}}, 2), 9, 2, 2));
  groups.push_back(prefilled(Transformer::sharing_base(*base), 3, 3, 3));
  for (int step = 0; step < 2; ++step) step_together_and_compare(groups, "step " + std::to_string(step));
  // The adapters change the numbers: the same tokens through the base alone differ.
  Group plain = prefilled(Transformer::sharing_base(*base), 5, 1, 1);
  Group lora = prefilled(adapted(*base, {4, 8, {"all-linear", "lm_head"}}, 1), 5, 1, 1);
  const DecodeGroup one_plain[] = {{plain.model.get(), &plain.tokens, &plain.cache}};
  const DecodeGroup one_lora[] = {{lora.model.get(), &lora.tokens, &lora.cache}};
  EXPECT_GT(max_difference(base->decode_step(one_plain), base->decode_step(one_lora)), 1e-3);
}

// A bf16 model takes the ATen attention of the step (every row's blocks gathered, padded to the longest and masked):
// groups at other lengths (5, 21 and 3 positions: two blocks for one of them) give what each gives alone through
// the model's forward, within bf16's rounding of products batched otherwise (measured: up to 0.047 with LibTorch
// 1.13's operators, 0.039 with 2.x's scaled_dot_product_attention, on logits that spread over several units). It
// also found that a pool's unwritten slots must not reach the masked attention (NaN there made every row NaN).
TEST(DecodeStep, Bf16GroupsGatheredAndMaskedEqualEachAlone) {
  c10::InferenceMode inference;
  auto base = random_base(torch::kBFloat16);
  std::vector<Group> groups;
  groups.push_back(prefilled(adapted(*base, {4, 8, {"all-linear", "lm_head"}}, 1), 5, 1, 1));
  groups.push_back(prefilled(Transformer::sharing_base(*base), 21, 2, 2));
  groups.push_back(prefilled(adapted(*base, {4, 8, {"q_proj", "v_proj"}}, 3), 3, 3, 3));
  for (int step = 0; step < 2; ++step) step_together_and_compare(groups, "step " + std::to_string(step), 0.1);
}

// Gemma 2's parts in the decoding step (attend_groups' ATen attention with a soft-cap, layer 0's window of 3 over
// prompts of 5 and 9 positions, sandwich (1 + w) norms, GeGLU, scaled embeddings, soft-capped logits): groups
// stepped together give what each gives through the model's forward, which matches transformers (tests/hf).
TEST(DecodeStep, Gemma2GroupsSteppedTogetherEqualEachAlone) {
  c10::InferenceMode inference;
  nlohmann::json j = tiny_config("gemma2").to_json();
  j["sliding_window"] = 3;
  j["attn_logit_softcapping"] = 1.0;
  j["final_logit_softcapping"] = 3.0;
  j["query_pre_attn_scalar"] = 12;
  auto base = random_base(torch::kFloat32, ModelConfig::from_json(j));
  std::vector<Group> groups;
  groups.push_back(prefilled(adapted(*base, {4, 8, {"all-linear", "lm_head"}}, 1), 5, 1, 1));
  groups.push_back(prefilled(Transformer::sharing_base(*base), 9, 2, 2));
  for (int step = 0; step < 3; ++step) step_together_and_compare(groups, "step " + std::to_string(step));
  // Every logit lies within the final cap, and these weights' reach where tanh bends (so the cap is at work).
  const double largest = base->forward(torch::randint(64, {1, 6}, torch::kLong)).abs().max().item<double>();
  EXPECT_LT(largest, 3.0);
  EXPECT_GT(largest, 1.5);
}

// Sessions whose adapters share a rank run them as batched products (add_stacked_adapters: rows gathered and padded
// per group): the same numbers as each group alone, with groups of 1, 3 and 2 rows (padding in two of them) and
// other scales.
TEST(DecodeStep, AdaptersOfOneRankBatchedAcrossGroupsEqualEachGroupAlone) {
  c10::InferenceMode inference;
  auto base = random_base();
  std::vector<Group> groups;
  groups.push_back(prefilled(adapted(*base, {4, 8, {"all-linear", "lm_head"}}, 1), 5, 1, 1));
  groups.push_back(prefilled(adapted(*base, {4, 2, {"all-linear", "lm_head"}}, 2), 7, 3, 2));
  groups.push_back(prefilled(adapted(*base, {4, 16, {"all-linear", "lm_head"}}, 3), 2, 2, 3));
  for (int step = 0; step < 2; ++step) step_together_and_compare(groups, "step " + std::to_string(step));
}

TEST(DecodeStep, RefusesAnotherBaseAndCachesThatDoNotFit) {
  c10::InferenceMode inference;
  auto base = random_base();
  auto other = random_base();
  EXPECT_TRUE(base->shares_base(*Transformer::sharing_base(*base)));
  EXPECT_FALSE(base->shares_base(*other));
  Group mine = prefilled(Transformer::sharing_base(*base), 4, 2, 1);
  Group theirs = prefilled(other, 4, 1, 2);
  auto message = [&](std::vector<DecodeGroup> groups) {
    try {
      base->decode_step(groups);
    } catch (const invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  EXPECT_EQ(message({}), "Transformer::decode_step: no groups");
  const DecodeGroup mine_group{mine.model.get(), &mine.tokens, &mine.cache};
  EXPECT_EQ(message({mine_group, {theirs.model.get(), &theirs.tokens, &theirs.cache}}),
            "Transformer::decode_step: a group's model does not share this model's base weights");
  const torch::Tensor three = torch::zeros({3}, torch::kLong);
  EXPECT_EQ(message({{mine.model.get(), &three, &mine.cache}}),
            "Transformer::decode_step: a group's tokens must be [rows] int64, one per cache row or a chunk of a "
            "cache of batch 1, got [3] for a cache of batch 2");
  mine.cache.length = mine.cache.capacity;
  EXPECT_EQ(message({mine_group}), "Transformer::decode_step: KV cache capacity 8 is full");
  // A cache longer than the model's context (its RoPE tables end there).
  Group beyond = prefilled(Transformer::sharing_base(*base), 4, 1, 3);
  beyond.cache = KVCache(beyond.model->kv_pools(), torch::kFloat32, 1, 300);
  beyond.cache.length = 256;
  EXPECT_EQ(message({{beyond.model.get(), &beyond.tokens, &beyond.cache}}),
            "Transformer::decode_step: position 256 is past the model's context (max_position_embeddings 256)");
  ModelConfig one_layer_config = base->config();
  one_layer_config.num_hidden_layers = 1;
  KVCache one_layer = KVCache::allocate(one_layer_config, 2, 8, torch::kCPU, torch::kFloat32);
  EXPECT_EQ(message({{mine.model.get(), &mine.tokens, &one_layer}}),
            "Transformer::decode_step: a group's KV cache has 1 layers of 2 KV heads, the model 2 of 2");
  KVCache none;  // default-constructed: no pool at all
  EXPECT_EQ(message({{mine.model.get(), &mine.tokens, &none}}),
            "Transformer::decode_step: a group's KV cache has 0 layers of 0 KV heads, the model 2 of 2");
  // Caches of one step must share a pool (the model's), so that one step reads them all.
  mine.cache.length = 4;
  KVCache own_pool = KVCache::allocate(base->config(), 1, 8, torch::kCPU, torch::kFloat32);
  base->hidden_states(torch::zeros({1, 4}, torch::kLong), &own_pool);
  const torch::Tensor one = torch::zeros({1}, torch::kLong);
  EXPECT_EQ(message({mine_group, {mine.model.get(), &one, &own_pool}}),
            "Transformer::decode_step: the groups' KV caches must share one block pool (the model's kv_pools() at "
            "one dtype)");
}

// A model with experts: with adapters on attention only, the routed rows of every group go through the base's
// experts together; with adapters on the router or the experts, each group's rows through its own. Either way each
// group gets what it gets alone.
TEST(DecodeStep, ExpertLayersOfGroupsSteppedTogetherEqualEachAlone) {
  c10::InferenceMode inference;
  auto base = random_base(torch::kFloat32, tiny_moe_config());
  std::vector<Group> attention_only;
  attention_only.push_back(prefilled(adapted(*base, {4, 8, {"q_proj", "o_proj", "lm_head"}}, 1), 5, 2, 1));
  attention_only.push_back(prefilled(Transformer::sharing_base(*base), 19, 3, 2));
  for (int step = 0; step < 3; ++step) step_together_and_compare(attention_only, "step " + std::to_string(step));
  std::vector<Group> experts;
  experts.push_back(prefilled(adapted(*base, {4, 8, {"all-linear"}}, 3), 7, 2, 3));
  experts.push_back(prefilled(Transformer::sharing_base(*base), 4, 1, 4));
  experts.push_back(prefilled(adapted(*base, {2, 4, {"down_proj"}}, 5), 11, 2, 5));
  for (int step = 0; step < 3; ++step) step_together_and_compare(experts, "experts, step " + std::to_string(step));
}
