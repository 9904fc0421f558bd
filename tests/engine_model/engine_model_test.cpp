// Tests for the model half of the engine: config parsing, the transformer against golden logits from an
// independent PyTorch implementation (make_golden.py), KV-cache consistency, safetensors and model/PEFT
// directories, LoRA, and the sampler.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "model/builtin_models.hpp"
#include "model/model_config.hpp"
#include "io/model_io.hpp"
#include "runtime/sampler.hpp"
#include "test_device.hpp"
#include "tiny_models.hpp"
#include "model/transformer.hpp"

namespace fs = std::filesystem;
using nlohmann::json;
using namespace rlloop;
using namespace rlloop::engine;
using namespace rlloop::engine::test_models;

namespace {

// ------------------------------------------------------------------------------------------- helpers

// Same generator as make_golden.py: element i of tensor `name` = offset + 0.25 * (2u - 1) with u the top
// 24 bits of splitmix64(fnv1a64(name) ^ i); offset 1 for norm weights. Exact in double on both sides.
std::uint64_t splitmix64(std::uint64_t x) {
  std::uint64_t z = x + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
std::uint64_t fnv1a64(const std::string& s) {
  std::uint64_t h = 0xCBF29CE484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001B3ull;
  return h;
}
torch::Tensor hashed_weight(const std::string& name, at::IntArrayRef shape) {
  const std::uint64_t salt = fnv1a64(name);
  const double offset = name.size() >= 11 && name.compare(name.size() - 11, 11, "norm.weight") == 0 ? 1.0 : 0.0;
  auto t = torch::empty(shape, torch::kFloat32);
  float* p = t.data_ptr<float>();
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    const double u = static_cast<double>(splitmix64(salt ^ static_cast<std::uint64_t>(i)) >> 40) / double(1 << 24);
    p[i] = static_cast<float>(offset + 0.25 * (2.0 * u - 1.0));
  }
  return t;
}

json golden() {
  std::ifstream in(test_device::source_dir() + "/tests/engine_model/golden_logits.json");
  return json::parse(in);
}

torch::Tensor ids_of(const std::vector<std::int64_t>& v) { return torch::tensor(v, torch::kLong).unsqueeze(0); }

double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) { return (a - b).abs().max().item<double>(); }

// A fresh directory under the system temp dir, removed when the test ends.
struct TempDir {
  fs::path path;
  TempDir() {
    static std::atomic<int> counter{0};
    path = fs::temp_directory_path() /
           ("rlloop_engine_model_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string operator/(const std::string& name) const { return (path / name).string(); }
};

template <class E, class F>
std::string error_message(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("WRONG EXCEPTION TYPE: ") + e.what();
  }
  return "NO EXCEPTION";
}

bool state_dicts_equal(const TensorMap& a, const TensorMap& b) {
  if (a.size() != b.size()) return false;
  for (const auto& [name, t] : a) {
    auto it = b.find(name);
    if (it == b.end() || t.scalar_type() != it->second.scalar_type() || !torch::equal(t, it->second)) return false;
  }
  return true;
}

// ---------------------------------------------------------------------------------------- ModelConfig

TEST(ModelConfig, FamilyDefaultsAndExtensions) {
  auto qwen2 = tiny_config("qwen2");
  EXPECT_TRUE(qwen2.attention_bias);
  EXPECT_FALSE(qwen2.o_proj_bias());
  EXPECT_FALSE(qwen2.qk_norm);
  EXPECT_EQ(qwen2.head_dim, 8);

  json j = tiny_config("qwen3").to_json();
  j["head_dim"] = 16;
  j["rlloop_tokenizer"] = "byte";
  j["eos_token_id"] = json::array({5, 6});
  auto qwen3 = ModelConfig::from_json(j);
  EXPECT_TRUE(qwen3.qk_norm);
  EXPECT_FALSE(qwen3.attention_bias);
  EXPECT_EQ(qwen3.head_dim, 16);
  EXPECT_EQ(qwen3.tokenizer, "byte");
  EXPECT_EQ(qwen3.eos_token_id, 5);

  auto llama = tiny_config("llama");
  EXPECT_FALSE(llama.attention_bias);
  EXPECT_EQ(llama.num_key_value_heads, 2);

  // to_json -> from_json is the identity on every field we use.
  auto back = ModelConfig::from_json(qwen3.to_json());
  EXPECT_EQ(back.to_json(), qwen3.to_json());
  EXPECT_EQ(back.tokenizer, "byte");
}

// Mistral's config: a sliding_window makes every layer slide (v0.1), null or none leaves them all full (v0.2 on),
// and it goes back to config.json as it came; a window that is no positive integer is refused by name.
TEST(ModelFamily, MistralSlidesEveryLayerWhenItsConfigHasAWindow) {
  json j = tiny_config("mistral").to_json();
  EXPECT_EQ(j["architectures"][0], "MistralForCausalLM");
  EXPECT_TRUE(j["sliding_window"].is_null());
  EXPECT_EQ(ModelConfig::from_json(j).attention_window(1), 0);
  j["sliding_window"] = 5;
  const ModelConfig sliding = ModelConfig::from_json(j);
  EXPECT_EQ(sliding.layer_types, (std::vector<std::string>{"sliding_attention", "sliding_attention"}));
  EXPECT_EQ(sliding.attention_window(0), 5);
  EXPECT_EQ(sliding.attention_window(1), 5);
  EXPECT_EQ(ModelConfig::from_json(sliding.to_json()).to_json(), sliding.to_json());
  EXPECT_EQ(sliding.to_json()["sliding_window"], 5);
  j["sliding_window"] = 0;
  EXPECT_EQ(error_message<invalid_argument>([&] { ModelConfig::from_json(j); }),
            "model config: mistral's sliding_window must be positive, got 0");
  j["sliding_window"] = "4096";
  EXPECT_EQ(error_message<invalid_argument>([&] { ModelConfig::from_json(j); }),
            "model config: mistral's sliding_window must be an integer or null, got \"4096\"");
  EXPECT_EQ(find_model_family("mistral")->chat_renderer, "llama2");
}

// Gemma 2's config: the keys transformers' Gemma2Config defaults when a config.json lacks them (tied embeddings,
// GeGLU, scale 256^-1/2, soft-caps 50 and 30, every other layer sliding over 4096 positions), null caps and windows
// meaning none; what it reads goes back to config.json as it came; a cap that is no positive number is refused by name.
TEST(ModelFamily, Gemma2ReadsItsKeysWithTransformersDefaults) {
  json j = tiny_config("gemma2").to_json();
  EXPECT_EQ(j["architectures"][0], "Gemma2ForCausalLM");
  for (const char* key : {"tie_word_embeddings", "hidden_act", "query_pre_attn_scalar", "attn_logit_softcapping",
                          "final_logit_softcapping", "sliding_window", "layer_types", "hidden_activation"})
    j.erase(key);
  const ModelConfig defaults = ModelConfig::from_json(j);
  EXPECT_TRUE(defaults.tie_word_embeddings && defaults.sandwich_norms && defaults.norm_adds_one);
  EXPECT_EQ(defaults.hidden_activation, ModelConfig::Activation::gelu_tanh);
  EXPECT_DOUBLE_EQ(defaults.attention_scale(), 1.0 / 16);
  EXPECT_DOUBLE_EQ(defaults.embedding_multiplier(), std::sqrt(32.0));
  EXPECT_EQ(defaults.attn_logit_softcapping, 50.0);
  EXPECT_EQ(defaults.final_logit_softcapping, 30.0);
  EXPECT_EQ(defaults.layer_types, (std::vector<std::string>{"sliding_attention", "full_attention"}));
  EXPECT_EQ(defaults.attention_window(0), 4096);
  EXPECT_EQ(defaults.attention_window(1), 0);
  const json back = defaults.to_json();
  EXPECT_EQ(back["hidden_activation"], "gelu_pytorch_tanh");
  EXPECT_EQ(back["query_pre_attn_scalar"], 256);
  EXPECT_EQ(ModelConfig::from_json(back).to_json(), back);
  // Sandwich norms: four per layer.
  EXPECT_EQ(defaults.num_parameters() - tiny_config("gemma2", true).num_parameters(), 0);
  EXPECT_EQ(tiny_config("gemma2", true).num_parameters() - tiny_config("llama", true).num_parameters(), 2 * 2 * 32);

  j["attn_logit_softcapping"] = nullptr;
  j["final_logit_softcapping"] = nullptr;
  j["sliding_window"] = nullptr;
  const ModelConfig none = ModelConfig::from_json(j);
  EXPECT_EQ(none.attn_logit_softcapping, 0.0);
  EXPECT_EQ(none.final_logit_softcapping, 0.0);
  EXPECT_TRUE(none.layer_types.empty());
  EXPECT_TRUE(none.to_json()["attn_logit_softcapping"].is_null());
  j["attn_logit_softcapping"] = -1;
  EXPECT_EQ(error_message<invalid_argument>([&] { ModelConfig::from_json(j); }),
            "model config: gemma2's attn_logit_softcapping must be a positive number or null, got -1");
  j["attn_logit_softcapping"] = 50;
  j["hidden_activation"] = "relu";
  EXPECT_EQ(error_message<unsupported>([&] { ModelConfig::from_json(j); }),
            "model config: hidden_activation 'relu' is not supported (silu, gelu_pytorch_tanh)");
  EXPECT_EQ(find_model_family("gemma2")->chat_renderer, "gemma");
}

// The families the engine runs (model_family.hpp): each model_type's entry, the names derived from it, the list
// errors name, and a config of another model_type refused by that list.
TEST(ModelFamily, EachFamilyHasItsEntryAndOthersAreRefusedByName) {
  EXPECT_EQ(supported_model_types(), "llama, qwen2, qwen3, qwen3_moe, gpt_oss, mistral, gemma2");
  ASSERT_EQ(model_families().size(), 7u);
  for (const ModelFamily* f : model_families()) {
    EXPECT_EQ(find_model_family(f->model_type), f);
    // Mistral's GGUF files are llama's (the family names no GGUF architecture of its own).
    EXPECT_EQ(find_gguf_family(f->gguf_architecture), f->gguf_architecture.empty() ? nullptr : f);
    const ModelConfig tiny = f->model_type == "gpt_oss" ? *builtin_model("rlloop-tiny-gpt-oss")
                             : f->experts              ? tiny_moe_config()
                                                       : tiny_config(f->model_type);
    EXPECT_EQ(tiny.to_json()["architectures"][0], f->hf_architecture);
    EXPECT_EQ(f->projection_module(3, Projection::q), "model.layers.3.self_attn.q_proj");
    EXPECT_EQ(f->projection_module(0, Projection::down), "model.layers.0.mlp.down_proj");
    // (Gemma 2's post_attention_layernorm is its attention output's sandwich norm.)
    EXPECT_EQ(f->layer_tensor(1, f->sandwich_norms ? f->names.attn_out_norm : f->names.post_norm),
              "model.layers.1.post_attention_layernorm");
    std::vector<std::string> targets = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
    if (f->experts) targets.push_back(f->router_target_module());  // "gate" (Qwen-MoE), "router" (gpt-oss)
    targets.insert(targets.end(), {"lm_head", "all-linear"});
    EXPECT_EQ(f->lora_target_modules(), targets);
  }
  EXPECT_TRUE(find_model_family("llama")->gguf_reorders_qk);
  EXPECT_FALSE(find_model_family("qwen2")->o_proj_bias);
  EXPECT_TRUE(find_model_family("qwen3")->qk_norm);
  EXPECT_EQ(find_model_family("llama")->chat_renderer, "llama3");
  EXPECT_EQ(find_model_family("qwen2")->chat_renderer, "chatml");
  EXPECT_EQ(find_model_family("qwen3")->chat_renderer, "qwen3_no_thinking");
  EXPECT_TRUE(find_model_family("qwen3_moe")->experts && find_model_family("qwen3_moe")->qk_norm);
  EXPECT_EQ(find_model_family("qwen3_moe")->expert_module(2, 5, Projection::up),
            "model.layers.2.mlp.experts.5.up_proj");
  const ModelFamily& gpt_oss = *find_model_family("gpt_oss");
  EXPECT_TRUE(gpt_oss.attention_sinks && gpt_oss.expert_style.stacked_interleaved &&
              gpt_oss.expert_style.softmax_after_top_k && gpt_oss.expert_style.clamped_swiglu);
  EXPECT_EQ(gpt_oss.router_target_module(), "router");
  EXPECT_EQ(gpt_oss.layer_tensor(0, gpt_oss.names.sinks), "model.layers.0.self_attn.sinks");
  EXPECT_EQ(find_model_family("mixtral"), nullptr);
  EXPECT_EQ(find_gguf_family(""), nullptr);
  json j = tiny_config("llama").to_json();
  j["model_type"] = "mixtral";
  EXPECT_EQ(error_message<invalid_argument>([&] { ModelConfig::from_json(j); }),
            "model config: unsupported model_type 'mixtral' (supported: llama, qwen2, qwen3, qwen3_moe, gpt_oss, "
            "mistral, gemma2)");
  // A second entry for a registered model_type, and one whose projections share a module name, are refused.
  ModelFamily again = *find_model_family("qwen2");
  EXPECT_EQ(error_message<invalid_argument>([&] { register_model_family(again); }),
            "register_model_family('qwen2'): the model_type is registered already");
  again.model_type = "qwen2_twice";
  EXPECT_EQ(error_message<invalid_argument>([&] { register_model_family(again); }),
            "register_model_family('qwen2_twice'): GGUF architecture 'qwen2' is qwen2's");
  again.gguf_architecture.clear();
  again.names.post_norm = again.names.input_norm;
  EXPECT_EQ(error_message<invalid_argument>([&] { register_model_family(again); }),
            "register_model_family('qwen2_twice'): layer tensor name 'input_layernorm' is empty or used twice");
  again.names.post_norm = "post_attention_layernorm";
  // Sandwich norms need names of their own.
  again.sandwich_norms = true;
  EXPECT_EQ(error_message<invalid_argument>([&] { register_model_family(again); }),
            "register_model_family('qwen2_twice'): layer tensor name '' is empty or used twice");
  again.names.attn_out_norm = "post_attention_layernorm";
  again.names.mlp_out_norm = "post_mlp_layernorm";
  EXPECT_EQ(error_message<invalid_argument>([&] { register_model_family(again); }),
            "register_model_family('qwen2_twice'): layer tensor name 'post_attention_layernorm' is empty or used "
            "twice");
  again.sandwich_norms = false;
  again.names.projections[2] = "self_attn.";
  EXPECT_EQ(error_message<invalid_argument>([&] { register_model_family(again); }),
            "register_model_family('qwen2_twice'): projection path 'self_attn.' is empty, ends in '.' or is used "
            "twice");
  again.names.projections[2] = "self_attn.v_proj";
  again.names.projections[1] = "attn.q_proj";
  EXPECT_EQ(error_message<invalid_argument>([&] { register_model_family(again); }),
            "register_model_family('qwen2_twice'): projection module 'q_proj' is used twice or reserved (lm_head, "
            "all-linear)");
  EXPECT_EQ(model_families().size(), 7u);
}

TEST(ModelConfig, ValidationNamesTheField) {
  json j = tiny_config("llama").to_json();
  j.erase("hidden_size");
  EXPECT_NE(error_message<invalid_argument>([&] { ModelConfig::from_json(j); }).find("hidden_size"), std::string::npos);

  j = tiny_config("llama").to_json();
  j["num_key_value_heads"] = 3;
  EXPECT_NE(error_message<invalid_argument>([&] { ModelConfig::from_json(j); }).find("num_key_value_heads"),
            std::string::npos);

  j = tiny_config("llama").to_json();
  j["model_type"] = "gpt2";
  EXPECT_NE(error_message<invalid_argument>([&] { ModelConfig::from_json(j); }).find("gpt2"), std::string::npos);

  j = tiny_config("llama").to_json();
  j["eos_token_id"] = 64;
  EXPECT_NE(error_message<invalid_argument>([&] { ModelConfig::from_json(j); }).find("eos_token_id"),
            std::string::npos);

  j = tiny_config("llama").to_json();
  j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}};
  EXPECT_NE(error_message<unsupported>([&] { ModelConfig::from_json(j); }).find("llama3"), std::string::npos);

  EXPECT_NE(
      error_message<io_error>([&] { ModelConfig::load("/nonexistent/config.json"); }).find("/nonexistent/config.json"),
      std::string::npos);
}

TEST(ModelConfig, NumParametersMatchesTheModel) {
  for (auto [type, tied] : {std::pair{"llama", false}, {"qwen2", true}, {"qwen3", false}}) {
    json j = tiny_config(type, tied).to_json();
    j["attention_bias"] = true;
    auto cfg = ModelConfig::from_json(j);
    Transformer m(cfg);
    std::int64_t n = 0;
    for (const auto& [name, t] : m.hf_state_dict()) n += t.numel();
    EXPECT_EQ(cfg.num_parameters(), n) << type;
  }
}

// ------------------------------------------------------------------------------------- golden logits

TEST(Transformer, MatchesIndependentPytorchImplementation) {
  json g = golden();
  std::vector<std::int64_t> tokens = g["tokens"].get<std::vector<std::int64_t>>();
  ASSERT_EQ(g["models"].size(), 4u);
  for (auto& [key, entry] : g["models"].items()) {
    SCOPED_TRACE(key);
    ModelConfig cfg = ModelConfig::from_json(entry["config"]);
    Transformer model(cfg);
    TensorMap weights;
    for (const auto& [name, t] : model.hf_state_dict()) weights[name] = hashed_weight(name, t.sizes());
    model.load_hf_state_dict(weights);

    auto expected_vec = entry["logits"].get<std::vector<std::vector<float>>>();
    torch::Tensor expected = torch::empty({(std::int64_t)expected_vec.size(), cfg.vocab_size});
    for (std::size_t i = 0; i < expected_vec.size(); ++i) expected[i] = torch::tensor(expected_vec[i], torch::kFloat32);

    torch::NoGradGuard no_grad;
    torch::Tensor logits = model.forward(ids_of(tokens))[0];
    EXPECT_LT(max_abs_diff(logits, expected), 1e-5);
    // The same sequence twice in a batch gives the same rows.
    torch::Tensor batch = model.forward(torch::cat({ids_of(tokens), ids_of(tokens)}, 0));
    EXPECT_LT(max_abs_diff(batch[1], expected), 1e-5);
  }
}

TEST(Transformer, LoadRejectsWrongNamesAndShapes) {
  Transformer model(tiny_config("qwen3"));
  TensorMap w = model.hf_state_dict();

  TensorMap bad = w;
  bad["model.layers.1.self_attn.k_proj.weight"] = torch::zeros({8, 32});
  auto msg = error_message<invalid_argument>([&] { model.load_hf_state_dict(bad); });
  EXPECT_NE(msg.find("model.layers.1.self_attn.k_proj.weight"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[8, 32]"), std::string::npos) << msg;

  bad = w;
  bad.erase("model.layers.0.self_attn.q_norm.weight");
  msg = error_message<invalid_argument>([&] { model.load_hf_state_dict(bad); });
  EXPECT_NE(msg.find("model.layers.0.self_attn.q_norm.weight"), std::string::npos) << msg;

  bad = w;
  bad["model.layers.0.self_attn.q_proj.bias"] = torch::zeros({32});
  msg = error_message<invalid_argument>([&] { model.load_hf_state_dict(bad); });
  EXPECT_NE(msg.find("model.layers.0.self_attn.q_proj.bias"), std::string::npos) << msg;

  EXPECT_THROW(model.forward(ids_of({1, 64})), invalid_argument);
}

// ------------------------------------------------------------------------------------------- KV cache

TEST(Transformer, KvCacheMatchesFullForward) {
  for (const char* type : {"llama", "qwen2", "qwen3"}) {
    SCOPED_TRACE(type);
    auto model = init_model(tiny_config(type, std::string(type) == "qwen2"), 11, torch::kCPU, torch::kFloat32);
    torch::NoGradGuard no_grad;
    std::vector<std::int64_t> tokens = {3, 14, 15, 9, 26, 53, 58, 9, 7, 9, 32, 38};
    torch::Tensor full = model->forward(ids_of(tokens))[0];  // [12, V]

    // Prefill 5, then one token at a time.
    KVCache cache = KVCache::allocate(model->config(), 1, 16, torch::kCPU, torch::kFloat32);
    std::vector<std::int64_t> head(tokens.begin(), tokens.begin() + 5);
    torch::Tensor prefill = model->forward(ids_of(head), &cache)[0];
    EXPECT_LT(max_abs_diff(prefill, full.narrow(0, 0, 5)), 1e-5);
    for (std::size_t i = 5; i < tokens.size(); ++i) {
      torch::Tensor step = model->forward(ids_of({tokens[i]}), &cache)[0][0];
      EXPECT_LT(max_abs_diff(step, full[i]), 1e-5) << "position " << i;
    }
    EXPECT_EQ(cache.length, 12);

    // Prefill 4, a chunk of 3 (causal inside the chunk), a chunk of 5.
    KVCache chunked = KVCache::allocate(model->config(), 1, 12, torch::kCPU, torch::kFloat32);
    model->forward(ids_of({tokens.begin(), tokens.begin() + 4}), &chunked);
    torch::Tensor mid = model->forward(ids_of({tokens.begin() + 4, tokens.begin() + 7}), &chunked)[0];
    EXPECT_LT(max_abs_diff(mid, full.narrow(0, 4, 3)), 1e-5);
    torch::Tensor tail = model->forward(ids_of({tokens.begin() + 7, tokens.end()}), &chunked)[0];
    EXPECT_LT(max_abs_diff(tail, full.narrow(0, 7, 5)), 1e-5);
    EXPECT_THROW(model->forward(ids_of({1}), &chunked), invalid_argument);  // capacity 12 is full
  }
}

TEST(Transformer, RepeatedAndSelectedCacheRowsDecodeIndependently) {
  auto model = init_model(tiny_config("qwen3"), 5, torch::kCPU, torch::kFloat32);
  torch::NoGradGuard no_grad;
  std::vector<std::int64_t> prompt = {7, 1, 8, 2};
  KVCache cache = KVCache::allocate(model->config(), 1, 8, torch::kCPU, torch::kFloat32);
  model->forward(ids_of(prompt), &cache);
  cache.repeat_batch(3);
  ASSERT_EQ(cache.batch(), 3);
  // Row r continues the prompt with token 10 + r, then the rows {2, 0} continue with 20 + r.
  torch::Tensor step1 = model->forward(torch::tensor({10, 11, 12}, torch::kLong).unsqueeze(1), &cache);
  cache.select_batch(torch::tensor({2, 0}, torch::kLong));
  torch::Tensor step2 = model->forward(torch::tensor({22, 20}, torch::kLong).unsqueeze(1), &cache);
  for (int r = 0; r < 3; ++r) {
    auto seq = prompt;
    seq.push_back(10 + r);
    torch::Tensor full = model->forward(ids_of(seq))[0];
    EXPECT_LT(max_abs_diff(step1[r][0], full[4]), 1e-5) << "row " << r;
  }
  for (auto [row, r] : {std::pair{0, 2}, std::pair{1, 0}}) {
    auto seq = prompt;
    seq.push_back(10 + r);
    seq.push_back(20 + r);
    torch::Tensor full = model->forward(ids_of(seq))[0];
    EXPECT_LT(max_abs_diff(step2[row][0], full[5]), 1e-5) << "row " << r;
  }
}

// -------------------------------------------------------------------------------------- safetensors

TEST(Safetensors, RoundTripIsBitExact) {
  TempDir dir;
  TensorMap tensors = {
      {"a.f32", torch::randn({3, 5})},
      {"b.bf16", torch::randn({4, 2}).to(torch::kBFloat16)},
      {"c.f16", torch::randn({7}).to(torch::kFloat16)},
      {"d.i64", torch::arange(-3, 9, torch::kLong).reshape({3, 4})},
      {"e.i32", torch::tensor({1, -2, 2147483647}, torch::kInt)},
      {"f.scalar", torch::tensor(2.5f).reshape({})},
      {"g.empty", torch::zeros({0, 3})},
      {"h.noncontig", torch::randn({4, 6}).t()},
  };
  write_safetensors(dir / "t.safetensors", tensors, {{"format", "pt"}, {"note", "hello"}});
  TensorMap back = read_safetensors(dir / "t.safetensors");
  ASSERT_EQ(back.size(), tensors.size());
  for (const auto& [name, t] : tensors) {
    ASSERT_TRUE(back.count(name)) << name;
    EXPECT_EQ(back[name].scalar_type(), t.scalar_type()) << name;
    EXPECT_EQ(back[name].sizes(), t.sizes()) << name;
    EXPECT_TRUE(torch::equal(back[name], t)) << name;
  }

  // Layout: 8-byte little-endian header length, JSON header, data starting 8-byte aligned.
  std::ifstream in(dir / "t.safetensors", std::ios::binary);
  std::uint64_t len = 0;
  in.read(reinterpret_cast<char*>(&len), 8);
  EXPECT_EQ(len % 8, 0u);
  std::string header(len, '\0');
  in.read(header.data(), len);
  json h = json::parse(header);
  EXPECT_EQ(h["a.f32"]["dtype"], "F32");
  EXPECT_EQ(h["b.bf16"]["dtype"], "BF16");
  EXPECT_EQ(h["a.f32"]["shape"], json::array({3, 5}));
  EXPECT_EQ(h["__metadata__"], json({{"format", "pt"}, {"note", "hello"}}));
  // No temp files left behind.
  int files = 0;
  for ([[maybe_unused]] auto& e : fs::directory_iterator(dir.path)) ++files;
  EXPECT_EQ(files, 1);
}

TEST(Safetensors, ReadErrorsNameTheFile) {
  TempDir dir;
  const std::string missing = dir / "missing.safetensors";
  auto msg = error_message<io_error>([&] { read_safetensors(missing); });
  EXPECT_NE(msg.find(missing), std::string::npos) << msg;

  const std::string truncated = dir / "truncated.safetensors";
  write_safetensors(truncated, {{"w", torch::randn({16, 16})}});
  fs::resize_file(truncated, fs::file_size(truncated) - 10);
  msg = error_message<io_error>([&] { read_safetensors(truncated); });
  EXPECT_NE(msg.find(truncated), std::string::npos) << msg;
  EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'w'"), std::string::npos) << msg;

  auto write_raw = [](const std::string& path, std::uint64_t len, const std::string& body) {
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<const char*>(&len), 8);
    out << body;
  };
  const std::string bad_json = dir / "bad_json.safetensors";
  write_raw(bad_json, 9, "{not json");
  msg = error_message<io_error>([&] { read_safetensors(bad_json); });
  EXPECT_NE(msg.find(bad_json), std::string::npos) << msg;
  EXPECT_NE(msg.find("malformed"), std::string::npos) << msg;

  const std::string huge_len = dir / "huge_len.safetensors";
  write_raw(huge_len, 1ull << 40, "{}");
  msg = error_message<io_error>([&] { read_safetensors(huge_len); });
  EXPECT_NE(msg.find(huge_len), std::string::npos) << msg;

  const std::string bad_entry = dir / "bad_entry.safetensors";
  std::string body = R"({"x":{"dtype":"F32","shape":[2,2],"data_offsets":[0,12]}})";
  write_raw(bad_entry, body.size(), body + std::string(16, '\0'));
  msg = error_message<io_error>([&] { read_safetensors(bad_entry); });
  EXPECT_NE(msg.find(bad_entry), std::string::npos) << msg;
  EXPECT_NE(msg.find("'x'"), std::string::npos) << msg;

  const std::string bad_dtype = dir / "bad_dtype.safetensors";
  body = R"({"y":{"dtype":"F8_E4M3","shape":[1],"data_offsets":[0,1]}})";
  write_raw(bad_dtype, body.size(), body + std::string(1, '\0'));
  msg = error_message<io_error>([&] { read_safetensors(bad_dtype); });
  EXPECT_NE(msg.find("F8_E4M3"), std::string::npos) << msg;

  const std::string tiny = dir / "tiny.safetensors";
  std::ofstream(tiny) << "abc";
  msg = error_message<io_error>([&] { read_safetensors(tiny); });
  EXPECT_NE(msg.find(tiny), std::string::npos) << msg;
}

TEST(ModelIo, SaveLoadSingleAndSharded) {
  TempDir dir;
  auto model = init_model(tiny_config("qwen2", true), 3, torch::kCPU, torch::kFloat32);
  torch::NoGradGuard no_grad;
  torch::Tensor ids = ids_of({1, 2, 3, 4, 5});
  torch::Tensor expected = model->forward(ids);

  save_model(*model, dir / "single");
  EXPECT_TRUE(fs::exists(dir / "single/config.json"));
  EXPECT_TRUE(fs::exists(dir / "single/model.safetensors"));
  auto single = load_model(dir / "single", torch::kCPU, torch::kFloat32);
  EXPECT_TRUE(state_dicts_equal(single->hf_state_dict(), model->hf_state_dict()));
  EXPECT_TRUE(torch::equal(single->forward(ids), expected));
  EXPECT_EQ(single->config().to_json(), model->config().to_json());

  // ~8 KB shards: the 8 KB embedding alone, then layers packed together.
  save_model(*model, dir / "sharded", 8 * 1024);
  EXPECT_FALSE(fs::exists(dir / "sharded/model.safetensors"));
  json index = json::parse(std::ifstream(dir / "sharded/model.safetensors.index.json"));
  std::set<std::string> files;
  for (auto& [name, file] : index["weight_map"].items()) files.insert(file.get<std::string>());
  EXPECT_GE(files.size(), 3u);
  for (const auto& f : files) EXPECT_TRUE(fs::exists(dir / ("sharded/" + f))) << f;
  EXPECT_EQ(index["weight_map"].size(), model->hf_state_dict().size());
  auto sharded = load_model(dir / "sharded", torch::kCPU, torch::kFloat32);
  EXPECT_TRUE(state_dicts_equal(sharded->hf_state_dict(), model->hf_state_dict()));
  EXPECT_TRUE(torch::equal(sharded->forward(ids), expected));

  // A shard that lost a tensor the index maps to it is reported with the tensor and the shard.
  const std::string first = dir / ("sharded/" + *files.begin());
  TensorMap shard = read_safetensors(first);
  const std::string dropped = shard.begin()->first;
  shard.erase(shard.begin());
  write_safetensors(first, shard);
  auto msg = error_message<io_error>([&] { load_model(dir / "sharded", torch::kCPU, torch::kFloat32); });
  EXPECT_NE(msg.find(dropped), std::string::npos) << msg;
  EXPECT_NE(msg.find(first), std::string::npos) << msg;

  // A tensor with the wrong shape names the tensor.
  TensorMap wrong = read_safetensors(dir / "single/model.safetensors");
  wrong["model.norm.weight"] = torch::ones({31});
  write_safetensors(dir / "single/model.safetensors", wrong);
  msg = error_message<invalid_argument>([&] { load_model(dir / "single", torch::kCPU, torch::kFloat32); });
  EXPECT_NE(msg.find("model.norm.weight"), std::string::npos) << msg;

  EXPECT_THROW(load_model(dir / "nowhere", torch::kCPU, torch::kFloat32), not_found);
}

TEST(ModelIo, InitModelIsDeterministic) {
  auto a = init_model(tiny_config("llama"), 42, torch::kCPU, torch::kFloat32);
  auto b = init_model(tiny_config("llama"), 42, torch::kCPU, torch::kFloat32);
  auto c = init_model(tiny_config("llama"), 43, torch::kCPU, torch::kFloat32);
  EXPECT_TRUE(state_dicts_equal(a->hf_state_dict(), b->hf_state_dict()));
  auto sa = a->hf_state_dict(), sc = c->hf_state_dict();
  EXPECT_FALSE(torch::equal(sa["model.embed_tokens.weight"], sc["model.embed_tokens.weight"]));
  EXPECT_TRUE(torch::equal(sa["model.norm.weight"], torch::ones({32})));
  const double std = sa["model.layers.0.mlp.up_proj.weight"].std().item<double>();
  EXPECT_NEAR(std, 0.02, 0.002);
}

// ---------------------------------------------------------------------------------------------- LoRA

TEST(Lora, UntrainedAdapterIsBitExactAndOnlyAdaptersTrain) {
  auto model = init_model(tiny_config("qwen2", true), 1, torch::kCPU, torch::kFloat32);
  torch::Tensor ids = ids_of({5, 6, 7, 8, 9, 10});
  torch::Tensor base;
  {
    torch::NoGradGuard g;
    base = model->forward(ids);
  }
  model->enable_lora(LoraOptions{.rank = 4, .alpha = 8, .target_modules = {"all-linear", "lm_head"}}, 7);
  torch::Tensor adapted = model->forward(ids);
  EXPECT_TRUE(torch::equal(adapted, base));

  auto trainable = model->named_trainable_parameters();
  EXPECT_EQ(trainable.size(), 2u * (7 * 2 + 1));
  for (const auto& [name, t] : trainable) {
    EXPECT_TRUE(t.requires_grad()) << name;
    EXPECT_TRUE(name.find(".lora_A.weight") != std::string::npos || name.find(".lora_B.weight") != std::string::npos)
        << name;
  }
  EXPECT_EQ(trainable.front().first, "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight");
  EXPECT_EQ(trainable.back().first, "base_model.model.lm_head.lora_B.weight");
  for (const auto& [name, t] : model->hf_state_dict()) EXPECT_FALSE(t.requires_grad()) << name;
  // A ~ U(-1/sqrt(in), 1/sqrt(in)) (PEFT's kaiming_uniform(a=sqrt(5))), B = 0.
  torch::Tensor a0 = model->lora_a_parameters().front();
  EXPECT_EQ(a0.sizes(), (std::vector<std::int64_t>{4, 32}));
  EXPECT_LE(a0.abs().max().item<double>(), 1.0 / std::sqrt(32.0));
  EXPECT_GT(a0.abs().max().item<double>(), 0.5 / std::sqrt(32.0));
  for (const auto& b : model->lora_b_parameters()) EXPECT_EQ(b.abs().sum().item<double>(), 0.0);

  // Gradients reach the adapters (B first: dL/dA is zero while B = 0) and nothing else.
  adapted.logsumexp(-1).sum().backward();
  for (const auto& b : model->lora_b_parameters()) {
    ASSERT_TRUE(b.grad().defined());
    EXPECT_GT(b.grad().abs().sum().item<double>(), 0.0);
  }
  for (const auto& [name, t] : model->hf_state_dict()) EXPECT_FALSE(t.grad().defined()) << name;

  // Same seed, same A.
  auto other = init_model(tiny_config("qwen2", true), 1, torch::kCPU, torch::kFloat32);
  other->enable_lora(LoraOptions{.rank = 4, .alpha = 8, .target_modules = {"all-linear", "lm_head"}}, 7);
  EXPECT_TRUE(torch::equal(other->lora_a_parameters().back(), model->lora_a_parameters().back()));
  EXPECT_THROW(other->enable_lora(LoraOptions{}, 0), conflict);
  auto bad = init_model(tiny_config("llama"), 1, torch::kCPU, torch::kFloat32);
  auto msg = error_message<invalid_argument>([&] { bad->enable_lora(LoraOptions{.target_modules = {"qkv"}}, 0); });
  EXPECT_NE(msg.find("qkv"), std::string::npos) << msg;
}

void perturb_b(Transformer& model, std::int64_t seed) {
  torch::NoGradGuard g;
  auto gen = at::detail::createCPUGenerator(seed);
  for (auto& b : model.lora_b_parameters()) b.copy_(torch::empty(b.sizes()).normal_(0.0, 0.05, gen));
}

TEST(Lora, MergedWeightsReproduceAdaptedLogits) {
  torch::Tensor ids = ids_of({5, 6, 7, 8, 9, 10, 11});
  {  // untied llama, adapters on attention only: merged dict loads into a plain model
    auto model = init_model(tiny_config("llama"), 2, torch::kCPU, torch::kFloat32);
    model->enable_lora(LoraOptions{.rank = 2, .alpha = 16, .target_modules = {"q_proj", "v_proj", "down_proj"}}, 3);
    perturb_b(*model, 4);
    torch::NoGradGuard g;
    torch::Tensor adapted = model->forward(ids);
    Transformer plain(model->config());
    plain.load_hf_state_dict(model->merged_hf_state_dict());
    EXPECT_LT(max_abs_diff(plain.forward(ids), adapted), 1e-5);
    // The adapted model really differs from the base.
    Transformer base(model->config());
    base.load_hf_state_dict(model->hf_state_dict());
    EXPECT_GT(max_abs_diff(base.forward(ids), adapted), 1e-3);
  }
  {  // tied qwen2 with an lm_head adapter: save_model unties and load_model reproduces the logits
    TempDir dir;
    auto model = init_model(tiny_config("qwen2", true), 2, torch::kCPU, torch::kFloat32);
    model->enable_lora(LoraOptions{.rank = 4, .alpha = 4, .target_modules = {"all-linear", "lm_head"}}, 3);
    perturb_b(*model, 5);
    torch::NoGradGuard g;
    torch::Tensor adapted = model->forward(ids);
    Transformer tied_plain(model->config());
    EXPECT_THROW(tied_plain.load_hf_state_dict(model->merged_hf_state_dict()), invalid_argument);
    save_model(*model, dir / "merged");
    auto loaded = load_model(dir / "merged", torch::kCPU, torch::kFloat32);
    EXPECT_FALSE(loaded->config().tie_word_embeddings);
    EXPECT_FALSE(loaded->has_lora());
    EXPECT_LT(max_abs_diff(loaded->forward(ids), adapted), 1e-5);
  }
}

TEST(Lora, PeftAdapterRoundTrip) {
  TempDir dir;
  auto model = init_model(tiny_config("qwen3"), 8, torch::kCPU, torch::kFloat32);
  model->enable_lora(LoraOptions{.rank = 3, .alpha = 6, .target_modules = {"all-linear"}}, 9);
  perturb_b(*model, 10);
  torch::Tensor ids = ids_of({1, 3, 5, 7, 9});
  torch::NoGradGuard g;
  torch::Tensor adapted = model->forward(ids);
  save_peft_adapter(*model, dir / "adapter", "tiny-qwen3");

  json cfg = json::parse(std::ifstream(dir / "adapter/adapter_config.json"));
  EXPECT_EQ(cfg["peft_type"], "LORA");
  EXPECT_EQ(cfg["r"], 3);
  EXPECT_EQ(cfg["lora_alpha"], 6);
  EXPECT_EQ(cfg["target_modules"], "all-linear");
  EXPECT_EQ(cfg["base_model_name_or_path"], "tiny-qwen3");
  TensorMap tensors = read_safetensors(dir / "adapter/adapter_model.safetensors");
  EXPECT_EQ(tensors.size(), 2u * 7 * 2);
  ASSERT_TRUE(tensors.count("base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"));
  EXPECT_EQ(tensors["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"].sizes(),
            (std::vector<std::int64_t>{32, 3}));

  // The saved tensors are the adapters exactly: loaded onto a fresh base with the same rank, they give the same
  // logits. (peft reading them is tests/hf's check.)
  auto fresh = init_model(tiny_config("qwen3"), 8, torch::kCPU, torch::kFloat32);
  fresh->enable_lora(LoraOptions{.rank = 3, .alpha = 6, .target_modules = {"all-linear"}}, 0);
  fresh->load_peft_state_dict(tensors);
  EXPECT_TRUE(torch::equal(fresh->forward(ids), adapted));
  EXPECT_TRUE(state_dicts_equal(fresh->peft_state_dict(), model->peft_state_dict()));

  auto plain = init_model(tiny_config("qwen3"), 8, torch::kCPU, torch::kFloat32);
  EXPECT_THROW(save_peft_adapter(*plain, dir / "none", "x"), conflict);
}

// bf16 is what GPUs run: the same code paths must work (CPU bf16 is slow, so the model stays tiny).
TEST(Transformer, Bf16ForwardSampleAndSave) {
  TempDir dir;
  auto f32 = init_model(tiny_config("qwen2", true), 4, torch::kCPU, torch::kFloat32);
  auto bf16 = init_model(tiny_config("qwen2", true), 4, torch::kCPU, torch::kBFloat16);
  EXPECT_EQ(bf16->hf_state_dict()["model.embed_tokens.weight"].scalar_type(), torch::kBFloat16);
  torch::NoGradGuard g;
  torch::Tensor ids = ids_of({1, 2, 3, 4, 5, 6});
  torch::Tensor a = f32->forward(ids), b = bf16->forward(ids);
  EXPECT_EQ(b.scalar_type(), torch::kBFloat16);
  EXPECT_LT(max_abs_diff(a, b.to(torch::kFloat32)), 0.05);  // same seed, same weights up to rounding

  SampleRequest req;
  req.prompt = ModelInput::from_tokens({1, 2, 3});
  req.num_samples = 2;
  req.params.max_tokens = 5;
  auto r = sample(*bf16, req, {}, SampleStream(1));
  EXPECT_EQ(r.sequences[1].tokens.size(), 5u);

  save_model(*bf16, dir / "m");
  EXPECT_EQ(json::parse(std::ifstream(dir / "m/config.json"))["torch_dtype"], "bfloat16");
  TensorMap stored = read_safetensors(dir / "m/model.safetensors");
  EXPECT_EQ(stored["model.norm.weight"].scalar_type(), torch::kBFloat16);
  auto back = load_model(dir / "m", torch::kCPU, torch::kBFloat16);
  EXPECT_TRUE(state_dicts_equal(back->hf_state_dict(), bf16->hf_state_dict()));
}

// ------------------------------------------------------------------------------------------- sampler

struct SamplerTest : ::testing::Test {
  std::shared_ptr<Transformer> model = init_model(tiny_config("qwen3"), 21, torch::kCPU, torch::kFloat32);
  std::vector<token_id> prompt = {1, 2, 3, 4, 5};

  SampleResponse run(SamplingParams params, int n = 1, std::uint64_t seed = 0, const StopStringCheck& check = {},
                     bool prompt_lp = false, int topk = 0) {
    SampleRequest req;
    req.prompt = ModelInput::from_tokens(prompt);
    req.num_samples = n;
    req.params = std::move(params);
    req.include_prompt_logprobs = prompt_lp;
    req.topk_prompt_logprobs = topk;
    return sample(*model, req, check, SampleStream(seed));
  }

  // Greedy continuation computed with full forwards only (no cache).
  std::vector<token_id> greedy_reference(int steps) {
    torch::NoGradGuard g;
    std::vector<std::int64_t> seq(prompt.begin(), prompt.end());
    std::vector<token_id> out;
    for (int i = 0; i < steps; ++i) {
      auto next = model->forward(ids_of(seq))[0][-1].argmax().item<std::int64_t>();
      seq.push_back(next);
      out.push_back(static_cast<token_id>(next));
    }
    return out;
  }

  void expect_logprobs_match(const SampledSequence& s) {
    std::vector<token_id> all = prompt;
    all.insert(all.end(), s.tokens.begin(), s.tokens.end());
    auto ref = compute_logprobs(*model, all);
    ASSERT_EQ(s.logprobs.size(), s.tokens.size());
    for (std::size_t i = 0; i < s.tokens.size(); ++i) EXPECT_NEAR(s.logprobs[i], ref[prompt.size() + i], 1e-4) << i;
  }
};

TEST_F(SamplerTest, SameSeedSameSamples) {
  SamplingParams p{.max_tokens = 12, .temperature = 1.0};
  auto a = run(p, 4, 123), b = run(p, 4, 123), c = run(p, 4, 124);
  ASSERT_EQ(a.sequences.size(), 4u);
  bool all_same_as_c = true;
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(a.sequences[i].tokens, b.sequences[i].tokens);
    EXPECT_EQ(a.sequences[i].logprobs, b.sequences[i].logprobs);
    all_same_as_c = all_same_as_c && a.sequences[i].tokens == c.sequences[i].tokens;
  }
  EXPECT_FALSE(all_same_as_c);
  // Samples of one request differ from each other (they are not copies of one draw).
  EXPECT_NE(a.sequences[0].tokens, a.sequences[1].tokens);
}

TEST_F(SamplerTest, LogprobsEqualComputeLogprobs) {
  // The returned logprobs ignore temperature / top-k / top-p: they are the model's own.
  auto r = run(SamplingParams{.max_tokens = 10, .temperature = 0.7, .top_k = 8, .top_p = 0.9}, 3, 5);
  for (const auto& s : r.sequences) {
    EXPECT_EQ(s.tokens.size(), 10u);
    EXPECT_EQ(s.stop_reason, StopReason::length);
    EXPECT_EQ(s.prefill_tokens, 5);
    EXPECT_EQ(s.decode_tokens, 10);
    expect_logprobs_match(s);
  }
}

TEST_F(SamplerTest, GreedyTopKOneAndTinyTopPAgree) {
  auto ref = greedy_reference(8);
  auto greedy = run(SamplingParams{.max_tokens = 8, .temperature = 0.0}, 2);
  for (const auto& s : greedy.sequences) EXPECT_EQ(s.tokens, ref);
  expect_logprobs_match(greedy.sequences[0]);
  EXPECT_EQ(run(SamplingParams{.max_tokens = 8, .temperature = 1.0, .top_k = 1}, 2, 99).sequences[1].tokens, ref);
  EXPECT_EQ(run(SamplingParams{.max_tokens = 8, .temperature = 1.0, .top_p = 1e-6}, 2, 98).sequences[1].tokens, ref);
}

TEST_F(SamplerTest, StopsOnTokenIdsAndStopCheckAndLength) {
  auto ref = greedy_reference(10);
  // Stop on the first greedy token that has not appeared before index 3.
  std::size_t at = 3;
  while (std::find(ref.begin(), ref.begin() + at, ref[at]) != ref.begin() + at) ++at;
  ASSERT_LT(at, ref.size());
  // A second stop id that greedy decoding never produces within the window must not matter.
  token_id unused = 0;
  while (std::find(ref.begin(), ref.end(), unused) != ref.end()) ++unused;
  auto r = run(SamplingParams{.max_tokens = 10, .temperature = 0.0, .stop_token_ids = {unused, ref[at]}});
  const auto& s = r.sequences[0];
  EXPECT_EQ(s.tokens, std::vector<token_id>(ref.begin(), ref.begin() + at + 1));  // stop token kept
  EXPECT_EQ(s.stop_reason, StopReason::stop);
  EXPECT_EQ(s.decode_tokens, static_cast<std::int64_t>(at + 1));

  int calls = 0;
  auto check = [&](std::span<const token_id> gen) {
    ++calls;
    return gen.size() == 2;
  };
  auto r2 = run(SamplingParams{.max_tokens = 10, .temperature = 1.0}, 3, 7, check);
  for (const auto& seq : r2.sequences) {
    EXPECT_EQ(seq.tokens.size(), 2u);
    EXPECT_EQ(seq.stop_reason, StopReason::stop);
  }
  EXPECT_EQ(calls, 6);

  auto r3 = run(SamplingParams{.max_tokens = 4, .temperature = 1.0}, 2, 7);
  for (const auto& seq : r3.sequences) {
    EXPECT_EQ(seq.tokens.size(), 4u);
    EXPECT_EQ(seq.stop_reason, StopReason::length);
  }
  // No new tokens is below limits::max_tokens_min, here as at every entry point.
  EXPECT_THROW(run(SamplingParams{.max_tokens = 0}, 2), invalid_argument);
}

TEST_F(SamplerTest, FinishedSamplesLeaveTheBatch) {
  // Many stop tokens at a high temperature: samples end at different steps, so the batch shrinks while the
  // survivors keep decoding. Every survivor's logprobs must still match a cache-free recomputation.
  std::vector<token_id> stops;
  for (token_id t = 0; t < 64; t += 5) stops.push_back(t);
  auto r = run(SamplingParams{.max_tokens = 16, .temperature = 1.5, .stop_token_ids = stops}, 8, 31);
  std::set<std::size_t> lengths;
  for (const auto& s : r.sequences) {
    lengths.insert(s.tokens.size());
    expect_logprobs_match(s);
    if (s.stop_reason == StopReason::stop) {
      EXPECT_NE(std::find(stops.begin(), stops.end(), s.tokens.back()), stops.end());
    } else {
      EXPECT_EQ(s.tokens.size(), 16u);
    }
    for (std::size_t i = 0; i + 1 < s.tokens.size(); ++i)
      EXPECT_EQ(std::find(stops.begin(), stops.end(), s.tokens[i]), stops.end());
  }
  EXPECT_GE(lengths.size(), 2u);
}

TEST_F(SamplerTest, PromptLogprobs) {
  auto r = run(SamplingParams{.max_tokens = 1}, 1, 0, {}, true, 3);
  auto ref = compute_logprobs(*model, prompt);
  ASSERT_TRUE(r.prompt_logprobs.has_value());
  ASSERT_EQ(r.prompt_logprobs->size(), prompt.size());
  EXPECT_EQ((*r.prompt_logprobs)[0], 0.0);
  for (std::size_t i = 1; i < prompt.size(); ++i) EXPECT_NEAR((*r.prompt_logprobs)[i], ref[i], 1e-5);
  ASSERT_TRUE(r.topk_prompt_logprobs.has_value());
  const auto& topk = *r.topk_prompt_logprobs;
  ASSERT_EQ(topk.size(), prompt.size());
  EXPECT_TRUE(topk[0].empty());
  for (std::size_t i = 1; i < prompt.size(); ++i) {
    ASSERT_EQ(topk[i].size(), 3u);
    EXPECT_GE(topk[i][0].logprob, topk[i][1].logprob);
    EXPECT_GE(topk[i][1].logprob, topk[i][2].logprob);
    EXPECT_GE(topk[i][0].logprob, ref[i] - 1e-6);
    for (const auto& e : topk[i]) {
      if (e.token == prompt[i]) {
        EXPECT_NEAR(e.logprob, ref[i], 1e-5);
      }
    }
  }
  auto plain = run(SamplingParams{.max_tokens = 1});
  EXPECT_FALSE(plain.prompt_logprobs.has_value());
  EXPECT_FALSE(plain.topk_prompt_logprobs.has_value());
}

// Prompt logprobs over several chunks of logits (at most kLogitChunkValues at once): 300 prompt rows over a
// 131,072-token vocabulary are 128-row chunks. Every position equals compute_logprobs and heads its top-k.
TEST(Sampler, PromptLogprobsOfALongPromptComeAChunkAtATime) {
  nlohmann::json j = tiny_config("llama").to_json();
  j["vocab_size"] = 131072;
  j["max_position_embeddings"] = 512;
  auto model = init_model(ModelConfig::from_json(j), 3, torch::kCPU, torch::kFloat32);
  std::vector<token_id> prompt;
  for (int i = 0; i < 300; ++i) prompt.push_back(static_cast<token_id>((i * 7919) % 131072));
  SampleRequest req;
  req.prompt = ModelInput::from_tokens(prompt);
  req.params.max_tokens = 1;
  req.include_prompt_logprobs = true;
  req.topk_prompt_logprobs = 2;
  const auto r = sample(*model, req, {}, SampleStream(0));
  const auto ref = compute_logprobs(*model, prompt);
  ASSERT_EQ(r.prompt_logprobs->size(), prompt.size());
  ASSERT_EQ(r.topk_prompt_logprobs->size(), prompt.size());
  for (std::size_t i = 1; i < prompt.size(); ++i) {
    EXPECT_NEAR((*r.prompt_logprobs)[i], ref[i], 1e-5) << i;
    ASSERT_EQ((*r.topk_prompt_logprobs)[i].size(), 2u) << i;
    EXPECT_GE((*r.topk_prompt_logprobs)[i][0].logprob, ref[i] - 1e-5) << i;
  }
}

TEST(Sampler, InverseCdfDrawFollowsTheDistribution) {
  // Row 0: zero-probability tokens interleaved; row 1: one-hot.
  torch::Tensor probs = torch::tensor({0.0f, 0.5f, 0.0f, 0.3f, 0.2f, 0.0f, 0.0f, 0.0f, 0.0f, 1.0f}).reshape({2, 5});
  const SampleStream stream(17);
  std::vector<int> counts(5, 0);
  const int n = 4000;
  for (int i = 0; i < n; ++i) {
    torch::Tensor u = torch::tensor({stream.uniform(0, i), stream.uniform(1, i)}, torch::kFloat64);
    torch::Tensor t = draw_inverse_cdf(probs, u);
    ASSERT_EQ(t[1].item<std::int64_t>(), 4);
    ++counts[t[0].item<std::int64_t>()];
  }
  EXPECT_EQ(counts[0] + counts[2], 0);
  // Binomial standard deviation ~ sqrt(n p (1-p)) <= 32: 5 sigma bounds (seeded, so deterministic anyway).
  EXPECT_NEAR(counts[1], 0.5 * n, 160);
  EXPECT_NEAR(counts[3], 0.3 * n, 150);
  EXPECT_NEAR(counts[4], 0.2 * n, 130);
  // The CDF of row 0 is 0, .5, .5, .8, 1: a uniform picks the first token whose cumulative mass exceeds it.
  auto pick = [&](double u) { return draw_inverse_cdf(probs, torch::tensor({u, u}, torch::kFloat64))[0].item<int>(); };
  EXPECT_EQ(pick(0.0), 1);
  EXPECT_EQ(pick(0.4999), 1);
  EXPECT_EQ(pick(0.5), 3);
  EXPECT_EQ(pick(0.7999), 3);
  EXPECT_EQ(pick(0.8001), 4);
  EXPECT_EQ(pick(0.999999), 4);
}

TEST(Sampler, SampleStreamsAreUniformAndPerSample) {
  const SampleStream a(5), b(5), other(6);
  double sum = 0, sum_sq = 0;
  const int n = 20000;
  for (int t = 0; t < n; ++t) {
    const double u = a.uniform(3, t);
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    ASSERT_EQ(u, b.uniform(3, t));  // a function of seed, sample and token alone
    sum += u;
    sum_sq += u * u;
  }
  // Mean 1/2 and variance 1/12, each within about 5 standard errors.
  EXPECT_NEAR(sum / n, 0.5, 0.011);
  EXPECT_NEAR(sum_sq / n - (sum / n) * (sum / n), 1.0 / 12, 0.004);
  EXPECT_NE(a.uniform(0, 0), a.uniform(1, 0));      // samples have their own streams
  EXPECT_NE(a.uniform(0, 0), other.uniform(0, 0));  // and seeds their own
  // A share that starts at sample 2 draws what the whole request's sample 2 + r draws.
  const SampleStream share = a.from_row(2);
  EXPECT_EQ(share.first_row(), 2);
  for (int r = 0; r < 3; ++r)
    for (int t = 0; t < 4; ++t) EXPECT_EQ(share.uniform(r, t), a.uniform(2 + r, t));
}

TEST_F(SamplerTest, ComputeLogprobsAndBadInput) {
  auto lp = compute_logprobs(*model, std::vector<token_id>{4, 9, 2});
  ASSERT_EQ(lp.size(), 3u);
  EXPECT_EQ(lp[0], 0.0);
  torch::NoGradGuard g;
  auto ref = torch::log_softmax(model->forward(ids_of({4, 9, 2}))[0], -1);
  EXPECT_NEAR(lp[1], ref[0][9].item<double>(), 1e-6);
  EXPECT_NEAR(lp[2], ref[1][2].item<double>(), 1e-6);
  EXPECT_TRUE(compute_logprobs(*model, std::vector<token_id>{}).empty());

  prompt = {};
  EXPECT_THROW(run(SamplingParams{}), invalid_argument);
  prompt = {1, 99};
  EXPECT_THROW(run(SamplingParams{}), invalid_argument);
  prompt = {1, 2};
  EXPECT_THROW(run(SamplingParams{.temperature = -1}), invalid_argument);
  EXPECT_THROW(run(SamplingParams{.top_p = 0.0}), invalid_argument);
  EXPECT_THROW(run(SamplingParams{.max_tokens = 1000}), invalid_argument);  // beyond max_position_embeddings
}

}  // namespace
