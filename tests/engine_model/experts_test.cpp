// Mixture-of-experts layers (experts.hpp, the qwen3_moe family): routing as transformers computes it, the grouped
// products against a plain per-token sum (values and gradients), the config keys and their errors, and the
// parameter counts. tests/hf checks whole models against transformers itself.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include <nlohmann/json.hpp>

#include <rlloop/error.hpp>

#include "io/expert_layout.hpp"
#include "model/experts.hpp"
#include "io/model_io.hpp"
#include "tiny_models.hpp"
#include "model/transformer.hpp"

using namespace rlloop;
using namespace rlloop::engine;
using namespace rlloop::engine::test_models;

namespace {

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

Linear random_linear(std::int64_t out, std::int64_t in) {
  Linear l;
  l.weight = (0.3 * torch::randn({out, in})).requires_grad_();
  return l;
}

std::vector<Expert> random_experts(std::int64_t count, std::int64_t hidden, std::int64_t width) {
  std::vector<Expert> experts;
  for (std::int64_t e = 0; e < count; ++e)
    experts.push_back({random_linear(width, hidden), random_linear(width, hidden), random_linear(hidden, width)});
  return experts;
}

}  // namespace

// Softmax over every expert, the two most probable, their probabilities renormalised or not.
TEST(Experts, RoutingTakesTheTopKOfTheSoftmax) {
  const torch::Tensor logits = torch::tensor({{1.0f, 3.0f, 2.0f, 0.0f}, {0.5f, -1.0f, 0.5f, 4.0f}});
  const double z0 = std::exp(1.0) + std::exp(3.0) + std::exp(2.0) + 1.0;
  const Routes plain = route_top_k(logits, 2, /*normalize=*/false, torch::kFloat32);
  EXPECT_EQ(plain.experts[0][0].item<std::int64_t>(), 1);
  EXPECT_EQ(plain.experts[0][1].item<std::int64_t>(), 2);
  EXPECT_EQ(plain.experts[1][0].item<std::int64_t>(), 3);
  EXPECT_NEAR(plain.weights[0][0].item<double>(), std::exp(3.0) / z0, 1e-7);
  EXPECT_NEAR(plain.weights[0][1].item<double>(), std::exp(2.0) / z0, 1e-7);
  const Routes renormalised = route_top_k(logits, 2, /*normalize=*/true, torch::kBFloat16);
  EXPECT_EQ(renormalised.weights.scalar_type(), torch::kBFloat16);
  EXPECT_NEAR(renormalised.weights[0][0].item<double>(), std::exp(3.0) / (std::exp(3.0) + std::exp(2.0)), 4e-3);
  EXPECT_NEAR((renormalised.weights.to(torch::kFloat32).sum(-1) - 1).abs().max().item<double>(), 0.0, 8e-3);

  // gpt-oss: the two largest logits, then a softmax over just those two (plain top-k probabilities would differ).
  const Routes after = route_top_k(logits, 2, false, torch::kFloat32, /*softmax_after_top_k=*/true);
  EXPECT_TRUE(torch::equal(after.experts, plain.experts));
  EXPECT_NEAR(after.weights[0][0].item<double>(), 1.0 / (1.0 + std::exp(-1.0)), 1e-7);
  EXPECT_NEAR(after.weights[1][1].item<double>(), std::exp(0.5) / (std::exp(4.0) + std::exp(0.5)), 1e-7);
  // Replaying a router's own choice gives its weights bit for bit, either way of routing.
  for (const bool softmax_after : {false, true}) {
    const Routes own = route_top_k(logits, 2, true, torch::kFloat32, softmax_after);
    EXPECT_TRUE(torch::equal(route_given(logits, own.experts, true, torch::kFloat32, softmax_after).weights,
                             own.weights));
  }
}

// MXFP4 as OpenAI ships gpt-oss's experts: a byte's low nibble is the first value; codes are FP4 E2M1 (0x2 = 1.0,
// 0xF = -6); each 32 values share 2^(scale - 127).
TEST(Experts, Mxfp4DequantizesTheLowNibbleFirst) {
  torch::Tensor blocks = torch::zeros({1, 2, 16}, torch::kUInt8);
  blocks[0][0][0] = 0x2F;  // values 0, 1: -6 then 1.0
  blocks[0][1][15] = 0x71;  // values 62, 63 (of block 1): 0.5 then 6
  const torch::Tensor scales = torch::tensor({{126, 129}}, torch::kUInt8);  // x 1/2, x 4
  const torch::Tensor values = dequantize_mxfp4(blocks, scales);
  ASSERT_EQ(values.sizes(), (std::vector<std::int64_t>{1, 64}));
  EXPECT_EQ(values[0][0].item<float>(), -3.0f);
  EXPECT_EQ(values[0][1].item<float>(), 0.5f);
  EXPECT_EQ(values[0][62].item<float>(), 2.0f);
  EXPECT_EQ(values[0][63].item<float>(), 24.0f);
  EXPECT_EQ(values.abs().sum().item<float>(), 29.5f);  // every other code is 0
  EXPECT_EQ(error_of([&] { dequantize_mxfp4(blocks.to(torch::kInt32), scales); }),
            "dequantize_mxfp4: blocks and scales must be uint8");
}

// gpt-oss's clamped SwiGLU (ExpertActivation): (clamp(up, -l, l) + 1) * g * sigmoid(alpha g), g = min(gate, l), as
// transformers' GptOssExperts computes it, here with the clamps biting on both sides; one token, one expert of
// width 3 whose gate and up products are the rows of the identity, down the identity, biases 0.
TEST(Experts, ClampedSwigluClampsGateAboveAndUpOnBothSides) {
  Expert e;
  e.gate.weight = torch::eye(3);
  e.up.weight = torch::eye(3);
  e.down.weight = torch::eye(3);
  for (Linear* l : {&e.gate, &e.up, &e.down}) l->bias = torch::zeros({3});
  const torch::Tensor x = torch::tensor({{2.5f, -3.0f, 0.5f}});
  const Routes routes{torch::zeros({1, 1}, torch::kLong), torch::ones({1, 1})};
  const ExpertActivation act{true, 1.0, 1.702};
  const torch::Tensor out = run_experts(x, routes, {e}, nullptr, false, act);
  auto expected = [&](double v) {
    const double g = std::min(v, 1.0), u = std::clamp(v, -1.0, 1.0);
    return (u + 1) * g / (1 + std::exp(-1.702 * g));
  };
  for (int i = 0; i < 3; ++i)
    EXPECT_NEAR(out[0][i].item<double>(), expected(x[0][i].item<double>()), 1e-6) << "column " << i;
}

// The grouped products (rows sorted by expert, one product per expert) equal each token's routes summed one by one,
// and so do the gradients of the input, of every expert's weights and of the router's logits. Expert 4 gets no
// rows at all.
TEST(Experts, GroupedProductsEqualAPerTokenSumWithGradients) {
  torch::manual_seed(3);
  const std::int64_t N = 13, H = 16, I = 8, E = 5, k = 2;
  const torch::Tensor x = torch::randn({N, H}).requires_grad_();
  torch::Tensor logits_in = torch::randn({N, E});
  logits_in.select(1, 4).fill_(-30.0);
  const torch::Tensor logits = logits_in.requires_grad_();
  const std::vector<Expert> experts = random_experts(E, H, I);

  const Routes routes = route_top_k(logits, k, true, torch::kFloat32);
  ASSERT_EQ((routes.experts == 4).sum().item<std::int64_t>(), 0);
  const torch::Tensor grouped = run_experts(x, routes, experts);

  std::vector<torch::Tensor> rows;
  for (std::int64_t n = 0; n < N; ++n) {
    torch::Tensor sum = torch::zeros({H});
    for (std::int64_t j = 0; j < k; ++j) {
      const Expert& e = experts[static_cast<std::size_t>(routes.experts[n][j].item<std::int64_t>())];
      const torch::Tensor row = x[n].unsqueeze(0);
      const torch::Tensor out = e.down.apply(torch::silu(e.gate.apply(row)) * e.up.apply(row))[0];
      sum = sum + routes.weights[n][j] * out;
    }
    rows.push_back(sum);
  }
  const torch::Tensor reference = torch::stack(rows);
  EXPECT_LT((grouped - reference).abs().max().item<double>(), 1e-6);

  const torch::Tensor upstream = torch::randn({N, H});
  std::vector<torch::Tensor> inputs = {x, logits};
  for (const Expert& e : experts)
    for (const Linear* l : {&e.gate, &e.up, &e.down}) inputs.push_back(l->weight);
  const auto want = torch::autograd::grad({(reference * upstream).sum()}, inputs, {}, true, false, true);
  const auto got = torch::autograd::grad({(grouped * upstream).sum()}, inputs, {}, true, false, true);
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const torch::Tensor expected = want[i].defined() ? want[i] : torch::zeros_like(inputs[i]);
    const torch::Tensor actual = got[i].defined() ? got[i] : torch::zeros_like(inputs[i]);
    EXPECT_LT((actual - expected).abs().max().item<double>(), 1e-5) << "gradient of input " << i;
  }
  // The unused expert gets no gradient; the router's logits do.
  EXPECT_EQ(got[2 + 3 * 4].defined() ? got[2 + 3 * 4].abs().max().item<double>() : 0.0, 0.0);
  EXPECT_GT(got[1].abs().max().item<double>(), 1e-3);
}

// A decoding step's experts on the CPU (the routes grouped on the host, every expert's products in two parallel
// regions of the few-row kernel) equal the grouped ATen products, for one row and for a step's worth.
TEST(Experts, TheDecodingStepsCpuKernelsEqualTheAtenProducts) {
  torch::NoGradGuard no_grad;
  torch::manual_seed(4);
  const std::int64_t H = 32, I = 24, E = 6;
  const std::vector<Expert> experts = random_experts(E, H, I);
  for (std::int64_t N : {1, 5, 16}) {
    const torch::Tensor x = torch::randn({N, H});
    torch::Tensor logits = torch::randn({N, E});
    logits.select(1, 2).fill_(-30.0);  // expert 2 gets no rows
    const Routes routes = route_top_k(logits, 2, false, torch::kFloat32);
    const torch::Tensor aten = run_experts(x, routes, experts, nullptr, /*few_rows=*/false);
    const torch::Tensor step = run_experts(x, routes, experts, nullptr, /*few_rows=*/true);
    EXPECT_LT((step - aten).abs().max().item<double>(), 1e-5 * aten.abs().max().item<double>()) << N << " rows";
  }
}

TEST(Experts, ConfigKeysRoundTripAndBadValuesAreRefusedByName) {
  const ModelConfig cfg = tiny_moe_config();
  EXPECT_EQ(cfg.num_experts, 6);
  EXPECT_TRUE(cfg.sparse_layer(0) && cfg.sparse_layer(1));
  const nlohmann::json j = cfg.to_json();
  EXPECT_EQ(j["architectures"][0], "Qwen3MoeForCausalLM");
  const ModelConfig again = ModelConfig::from_json(j);
  EXPECT_EQ(again.to_json(), j);

  // transformers 5 writes num_local_experts; layer 0 kept dense; every second layer sparse.
  nlohmann::json hf5 = j;
  hf5.erase("num_experts");
  hf5["num_local_experts"] = 4;
  hf5["mlp_only_layers"] = {0};
  EXPECT_EQ(ModelConfig::from_json(hf5).num_experts, 4);
  EXPECT_FALSE(ModelConfig::from_json(hf5).sparse_layer(0));
  EXPECT_TRUE(ModelConfig::from_json(hf5).sparse_layer(1));
  nlohmann::json step = j;
  step["decoder_sparse_step"] = 2;
  EXPECT_FALSE(ModelConfig::from_json(step).sparse_layer(0));
  EXPECT_TRUE(ModelConfig::from_json(step).sparse_layer(1));

  auto refused = [&](const char* key, const nlohmann::json& value) {
    nlohmann::json bad = j;
    if (value.is_null())
      bad.erase(key);
    else
      bad[key] = value;
    return error_of([&] { ModelConfig::from_json(bad); });
  };
  EXPECT_EQ(refused("num_experts_per_tok", 7),
            "model config: num_experts_per_tok must be in [1, num_experts = 6], got 7");
  EXPECT_EQ(refused("moe_intermediate_size", nullptr), "model config: missing required field 'moe_intermediate_size'");
  EXPECT_EQ(refused("mlp_only_layers", {5}), "model config: mlp_only_layers names layer 5 of 2");
  EXPECT_EQ(refused("num_local_experts", 8),
            "model config: num_experts 6 and num_local_experts 8 disagree; remove one of them");
  EXPECT_EQ(refused("shared_expert_intermediate_size", 32),
            "model config: shared experts (shared_expert_intermediate_size) are not supported");
  nlohmann::json dense = j;
  dense["model_type"] = "qwen3";
  ModelConfig with_experts = ModelConfig::from_json(dense);
  with_experts.num_experts = 4;
  EXPECT_EQ(error_of([&] { with_experts.validate(); }),
            "model config: model_type qwen3 has no experts (num_experts 4)");
}

// num_parameters counts what the model holds; active_parameters leaves out the experts a token is not routed to.
TEST(Experts, ParameterCountsMatchTheModel) {
  const ModelConfig cfg = tiny_moe_config();
  Transformer model(cfg);
  std::int64_t held = 0;
  for (const auto& [name, t] : model.hf_state_dict()) held += t.numel();
  EXPECT_EQ(cfg.num_parameters(), held);
  EXPECT_TRUE(model.hf_state_dict().count("model.layers.1.mlp.experts.5.down_proj.weight"));
  EXPECT_TRUE(model.hf_state_dict().count("model.layers.0.mlp.gate.weight"));
  EXPECT_FALSE(model.hf_state_dict().count("model.layers.0.mlp.gate_proj.weight"));
  const std::int64_t unrouted = 2 * (6 - 2) * 3 * 32 * 24;  // layers x experts not taken x gate/up/down x H x width
  EXPECT_EQ(cfg.active_parameters(), held - unrouted);
}

// LoRA on a model with experts takes PEFT's layout: the MLP's names adapt the experts' stacked weights (gate and up
// together, as one adapter of twice the rank), "gate" the router, all-linear all of them with attention. Gate without
// up is refused; the merged weights give the adapted model's logits.
TEST(Experts, LoraAdaptsTheExpertsInPeftsLayout) {
  {
    Transformer model(tiny_moe_config());
    EXPECT_EQ(error_of([&] { model.enable_lora({4, 8, {"q_proj", "gate_proj"}}, 1); }),
              "LoraOptions.target_modules: 'gate_proj' needs 'up_proj' too on qwen3_moe models: the experts' gate and "
              "up projections are one stacked weight, adapted as one");
    EXPECT_FALSE(model.has_lora());
  }
  torch::manual_seed(1);
  auto model = init_model(tiny_moe_config(), 3, torch::kCPU, torch::kFloat32);
  {
    torch::NoGradGuard no_grad;
    for (auto& p : model->parameters()) p.uniform_(p.dim() == 1 ? 0.7 : -0.4, p.dim() == 1 ? 1.3 : 0.4);
  }
  const torch::Tensor ids = torch::randint(64, {2, 9}, torch::kLong);
  const torch::Tensor base = model->forward(ids).detach();
  model->enable_lora({4, 8, {"all-linear"}}, 1);
  const TensorMap adapters = model->peft_state_dict();
  const std::string experts = "base_model.model.model.layers.1.mlp.experts.";
  EXPECT_EQ(adapters.at(experts + "base_layer.lora_A.weight").sizes(), (std::vector<std::int64_t>{6 * 8, 32}));
  EXPECT_EQ(adapters.at(experts + "base_layer.lora_B.weight").sizes(), (std::vector<std::int64_t>{2 * 24, 6 * 8}));
  EXPECT_EQ(adapters.at(experts + "lora_A.weight").sizes(), (std::vector<std::int64_t>{6 * 4, 24}));
  EXPECT_EQ(adapters.at(experts + "lora_B.weight").sizes(), (std::vector<std::int64_t>{32, 6 * 4}));
  EXPECT_EQ(adapters.at("base_model.model.model.layers.0.mlp.gate.lora_B.weight").sizes(),
            (std::vector<std::int64_t>{6, 4}));
  EXPECT_EQ(adapters.size(), 2u * 2 * (4 + 1 + 2));  // layers x (A, B) x (q, k, v, o, router, gate_up, down)
  EXPECT_EQ(model->lora_b_parameters().size(), 2u * (4 + 1 + 2));
  // B = 0: the adapted model is the base; with B drawn, the experts' adapters move the logits, and the merged weights
  // reproduce them.
  EXPECT_TRUE(torch::equal(model->forward(ids).detach(), base));
  {
    torch::NoGradGuard no_grad;
    for (auto& b : model->lora_b_parameters()) b.uniform_(-0.3, 0.3);
  }
  const torch::Tensor adapted = model->forward(ids).detach();
  EXPECT_GT((adapted - base).abs().max().item<double>(), 0.1);
  Transformer merged(tiny_moe_config());
  merged.load_hf_state_dict(model->merged_hf_state_dict());
  EXPECT_LT((merged.forward(ids) - adapted).abs().max().item<double>(), 1e-5);
  // Only the experts' down adapters: the one wrapper's tensors are not under base_layer.
  Transformer down_only(tiny_moe_config());
  down_only.enable_lora({4, 8, {"down_proj"}}, 1);
  EXPECT_EQ(down_only.peft_state_dict().count(experts + "lora_A.weight"), 1u);
  EXPECT_EQ(down_only.peft_state_dict().size(), 2u * 2);
}

// Routing replay (issue 27, must-show 2): routes recorded from one forward, given to a forward after an update that
// flips some of them, make it route exactly as the first did; without them it routes otherwise. With the model
// unchanged, replaying its own routes changes nothing, bit for bit. Bad routes are refused by name.
TEST(Experts, ReplayedRoutesReproduceTheRecordedOnesAfterAnUpdate) {
  torch::NoGradGuard no_grad;
  auto model = init_model(tiny_moe_config(), 5, torch::kCPU, torch::kFloat32);
  for (auto& p : model->parameters()) p.uniform_(p.dim() == 1 ? 0.7 : -0.4, p.dim() == 1 ? 1.3 : 0.4);
  torch::manual_seed(6);
  const torch::Tensor ids = torch::randint(64, {2, 12}, torch::kLong);

  ExpertRouting sampled;  // as the sampler's weights routed
  const torch::Tensor before = model->hidden_states(ids, nullptr, &sampled);
  ASSERT_EQ(sampled.recorded.sizes(), (std::vector<std::int64_t>{24, 2, 2}));
  ExpertRouting same{sampled.recorded.clone(), {}};
  EXPECT_TRUE(torch::equal(model->hidden_states(ids, nullptr, &same), before));
  EXPECT_TRUE(torch::equal(same.recorded, sampled.recorded));

  // An update of the routers (as an optimizer step moves them) flips some routes.
  for (auto& [name, t] : model->named_trainable_parameters())
    if (name.ends_with("mlp.gate.weight")) t.add_(0.3 * torch::randn_like(t));
  ExpertRouting fresh;
  model->hidden_states(ids, nullptr, &fresh);
  const auto flipped = (fresh.recorded != sampled.recorded).sum().item<std::int64_t>();
  EXPECT_GT(flipped, 0);
  ExpertRouting replayed{sampled.recorded.clone(), {}};
  const torch::Tensor with_replay = model->hidden_states(ids, nullptr, &replayed);
  EXPECT_TRUE(torch::equal(replayed.recorded, sampled.recorded));
  EXPECT_GT((with_replay - model->hidden_states(ids)).abs().max().item<double>(), 1e-4);

  ExpertRouting short_routes{sampled.recorded.narrow(0, 0, 23).clone(), {}};
  EXPECT_EQ(error_of([&] { model->hidden_states(ids, nullptr, &short_routes); }),
            "Transformer::hidden_states: routing replay: the routes must be an int64 [tokens, sparse layers, experts "
            "per token] = [24, 2, 2] tensor, got Long [23, 2, 2]");
  ExpertRouting bad_id{sampled.recorded.clone(), {}};
  bad_id.replay[3][1][0] = 6;
  EXPECT_EQ(error_of([&] { model->hidden_states(ids, nullptr, &bad_id); }),
            "Transformer::hidden_states: routing replay: expert id 6 is outside [0, 6)");
  Transformer dense(tiny_config("qwen3"));
  ExpertRouting none;
  EXPECT_EQ(error_of([&] { dense.hidden_states(ids, nullptr, &none); }),
            "Transformer::hidden_states: routing replay: this qwen3 model has no experts");
}
