// Adding an architecture (issue 26, must-show 5): a toy family registered in this one file, with tensor names of
// its own, a config key of its own, a chat format and LoRA target names, runs the whole session API. Its layer is
// Qwen3's (the same flags), so the same weights under Qwen3's names must give the same numbers: a tensor the
// registry mapped wrongly would show there.
#include <gtest/gtest.h>

#include <cmath>

#include <nlohmann/json.hpp>

#include "io/gguf_export.hpp"
#include "model/model_family.hpp"
#include "io/model_io.hpp"
#include "session_util.hpp"
#include "model/transformer.hpp"

namespace {
using namespace rlloop;
using namespace rlloop::engine;
using namespace test_util;
namespace fs = std::filesystem;

// GPT-style names for the dense layer, and a config key of the family's own ("toy_rope_base": the RoPE base).
const ModelFamily& toy_family() {
  static const ModelFamily& registered = []() -> const ModelFamily& {
    ModelFamily f;
    f.model_type = "toy_gpt";
    f.hf_architecture = "ToyGptForCausalLM";
    f.qk_norm = true;  // Qwen3's layer: q/k norms, no attention biases by default, o_proj's bias with them
    f.chat_renderer = "chatml";
    f.names.embed = "transformer.wte";
    f.names.final_norm = "transformer.ln_f";
    f.names.lm_head = "head";
    f.names.layer_prefix = "transformer.h.";
    f.names.input_norm = "ln_1";
    f.names.post_norm = "ln_2";
    f.names.q_norm = "attn.q_ln";
    f.names.k_norm = "attn.k_ln";
    f.names.projections = {"attn.wq", "attn.wk", "attn.wv", "attn.wo", "ffn.w1", "ffn.w3", "ffn.w2"};
    f.read_config = [](const nlohmann::json& j, ModelConfig& c) {
      if (j.contains("toy_rope_base")) c.rope_theta = j.at("toy_rope_base").get<double>();
      if (j.value("toy_parallel_blocks", false))
        throw unsupported("model config: toy_parallel_blocks=true is not supported");
    };
    return register_model_family(std::move(f));
  }();
  return registered;
}

nlohmann::json toy_config_json() {
  return {{"model_type", "toy_gpt"},  {"vocab_size", 256},         {"hidden_size", 64},
          {"intermediate_size", 96},  {"num_hidden_layers", 2},    {"num_attention_heads", 4},
          {"num_key_value_heads", 2}, {"head_dim", 16},            {"max_position_embeddings", 128},
          {"toy_rope_base", 5000.0},  {"attention_bias", true},        {"rlloop_tokenizer", "byte"}};
}

// Every tensor of `from`'s family renamed to `to`'s (the same roles: the registry's names, one by one).
TensorMap renamed(const TensorMap& tensors, const ModelFamily& from, const ModelFamily& to, std::int64_t layers) {
  std::map<std::string, std::string> name;
  for (auto [a, b] : {std::pair{&from.names.embed, &to.names.embed}, {&from.names.final_norm, &to.names.final_norm},
                      {&from.names.lm_head, &to.names.lm_head}})
    name[*a + ".weight"] = *b + ".weight";
  for (std::int64_t i = 0; i < layers; ++i) {
    for (auto [a, b] : {std::pair{&from.names.input_norm, &to.names.input_norm},
                        {&from.names.post_norm, &to.names.post_norm}, {&from.names.q_norm, &to.names.q_norm},
                        {&from.names.k_norm, &to.names.k_norm}})
      name[from.layer_tensor(i, *a) + ".weight"] = to.layer_tensor(i, *b) + ".weight";
    for (Projection p : kProjections)
      for (const char* kind : {".weight", ".bias"})
        name[from.projection_module(i, p) + kind] = to.projection_module(i, p) + kind;
  }
  TensorMap out;
  for (const auto& [n, t] : tensors) out[name.at(n)] = t;
  return out;
}

TEST(ModelFamilyRegistry, AToyFamilyRegisteredInOneFileRunsTheSessionApi) {
  const ModelFamily& toy = toy_family();
  EXPECT_EQ(find_model_family("toy_gpt"), &toy);
  EXPECT_EQ(supported_model_types(), "llama, qwen2, qwen3, qwen3_moe, gpt_oss, mistral, gemma2, toy_gpt");

  // The family's config reader ran: its own key set the RoPE base, and a feature it lacks is refused by name.
  const ModelConfig cfg = ModelConfig::from_json(toy_config_json());
  EXPECT_EQ(cfg.rope_theta, 5000.0);
  EXPECT_TRUE(cfg.qk_norm);
  EXPECT_EQ(cfg.to_json()["architectures"][0], "ToyGptForCausalLM");
  auto parallel = toy_config_json();
  parallel["toy_parallel_blocks"] = true;
  EXPECT_EQ(error_of([&] { ModelConfig::from_json(parallel); }),
            "model config: toy_parallel_blocks=true is not supported");

  // A model directory in the family's names, and the same weights as a Qwen3 directory.
  const fs::path dir = temp_dir("model-family", "toy");
  // Weights far from init_model's (whose logits are nearly uniform): every matrix, bias and norm counts, so a
  // tensor the registry mapped to another role changes the numbers.
  auto model = init_model(cfg, /*seed=*/3, torch::kCPU, torch::kFloat32);
  // init_model finds the norms by role, whatever the family calls them.
  EXPECT_TRUE(torch::equal(model->hf_state_dict().at("transformer.h.0.ln_2.weight"), torch::ones({64})));
  EXPECT_TRUE(torch::equal(model->hf_state_dict().at("transformer.h.0.attn.k_ln.weight"), torch::ones({16})));
  {
    torch::manual_seed(5);
    TensorMap distinct;
    for (const auto& [n, t] : model->hf_state_dict())
      distinct[n] = t.dim() == 1 && !n.ends_with(".bias") ? 1.0 + 0.3 * torch::randn_like(t)  // the norms
                                                          : 0.3 * torch::randn_like(t);
    model->load_hf_state_dict(distinct);
  }
  const TensorMap tensors = model->hf_state_dict();
  EXPECT_TRUE(tensors.count("transformer.h.1.attn.wq.weight"));
  EXPECT_TRUE(tensors.count("transformer.h.0.attn.q_ln.weight"));
  EXPECT_TRUE(tensors.count("head.weight"));
  EXPECT_FALSE(tensors.count("model.embed_tokens.weight"));
  save_model(*model, (dir / "toy").string());
  auto qwen3_json = toy_config_json();
  qwen3_json["model_type"] = "qwen3";
  qwen3_json["rope_theta"] = 5000.0;
  Transformer qwen3(ModelConfig::from_json(qwen3_json));
  qwen3.load_hf_state_dict(renamed(tensors, toy, *find_model_family("qwen3"), cfg.num_hidden_layers));
  save_model(qwen3, (dir / "qwen3").string());

  LocalService svc(service_in((dir / "checkpoints").string()));
  ServiceClient<LocalService> service(svc);
  // LoRA targets are the family's module names; Llama's are refused, naming the family's list.
  EXPECT_EQ(error_of([&] {
              service.create_lora_training_client((dir / "toy").string(),
                                                  {.rank = 4, .alpha = 8, .target_modules = {"q_proj"}});
            }),
            "LoraOptions.target_modules: unknown module 'q_proj' (toy_gpt models have wq, wk, wv, wo, w1, w3, w2, "
            "lm_head, all-linear)");
  auto toy_tc =
      service.create_lora_training_client((dir / "toy").string(),
                                          {.rank = 4, .alpha = 8, .target_modules = {"wq", "w2"}, .seed = 1});
  auto qwen3_tc =
      service.create_lora_training_client((dir / "qwen3").string(), {.rank = 4,
                                                                     .alpha = 8,
                                                                     .target_modules = {"q_proj", "down_proj"},
                                                                     .seed = 1});
  const SessionInfo info = toy_tc.get_info();
  EXPECT_EQ(info.model_type, "toy_gpt");
  EXPECT_EQ(info.chat_renderer, "chatml");
  EXPECT_EQ(info.num_trainable_parameters, qwen3_tc.get_info().num_trainable_parameters);

  // Training: the same losses step by step as the Qwen3 model with the same weights and adapters.
  const std::vector<Datum> batch = {sft_datum("the toy family trains"), sft_datum("one file, its tests")};
  double first = 0, last = 0;
  for (int step = 0; step < 4; ++step) {
    const double a = toy_tc.forward_backward(batch, LossSpec::cross_entropy()).get().metrics.at("loss:sum");
    const double b = qwen3_tc.forward_backward(batch, LossSpec::cross_entropy()).get().metrics.at("loss:sum");
    EXPECT_NEAR(a, b, 1e-5 * std::abs(b)) << "step " << step;
    (step == 0 ? first : last) = a;
    toy_tc.optim_step({.learning_rate = 1e-2}).get();
    qwen3_tc.optim_step({.learning_rate = 1e-2}).get();
  }
  EXPECT_LT(last, first);

  // Sampling: the same tokens, and sampled logprobs equal computed ones.
  const auto prompt = ModelInput::from_tokens(bytes("toy: "));
  const SamplingParams params{.max_tokens = 8, .temperature = 1.0, .seed = 11};
  const auto sampled = toy_tc.live_sampling_client().sample(prompt, 2, params).get();
  const auto reference = qwen3_tc.live_sampling_client().sample(prompt, 2, params).get();
  ASSERT_EQ(sampled.sequences.size(), 2u);
  for (std::size_t s = 0; s < 2; ++s) {
    const auto& seq = sampled.sequences[s];
    EXPECT_EQ(seq.tokens, reference.sequences[s].tokens) << "sample " << s;
    auto full = prompt.tokens();
    full.insert(full.end(), seq.tokens.begin(), seq.tokens.end());
    const auto scored = toy_tc.live_sampling_client().compute_logprobs(ModelInput::from_tokens(full)).get();
    for (std::size_t i = 0; i < seq.tokens.size(); ++i)
      EXPECT_NEAR(seq.logprobs[i], scored[prompt.length() + i], lp_tol()) << "sample " << s << " token " << i;
  }

  // A checkpoint of the toy session restores into a new one with the same numbers.
  const auto saved = toy_tc.save_state("toy-step-4").get();
  const auto before = toy_tc.live_sampling_client().compute_logprobs(prompt).get();
  SessionOptions from_state{.base_model = (dir / "toy").string(),
                            .lora = LoraOptions{4, 8, {"wq", "w2"}}};
  auto restored = service.create_training_client_from_state(saved.path, from_state);
  EXPECT_EQ(restored.live_sampling_client().compute_logprobs(prompt).get(), before);
}

// The family's names reach the adapters' PEFT names and the exports.
TEST(ModelFamilyRegistry, AdaptersAndExportsUseTheFamilysNames) {
  const ModelFamily& toy = toy_family();
  Transformer model(ModelConfig::from_json(toy_config_json()));
  model.enable_lora(LoraOptions{4, 8, {"all-linear", "lm_head"}}, /*seed=*/0);
  const TensorMap adapters = model.peft_state_dict();
  EXPECT_TRUE(adapters.count("base_model.model.transformer.h.0.attn.wq.lora_A.weight"));
  EXPECT_TRUE(adapters.count("base_model.model.transformer.h.1.ffn.w2.lora_B.weight"));
  EXPECT_TRUE(adapters.count("base_model.model.head.lora_A.weight"));
  EXPECT_EQ(adapters.size(), 2u * (2 * kNumProjections + 1));
  const TensorMap merged = model.merged_hf_state_dict();
  EXPECT_TRUE(merged.count("transformer.ln_f.weight"));
  EXPECT_EQ(merged.size(), model.hf_state_dict().size());
  // An lm_head adapter on a tied model: the merged export unties it under the family's unembedding name, and the
  // directory loads back with the same logits.
  auto tied_json = toy_config_json();
  tied_json["tie_word_embeddings"] = true;
  auto tied = init_model(ModelConfig::from_json(tied_json), 4, torch::kCPU, torch::kFloat32);
  tied->enable_lora(LoraOptions{2, 4, {"lm_head"}}, /*seed=*/1);
  {
    torch::NoGradGuard no_grad;
    for (auto& b : tied->lora_b_parameters()) b.uniform_(-0.5, 0.5);
  }
  const fs::path merged_dir = temp_dir("model-family", "tied-merged");
  save_model(*tied, merged_dir.string());
  auto reloaded = load_model(merged_dir.string(), torch::kCPU, torch::kFloat32);
  EXPECT_FALSE(reloaded->config().tie_word_embeddings);
  const torch::Tensor ids = torch::tensor({{5, 6, 7}}, torch::kLong);
  EXPECT_LT((tied->forward(ids) - reloaded->forward(ids)).abs().max().item<double>(), 1e-5);

  // llama.cpp has no such architecture: the GGUF export says so instead of writing a file it cannot load.
  EXPECT_EQ(toy.gguf_architecture, "");
  EXPECT_EQ(error_of([&] { save_gguf_model(model, "/nonexistent/toy.gguf", gguf::TensorType::f32, {}); }),
            "GGUF model export: llama.cpp has no 'toy_gpt' models");
}

}  // namespace

// Gemma 2 through the session API (a random model saved by save_model, byte vocabulary): its parts run in training,
// in the engine loop's sampling (the ATen decoding step: the CPU decoder's kernels decline soft-caps, windows and
// (1 + w) norms) and in compute_logprobs, which must agree token by token; a checkpoint restores the same numbers.
TEST(ModelFamilyRegistry, Gemma2RunsTheSessionApi) {
  const nlohmann::json j = {{"model_type", "gemma2"}, {"vocab_size", 260}, {"hidden_size", 64},
                            {"intermediate_size", 96}, {"num_hidden_layers", 2}, {"num_attention_heads", 4},
                            {"num_key_value_heads", 2}, {"head_dim", 16}, {"max_position_embeddings", 128},
                            {"sliding_window", 4}, {"query_pre_attn_scalar", 12}, {"attn_logit_softcapping", 2.0},
                            {"final_logit_softcapping", 5.0}, {"rlloop_tokenizer", "byte"}};
  const ModelConfig cfg = ModelConfig::from_json(j);
  auto model = init_model(cfg, /*seed=*/4, torch::kCPU, torch::kFloat32);
  EXPECT_TRUE(torch::equal(model->hf_state_dict().at("model.layers.1.post_feedforward_layernorm.weight"),
                           torch::zeros({64})));  // (1 + w) norms start at the identity
  {
    torch::manual_seed(6);
    TensorMap distinct;
    for (const auto& [n, t] : model->hf_state_dict()) distinct[n] = 0.3 * torch::randn_like(t);
    model->load_hf_state_dict(distinct);
  }
  const fs::path dir = temp_dir("model-family", "gemma2");
  save_model(*model, (dir / "gemma2").string());
  LocalService svc(service_in((dir / "checkpoints").string()));
  ServiceClient<LocalService> service(svc);
  auto tc = service.create_lora_training_client((dir / "gemma2").string(), {.rank = 4, .alpha = 8, .seed = 2});
  EXPECT_EQ(tc.get_info().model_type, "gemma2");
  EXPECT_EQ(tc.get_info().chat_renderer, "gemma");

  const std::vector<Datum> batch = {sft_datum("gemma sandwiches its norms"), sft_datum("and caps its logits")};
  double first = 0, last = 0;
  for (int step = 0; step < 4; ++step) {
    (step == 0 ? first : last) = tc.forward_backward(batch, LossSpec::cross_entropy()).get().metrics.at("loss:sum");
    tc.optim_step({.learning_rate = 2e-2}).get();
  }
  EXPECT_LT(last, first);

  // Prompts longer than the window, so that layer 0's window bites in prefill and in every decoding step.
  const auto prompt = ModelInput::from_tokens(bytes("a gemma prompt: "));
  const auto sampled =
      tc.live_sampling_client().sample(prompt, 3, {.max_tokens = 10, .temperature = 1.0, .seed = 7}).get();
  ASSERT_EQ(sampled.sequences.size(), 3u);
  for (std::size_t s = 0; s < sampled.sequences.size(); ++s) {
    const auto& seq = sampled.sequences[s];
    auto full = prompt.tokens();
    full.insert(full.end(), seq.tokens.begin(), seq.tokens.end());
    const auto scored = tc.live_sampling_client().compute_logprobs(ModelInput::from_tokens(full)).get();
    for (std::size_t i = 0; i < seq.tokens.size(); ++i) {
      EXPECT_NEAR(seq.logprobs[i], scored[prompt.length() + i], lp_tol()) << "sample " << s << " token " << i;
      // Every logit lies within the cap (-5, 5), so no token's logprob is below -10 - ln 260.
      EXPECT_GT(seq.logprobs[i], -10.0 - std::log(260.0));
    }
  }

  const auto saved = tc.save_state("gemma2-step-4").get();
  const auto before = tc.live_sampling_client().compute_logprobs(prompt).get();
  auto restored = service.create_training_client_from_state(
      saved.path, {.base_model = (dir / "gemma2").string(), .lora = LoraOptions{4, 8}});
  EXPECT_EQ(restored.live_sampling_client().compute_logprobs(prompt).get(), before);
  fs::remove_all(dir);
}
