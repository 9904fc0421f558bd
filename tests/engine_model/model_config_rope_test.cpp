// ModelConfig's reading of RoPE settings in both config.json spellings: transformers 4.x (top-level rope_theta,
// rope_scaling) and 5.x (rope_parameters). A theta read wrongly does not fail loudly, it shifts every logit, so
// each way of stating it is checked here; tests/hf checks the logits themselves against transformers.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <rlloop/error.hpp>

#include "model/model_config.hpp"

using nlohmann::json;
using namespace rlloop;
using namespace rlloop::engine;

namespace {

// A tiny Llama config.json without any RoPE key.
json base_config() {
  return {{"model_type", "llama"},     {"vocab_size", 64},          {"hidden_size", 32},
          {"intermediate_size", 48},   {"num_hidden_layers", 2},    {"num_attention_heads", 4},
          {"num_key_value_heads", 2},  {"rms_norm_eps", 1e-6},      {"max_position_embeddings", 256}};
}

template <class E>
std::string error_message(const json& j) {
  try {
    ModelConfig::from_json(j);
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("WRONG EXCEPTION TYPE: ") + e.what();
  }
  return "NO EXCEPTION";
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

TEST(ModelConfigRope, ReadsTransformers5RopeParameters) {
  // As transformers 5.24 saves a Llama 3 style config: no top-level rope_theta.
  json j = base_config();
  j["rope_parameters"] = {{"rope_theta", 500000.0}, {"rope_type", "default"}};
  EXPECT_EQ(ModelConfig::from_json(j).rope_theta, 500000.0);

  // rope_type may be absent (transformers fills in "default"); an integer theta is a number all the same.
  j["rope_parameters"] = {{"rope_theta", 1000000}};
  EXPECT_EQ(ModelConfig::from_json(j).rope_theta, 1000000.0);

  // rope_parameters without a theta keeps the top-level one.
  j["rope_parameters"] = {{"rope_type", "default"}};
  j["rope_theta"] = 250000.0;
  EXPECT_EQ(ModelConfig::from_json(j).rope_theta, 250000.0);
}

TEST(ModelConfigRope, ReadsTransformers4TopLevelTheta) {
  json j = base_config();
  EXPECT_EQ(ModelConfig::from_json(j).rope_theta, 10000.0);  // HF's default when nothing is stated

  j["rope_theta"] = 1000000.0;
  j["rope_scaling"] = nullptr;
  EXPECT_EQ(ModelConfig::from_json(j).rope_theta, 1000000.0);

  j["rope_scaling"] = {{"rope_type", "default"}};
  EXPECT_EQ(ModelConfig::from_json(j).rope_theta, 1000000.0);
}

TEST(ModelConfigRope, BothThetasMustAgree) {
  json j = base_config();
  j["rope_theta"] = 500000.0;
  j["rope_parameters"] = {{"rope_theta", 500000.0}, {"rope_type", "default"}};
  EXPECT_EQ(ModelConfig::from_json(j).rope_theta, 500000.0);

  j["rope_parameters"]["rope_theta"] = 1000000.0;
  std::string msg = error_message<invalid_argument>(j);
  EXPECT_TRUE(contains(msg, "rope_parameters.rope_theta 1000000")) << msg;
  EXPECT_TRUE(contains(msg, "rope_theta 500000")) << msg;
}

TEST(ModelConfigRope, ScaledVariantsAreUnsupported) {
  json j = base_config();
  j["rope_parameters"] = {{"rope_theta", 500000.0},    {"rope_type", "llama3"},
                          {"factor", 8.0},             {"low_freq_factor", 1.0},
                          {"high_freq_factor", 4.0},   {"original_max_position_embeddings", 8192}};
  std::string msg = error_message<unsupported>(j);
  EXPECT_TRUE(contains(msg, "rope_parameters type 'llama3'")) << msg;

  // The legacy spellings: rope_scaling with "rope_type" or the older "type".
  j = base_config();
  j["rope_scaling"] = {{"rope_type", "dynamic"}, {"factor", 4.0}};
  msg = error_message<unsupported>(j);
  EXPECT_TRUE(contains(msg, "rope_scaling type 'dynamic'")) << msg;
  // YaRN is read, but not DeepSeek's mscale variant of it.
  j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 4096},
                       {"mscale", 1.0}, {"mscale_all_dim", 1.0}};
  msg = error_message<unsupported>(j);
  EXPECT_TRUE(contains(msg, "YaRN's mscale / mscale_all_dim are not supported")) << msg;
  j["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
  msg = error_message<unsupported>(j);
  EXPECT_TRUE(contains(msg, "rope_scaling type 'linear'")) << msg;

  // Per-layer-type parameters (as Gemma 3 writes them) hide their type and theta one level down.
  j = base_config();
  j["rope_parameters"] = {{"full_attention", {{"rope_theta", 1000000.0}, {"rope_type", "linear"}}},
                          {"sliding_attention", {{"rope_theta", 10000.0}, {"rope_type", "default"}}}};
  msg = error_message<unsupported>(j);
  EXPECT_TRUE(contains(msg, "per-layer-type rope_parameters")) << msg;

  j = base_config();
  j["rope_parameters"] = 500000.0;
  msg = error_message<invalid_argument>(j);
  EXPECT_TRUE(contains(msg, "'rope_parameters' must be an object")) << msg;
}

// YaRN (rope_type "yarn", as gpt-oss and long-context Qwen3 state it): its keys read, written back by to_json, and
// bad values refused by name.
TEST(ModelConfigRope, ReadsYarnAndWritesItBack) {
  json j = base_config();
  j["rope_parameters"] = {{"rope_theta", 150000.0}, {"rope_type", "yarn"}, {"factor", 32.0}, {"beta_fast", 32.0},
                          {"beta_slow", 1.0}, {"original_max_position_embeddings", 4096}, {"truncate", false}};
  const ModelConfig c = ModelConfig::from_json(j);
  ASSERT_TRUE(c.yarn);
  EXPECT_EQ(c.rope_theta, 150000.0);
  EXPECT_EQ(c.yarn->factor, 32.0);
  EXPECT_EQ(c.yarn->original_max_position_embeddings, 4096);
  EXPECT_FALSE(c.yarn->truncate);
  EXPECT_FALSE(c.yarn->attention_factor);
  const ModelConfig back = ModelConfig::from_json(c.to_json());
  ASSERT_TRUE(back.yarn);
  EXPECT_EQ(back.yarn->factor, 32.0);
  EXPECT_EQ(back.yarn->beta_fast, 32.0);
  EXPECT_FALSE(back.yarn->truncate);
  EXPECT_EQ(back.rope_theta, 150000.0);
  j["rope_parameters"]["factor"] = 0.5;
  EXPECT_TRUE(contains(error_message<invalid_argument>(j), "rope_parameters.factor must be >= 1 for YaRN, got 0.5"));
  j["rope_parameters"]["factor"] = 4.0;
  j["rope_parameters"].erase("original_max_position_embeddings");
  EXPECT_TRUE(contains(error_message<invalid_argument>(j),
                       "rope_parameters.original_max_position_embeddings must be positive for YaRN"));
}

// A gpt_oss config.json that states no window or RoPE takes transformers' GptOssConfig defaults: a window of 128 on
// the even layers, theta 150000 with YaRN x32 over 4096 positions.
TEST(ModelConfigRope, GptOssTakesTransformersDefaults) {
  json j = base_config();
  j.erase("rope_theta");
  j.erase("rope_parameters");
  j["model_type"] = "gpt_oss";
  j["num_local_experts"] = 4;
  j["num_experts_per_tok"] = 2;
  const ModelConfig c = ModelConfig::from_json(j);
  EXPECT_EQ(c.rope_theta, 150000.0);
  ASSERT_TRUE(c.yarn);
  EXPECT_EQ(c.yarn->factor, 32.0);
  EXPECT_EQ(c.yarn->original_max_position_embeddings, 4096);
  EXPECT_FALSE(c.yarn->truncate);
  EXPECT_EQ(c.attention_window(0), 128);
  EXPECT_EQ(c.attention_window(1), 0);
  EXPECT_EQ(c.moe_intermediate_size, c.intermediate_size);
  j["sliding_window"] = "wide";
  EXPECT_TRUE(contains(error_message<invalid_argument>(j), "model config: a gpt_oss key has the wrong type"));
}

TEST(ModelConfigRope, ToJsonKeepsTheLegacyKey) {
  // to_json writes top-level rope_theta only: transformers 4.x reads nothing else and 5.x reads it too.
  json j = base_config();
  j["rope_parameters"] = {{"rope_theta", 1000000.0}, {"rope_type", "default"}};
  json out = ModelConfig::from_json(j).to_json();
  EXPECT_EQ(out["rope_theta"], 1000000.0);
  EXPECT_FALSE(out.contains("rope_parameters"));
  EXPECT_EQ(ModelConfig::from_json(out).rope_theta, 1000000.0);
}

}  // namespace
