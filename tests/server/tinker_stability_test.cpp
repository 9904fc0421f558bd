// StabilityRecords (src/server/tinker_stability.hpp) on its own: what a stable_reinforce request's datums become,
// every refusal with its message, hostile offsets, expiry, the per-session cap and a finished session's records.
#include <gtest/gtest.h>

#include <limits>
#include <memory>
#include <string>

#include "server/tinker_stability.hpp"
#include "wire/tinker/codec.hpp"

using namespace rlloop;
using rlloop::server::StabilityRecords;
namespace tk = rlloop::wire::tinker;

namespace {
// One sampled sequence of request "future-1": prompt {10, 11, 12}, sampled {20, 21} with logprobs -0.5, -1.5.
std::shared_ptr<SampleResponse> one_sample() {
  auto r = std::make_shared<SampleResponse>();
  SampledSequence s;
  s.tokens = {20, 21};
  s.logprobs = {-0.5, -1.5};
  r->sequences.push_back(s);
  return r;
}

// The cookbook's datum of that sequence: input prompt + sampled[:-1], targets shifted by one, provenance of both.
tk::ForwardBackwardCall call_for(const std::string& sequence_id) {
  tk::ForwardBackwardCall call;
  Datum d;
  d.model_input = ModelInput::from_tokens({10, 11, 12, 20});
  d.loss_fn_inputs["target_tokens"] = TensorData::from_ints({11, 12, 20, 21});
  d.loss_fn_inputs["advantages"] = TensorData::from_floats({0.0f, 0.0f, 2.0f, 2.0f});
  d.loss_fn_inputs["logprobs"] = TensorData::from_floats({9.0f, 9.0f, 9.0f, 9.0f});  // replaced by the record's
  call.data.push_back(d);
  call.provenance.push_back({{{sequence_id, false, 0, 3}, {sequence_id, true, 0, 1}},
                             {{sequence_id, false, 1, 2}, {sequence_id, true, 0, 2}}});
  call.loss = LossSpec::stable_reinforce();
  return call;
}

std::string refusal(StabilityRecords& records, const std::string& session, tk::ForwardBackwardCall call,
                    double now = 100) {
  try {
    records.apply(session, call, now);
  } catch (const invalid_argument& e) {
    return e.what();
  }
  return "(accepted)";
}
}  // namespace

TEST(TinkerStability, ADatumReadsTheRecordedLogprobsAndItsPromptBearsNoLoss) {
  StabilityRecords records;
  records.expect("s1", "future-1", {10, 11, 12}, 100);
  records.complete("future-1", one_sample());
  auto call = call_for("future-1-0");
  records.apply("s1", call, 100);
  const auto& inputs = call.data[0].loss_fn_inputs;
  EXPECT_EQ(inputs.at("logprobs").float_data, (std::vector<float>{0.0f, 0.0f, -0.5f, -1.5f}));
  EXPECT_EQ(inputs.at("weights").float_data, (std::vector<float>{0.0f, 0.0f, 1.0f, 1.0f}));
  EXPECT_EQ(inputs.at("advantages").float_data, (std::vector<float>{0.0f, 0.0f, 2.0f, 2.0f}));  // untouched
  // Given weights are kept on the sampled positions.
  auto weighted = call_for("future-1-0");
  weighted.data[0].loss_fn_inputs["weights"] = TensorData::from_floats({1.0f, 1.0f, 0.5f, 0.25f});
  records.apply("s1", weighted, 100);
  EXPECT_EQ(weighted.data[0].loss_fn_inputs.at("weights").float_data, (std::vector<float>{0.0f, 0.0f, 0.5f, 0.25f}));
}

TEST(TinkerStability, EveryRefusalNamesTheDatumAndWhatIsWrong) {
  StabilityRecords records;
  records.expect("s1", "future-1", {10, 11, 12}, 100);
  records.expect("s1", "future-2", {10}, 100);  // still sampling
  records.complete("future-1", one_sample());
  EXPECT_EQ(refusal(records, "s1", call_for("future-2-0")), "data[0].model_input[0]: sequence 'future-2-0' is still "
                                                            "being sampled");
  EXPECT_NE(refusal(records, "s2", call_for("future-1-0"))
                .find("sequence 'future-1-0' was not recorded in this session"),
            std::string::npos);
  EXPECT_NE(refusal(records, "s1", call_for("nonsense")).find("was not recorded"), std::string::npos);
  EXPECT_EQ(refusal(records, "s1", call_for("future-1-3")),
            "data[0].model_input[0]: sequence 'future-1-3' does not exist: its request sampled 1");
  auto no_provenance = call_for("future-1-0");
  no_provenance.provenance[0] = {};
  EXPECT_NE(refusal(records, "s1", no_provenance).find("data[0]: stable_reinforce needs the datum's provenance"),
            std::string::npos);
  auto shifted = call_for("future-1-0");
  shifted.data[0].loss_fn_inputs["target_tokens"] = TensorData::from_ints({11, 12, 21, 21});
  EXPECT_EQ(refusal(records, "s1", shifted), "data[0].loss_fn_inputs.target_tokens[2] is token 21, but position 0 "
                                             "of the sampled tokens of sequence 'future-1-0' is token 20");
  auto on_prompt = call_for("future-1-0");
  on_prompt.data[0].loss_fn_inputs["advantages"] = TensorData::from_floats({0.0f, 1.0f, 2.0f, 2.0f});
  EXPECT_EQ(refusal(records, "s1", on_prompt),
            "data[0].loss_fn_inputs.advantages[1] is nonzero on a prompt token: stable_reinforce trains only on "
            "sampled tokens");
  // Offsets past the sequence, including one that would wrap offset + length around.
  for (std::int64_t offset : {std::int64_t{2}, std::numeric_limits<std::int64_t>::max()}) {
    auto hostile = call_for("future-1-0");
    hostile.provenance[0].targets[1].offset = offset;
    EXPECT_NE(refusal(records, "s1", hostile).find("of the sampled tokens of sequence 'future-1-0', which has 2"),
              std::string::npos);
  }
  // A refused request changes no datum.
  auto two = call_for("future-1-0");
  two.data.push_back(shifted.data[0]);
  two.provenance.push_back(shifted.provenance[0]);
  refusal(records, "s1", two);
  EXPECT_EQ(two.data[0].loss_fn_inputs.at("logprobs").float_data, (std::vector<float>(4, 9.0f)));
  EXPECT_EQ(two.data[0].loss_fn_inputs.count("weights"), 0u);
  // A failed sample.
  records.expect("s1", "future-3", {10}, 100);
  records.complete("future-3", nullptr);
  EXPECT_NE(refusal(records, "s1", call_for("future-3-0")).find("the sample of sequence 'future-3-0' failed"),
            std::string::npos);
}

TEST(TinkerStability, RecordsExpireADayAfterTheirLastUseAndGoWithTheirSession) {
  StabilityRecords records;
  records.expect("s1", "future-1", {10, 11, 12}, 0);
  records.complete("future-1", one_sample());
  const double day = StabilityRecords::kLifetimeSeconds;
  EXPECT_EQ(refusal(records, "s1", call_for("future-1-0"), day - 10), "(accepted)");  // its use restarts the day
  records.expect("s1", "future-9", {10}, 1.5 * day);  // a new sample looks for expired records
  EXPECT_EQ(refusal(records, "s1", call_for("future-1-0"), 1.5 * day), "(accepted)");
  records.expect("s1", "future-10", {10}, 3 * day);
  EXPECT_NE(refusal(records, "s1", call_for("future-1-0"), 3 * day).find("was not recorded"), std::string::npos);
  records.expect("s2", "future-11", {10, 11, 12}, 3 * day);
  records.complete("future-11", one_sample());
  records.drop("s2");
  EXPECT_NE(refusal(records, "s2", call_for("future-11-0"), 3 * day).find("was not recorded"), std::string::npos);
}

TEST(TinkerStability, ASessionOverItsCapLosesItsLeastRecentlyUsedRecords) {
  StabilityRecords records;
  // Each record holds half the cap (its prompt and two sampled tokens): two fill it, the third pushes the least
  // recently used one out.
  const std::vector<token_id> half(static_cast<std::size_t>(StabilityRecords::kMaxTokensPerSession / 2) - 2, 10);
  for (int i = 1; i <= 3; ++i) {
    records.expect("s1", "future-" + std::to_string(i), half, 100 + i);
    records.complete("future-" + std::to_string(i), one_sample());
  }
  // A datum over the second sampled token only: input {20}, target {21}.
  auto uses = [&](int i) {
    const std::string id = "future-" + std::to_string(i) + "-0";
    tk::ForwardBackwardCall call;
    Datum d;
    d.model_input = ModelInput::from_tokens({20});
    d.loss_fn_inputs["target_tokens"] = TensorData::from_ints({21});
    d.loss_fn_inputs["advantages"] = TensorData::from_floats({1.0f});
    call.data.push_back(d);
    tk::Provenance p;
    p.model_input.push_back({id, true, 0, 1});
    p.targets.push_back({id, true, 1, 1});
    call.provenance.push_back(p);
    return refusal(records, "s1", call, 200);
  };
  EXPECT_NE(uses(1).find("was not recorded"), std::string::npos);
  EXPECT_EQ(uses(2), "(accepted)");
  EXPECT_EQ(uses(3), "(accepted)");
}
