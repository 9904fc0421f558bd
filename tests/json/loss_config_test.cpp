// lossFnName / lossFnConfig (src/wire/loss_config.hpp): which keys each loss takes, their bounds and messages, and
// the translation between the wire's clip thresholds and the spec's epsilons.
#include <gtest/gtest.h>

#include <functional>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "wire/loss_config.hpp"
#include "wire/runtime.hpp"

using namespace rlloop;
using namespace rlloop::wire;

namespace {
std::string message_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const invalid_argument& e) {
    return e.what();
  }
  return "(no error)";
}
using config = std::map<std::string, double>;
using strings = std::vector<std::string>;
}  // namespace

TEST(WireLossConfig, EachLossTakesTheKeysOfTheParametersItReads) {
  EXPECT_EQ(loss_config_keys(LossFn::cross_entropy), strings{});
  EXPECT_EQ(loss_config_keys(LossFn::importance_sampling), strings{});
  EXPECT_EQ(loss_config_keys(LossFn::ppo), (strings{"clip_low_threshold", "clip_high_threshold"}));
  EXPECT_EQ(loss_config_keys(LossFn::cispo), (strings{"clip_low_threshold", "clip_high_threshold"}));
  EXPECT_EQ(loss_config_keys(LossFn::dro), strings{"beta"});
  EXPECT_EQ(loss_config_keys(LossFn::value), strings{"value_clip"});
  EXPECT_EQ(loss_config_keys(LossFn::gspo), (strings{"clip_low_threshold", "clip_high_threshold"}));
  EXPECT_EQ(loss_config_keys(LossFn::stable_reinforce), (strings{"truncation", "kl_coeff"}));
  // A key of another loss is refused by name, as is one no loss has.
  EXPECT_EQ(message_of([] { loss_from_config("cross_entropy", {{"clip_low_threshold", 0.7}}); }),
            "loss 'cross_entropy' does not accept config key 'clip_low_threshold'");
  EXPECT_EQ(message_of([] { loss_from_config("ppo", {{"epsilon", 0.2}}); }),
            "loss 'ppo' does not accept config key 'epsilon'");
  EXPECT_EQ(message_of([] { loss_from_config("kto"); }),
            "unknown loss function 'kto' (expected cross_entropy, importance_sampling, ppo, cispo, dro, value, "
            "gspo or stable_reinforce)");
}

TEST(WireLossConfig, ClipThresholdsAreTheSpecsClipRange) {
  // The wire's thresholds are the ratio's bounds: epsilon_low = 1 - clip_low_threshold.
  const LossSpec ppo = loss_from_config("ppo", {{"clip_low_threshold", 0.7}});
  EXPECT_EQ(ppo.min_ratio(), 0.7);
  EXPECT_NEAR(ppo.epsilon_low, 0.3, 1e-15);
  EXPECT_EQ(ppo.epsilon_high, 0.2);  // the default
  EXPECT_EQ(loss_config(ppo).at("clip_low_threshold"), 0.7);
  // The defaults are PPO's epsilon 0.2, which the wire carries as 0.8 / 1.2.
  EXPECT_EQ(loss_config(LossSpec::ppo()), (config{{"clip_low_threshold", 0.8}, {"clip_high_threshold", 1.2}}));
  EXPECT_EQ(loss_config(LossSpec::cross_entropy()), config{});
  EXPECT_EQ(loss_config(LossSpec::dro(0.5)), (config{{"beta", 0.5}}));
  EXPECT_EQ(loss_config(LossSpec::value(0.3)), (config{{"value_clip", 0.3}}));
  EXPECT_EQ(loss_from_config("dro", {{"beta", 0.5}}).beta, 0.5);
  // stable_reinforce: the truncation C = 2 and no KL penalty unless asked.
  EXPECT_EQ(loss_config(LossSpec::stable_reinforce()), (config{{"truncation", 2.0}, {"kl_coeff", 0.0}}));
  EXPECT_EQ(loss_from_config("stable_reinforce", {{"kl_coeff", 0.01}}), LossSpec::stable_reinforce(2.0, 0.01));
  EXPECT_EQ(message_of([] { loss_from_config("stable_reinforce", {{"truncation", 0.5}}); }),
            "truncation must be a finite number >= 1, got 0.500000");
}

TEST(WireLossConfig, EverySpecComesBackFromItsConfig) {
  // Parameters whose wire values are exact in binary (thresholds in [0.5, 2]): every loss round-trips exactly.
  for (const LossInfo& row : kLosses) {
    const LossSpec spec{.fn = row.fn,       .epsilon_low = 0.25, .epsilon_high = 0.375, .beta = 0.03,
                        .value_clip = 0.45, .truncation = 3.0,   .kl_coeff = 0.125};
    const LossSpec back = loss_from_config(row.name, loss_config(spec));
    EXPECT_EQ(back.fn, row.fn);
    // The parameters the loss reads travel; the others keep their defaults.
    for (const LossParamInfo& p : kLossParams)
      EXPECT_EQ(back.*p.member, reads_param(row.fn, p.member) ? spec.*p.member : LossSpec{}.*p.member)
          << row.name << " " << p.name;
  }
}

TEST(WireLossConfig, BoundsAreTheParametersCarriedToTheWire) {
  // epsilon_low in [0, 1] is clip_low_threshold in [0, 1]; epsilon_high in [0, 9] is clip_high_threshold in [1, 10].
  EXPECT_EQ(message_of([] { loss_from_config("ppo", {{"clip_low_threshold", 2.0}}); }),
            "clip_low_threshold must be in [0, 1], got 2.000000");
  EXPECT_EQ(message_of([] { loss_from_config("cispo", {{"clip_high_threshold", 0.5}}); }),
            "clip_high_threshold must be in [1, 10], got 0.500000");
  EXPECT_EQ(message_of([] { loss_from_config("ppo", {{"clip_high_threshold", 10.5}}); }),
            "clip_high_threshold must be in [1, 10], got 10.500000");
  EXPECT_EQ(message_of([] { loss_from_config("dro", {{"beta", -1.0}}); }),
            "beta must be a finite number >= 0, got -1.000000");
  EXPECT_EQ(message_of([] { loss_from_config("value", {{"value_clip", -0.1}}); }),
            "value_clip must be a finite number >= 0, got -0.100000");
  EXPECT_EQ(message_of([] { loss_from_config("value", {{"value_clip", std::numeric_limits<double>::infinity()}}); }),
            "loss config 'value_clip' is not a finite number");
  // The ends of each range are accepted.
  EXPECT_EQ(loss_from_config("ppo", {{"clip_low_threshold", 0.0}, {"clip_high_threshold", 10.0}}),
            LossSpec::ppo(1.0, 9.0));
  EXPECT_EQ(loss_from_config("dro", {{"beta", 0.0}}).beta, 0.0);
}

TEST(WireLossConfig, TheRequestReaderNamesThePathAndTheKey) {
  // Through loss_from_json, as the server reads a forwardBackward: the path, then the same message.
  const json c{{"lossFnName", "dro"}, {"lossFnConfig", {{"beta", -2}}}};
  EXPECT_EQ(message_of([&] { loss_from_json(c, "operationConfig.forwardBackward"); }),
            "operationConfig.forwardBackward: beta must be a finite number >= 0, got -2.000000");
  // The loss inputs a datum may carry are the core's list, named in the reader's message.
  Datum d;
  d.model_input = ModelInput::from_tokens({1, 2});
  json j = to_json(d);
  j["lossFnInputs"]["mask"] = to_json(TensorData::from_floats({1.0f, 1.0f}));
  EXPECT_EQ(message_of([&] { datum_from_json(j, "d"); }),
            "d.lossFnInputs.mask: unknown loss input (expected target_tokens, weights, advantages, logprobs, "
            "ref_log_prob, temperature, returns, old_values, routed_experts or sequence_ratio_mask)");
  json written;
  write_loss(written, LossSpec::value(0.5));
  EXPECT_EQ(written, (json{{"lossFnName", "value"}, {"lossFnConfig", {{"value_clip", 0.5}}}}));
  written.clear();
  write_loss(written, LossSpec::importance_sampling());
  EXPECT_EQ(written, (json{{"lossFnName", "importance_sampling"}}));
}
