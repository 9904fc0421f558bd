// The table of built-in losses (rlloop/loss.hpp) and what reads it in the core: names, parameter bounds, the loss
// inputs each loss requires. The engine's rows are tested in tests/engine/loss_test.cpp, the wire's keys in
// tests/json/json_test.cpp.
#include <gtest/gtest.h>

#include <functional>
#include <set>
#include <string>
#include <vector>

#include <rlloop/rlloop.hpp>

using namespace rlloop;

namespace {
std::string message_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const invalid_argument& e) {
    return e.what();
  }
  return "(no error)";
}

// A datum of three tokens carrying every loss input but `missing` (routes aside).
Datum datum_without(std::string_view missing) {
  Datum d;
  d.model_input = ModelInput::from_tokens({1, 2, 3});
  for (std::string_view key : kLossInputs) {
    if (key == missing || key == "routed_experts") continue;
    d.loss_fn_inputs[std::string(key)] = key == "target_tokens" ? TensorData::from_ints({2, 3, 4})
                                                                : TensorData::from_floats({0.5f, 0.5f, 0.5f});
  }
  return d;
}
}  // namespace

TEST(LossTable, OneRowPerLossInTheEnumsOrder) {
  // The eight losses of today, by name; a ninth enumerator makes this (and the static_asserts) change.
  ASSERT_EQ(kLossCount, 8u);
  const std::vector<std::string> names{"cross_entropy", "importance_sampling", "ppo",  "cispo",
                                       "dro",           "value",               "gspo", "stable_reinforce"};
  for (std::size_t i = 0; i < kLossCount; ++i) {
    const auto fn = static_cast<LossFn>(i);
    EXPECT_EQ(kLosses[i].fn, fn);
    EXPECT_EQ(to_string(fn), names[i]);
    EXPECT_EQ(loss_fn_from_string(names[i]), fn);
    EXPECT_EQ(&loss_info(fn), &kLosses[i]);
  }
  EXPECT_EQ(message_of([] { loss_fn_from_string("kto"); }),
            "unknown loss function 'kto' (expected cross_entropy, importance_sampling, ppo, cispo, dro, value, "
            "gspo or stable_reinforce)");
  // An integer cast to LossFn that names no loss: no row is read past the table's end.
  EXPECT_STREQ(to_string(static_cast<LossFn>(8)), "?");
  EXPECT_EQ(message_of([] { loss_info(static_cast<LossFn>(42)); }), "LossSpec::fn 42 is no loss function");
  EXPECT_EQ(message_of([] { LossSpec{static_cast<LossFn>(-1)}.validate(); }),
            "LossSpec::fn " + std::to_string(static_cast<std::size_t>(-1)) + " is no loss function");
}

TEST(LossTable, WhatEachLossReadsAndReports) {
  // Parameters: the clip range (ppo, cispo), beta (dro), value_clip (value).
  auto params = [](LossFn f) {
    std::vector<std::string> out;
    for (const LossParamInfo& p : kLossParams)
      if (reads_param(f, p.member)) out.emplace_back(p.name);
    return out;
  };
  using strings = std::vector<std::string>;
  EXPECT_EQ(params(LossFn::cross_entropy), strings{});
  EXPECT_EQ(params(LossFn::importance_sampling), strings{});
  EXPECT_EQ(params(LossFn::ppo), (strings{"epsilon_low", "epsilon_high"}));
  EXPECT_EQ(params(LossFn::cispo), (strings{"epsilon_low", "epsilon_high"}));
  EXPECT_EQ(params(LossFn::gspo), (strings{"epsilon_low", "epsilon_high"}));
  EXPECT_EQ(params(LossFn::dro), strings{"beta"});
  EXPECT_EQ(params(LossFn::value), strings{"value_clip"});
  EXPECT_EQ(params(LossFn::stable_reinforce), (strings{"truncation", "kl_coeff"}));
  // The clip metric and the policy flag the engine and the service metrics read.
  EXPECT_EQ(loss_info(LossFn::ppo).clip_metric, "clip_fraction");
  EXPECT_EQ(loss_info(LossFn::cispo).clip_metric, "clip_fraction");
  EXPECT_EQ(loss_info(LossFn::gspo).clip_metric, "clip_fraction");
  EXPECT_EQ(loss_info(LossFn::stable_reinforce).clip_metric, "clip_fraction");
  EXPECT_EQ(loss_info(LossFn::value).clip_metric, "value_clip_fraction");
  EXPECT_TRUE(loss_info(LossFn::dro).clip_metric.empty());
  std::set<std::string> policy;
  for (const LossInfo& row : kLosses)
    if (row.policy) policy.emplace(row.name);
  EXPECT_EQ(policy,
            (std::set<std::string>{"importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce"}));
  EXPECT_EQ(loss_info(LossFn::value).output, LossOutput::values);
  EXPECT_EQ(loss_info(LossFn::dro).output, LossOutput::logprobs);
}

TEST(LossTable, ValidateChecksEveryParameterAgainstItsBounds) {
  EXPECT_NO_THROW(LossSpec::ppo(1.0, 9.0).validate());
  EXPECT_NO_THROW(LossSpec::dro(0.0).validate());
  EXPECT_EQ(message_of([] { LossSpec::ppo(-0.1).validate(); }),
            "LossSpec::epsilon_low must be in [0, 1], got -0.100000");
  EXPECT_EQ(message_of([] { LossSpec::cispo(0.2, 9.5).validate(); }),
            "LossSpec::epsilon_high must be in [0, 9], got 9.500000");
  EXPECT_EQ(message_of([] { LossSpec::dro(-1.0).validate(); }), "LossSpec::beta must be a finite number >= 0, got "
                                                                "-1.000000");
  EXPECT_EQ(message_of([] { LossSpec::value(std::numeric_limits<double>::infinity()).validate(); }),
            "LossSpec::value_clip must be a finite number >= 0, got inf");
  // A parameter the loss does not read is checked all the same: a spec is valid as a whole.
  EXPECT_EQ(message_of([] { LossSpec{.fn = LossFn::cross_entropy, .beta = -2.0}.validate(); }),
            "LossSpec::beta must be a finite number >= 0, got -2.000000");
}

// validate_batch reads each loss's required inputs from its row: dropping any one of them is an error that names
// the loss and the input; dropping an optional one is not.
TEST(LossTable, EveryRequiredInputIsRequiredAndNoOther) {
  for (const LossInfo& row : kLosses) {
    const std::vector<Datum> full{datum_without("")};
    EXPECT_NO_THROW(validate_batch(full, row.fn, 10)) << row.name;
    for (std::string_view key : kLossInputs) {
      const std::vector<Datum> batch{datum_without(key)};
      bool required = false;
      for (std::string_view r : row.required_inputs) required = required || r == key;
      if (required)
        EXPECT_EQ(message_of([&] { validate_batch(batch, row.fn, 10); }),
                  "datum 0: loss '" + std::string(row.name) + "' needs loss input '" + std::string(key) + "'");
      else
        EXPECT_NO_THROW(validate_batch(batch, row.fn, 10)) << row.name << " without " << key;
    }
  }
  // The table's lists, spelled out for two of them.
  EXPECT_EQ(message_of([] { validate_batch(std::vector<Datum>{datum_without("returns")}, LossFn::value, 10); }),
            "datum 0: loss 'value' needs loss input 'returns'");
  EXPECT_EQ(
      message_of([] { validate_batch(std::vector<Datum>{datum_without("logprobs")}, LossFn::cispo, 10); }),
      "datum 0: loss 'cispo' needs loss input 'logprobs'");
  EXPECT_TRUE(is_known_loss_input("old_values"));
  EXPECT_FALSE(is_known_loss_input("mask"));
}
