// Shared helpers for the LocalSession tests: byte-level data and small comparisons.
#pragma once
#include <string>
#include <vector>

#include <rlloop/local.hpp>
#include <rlloop/rlloop.hpp>

namespace test_util {
using namespace rlloop;

inline std::vector<token_id> bytes(const std::string& s) {
  std::vector<token_id> out;
  for (unsigned char c : s) out.push_back(c);
  return out;
}

// Next-token SFT example over the whole text: input = text[:-1], target = text[1:], weight 1.
inline Datum sft_datum(const std::string& text) {
  auto t = bytes(text);
  Datum d;
  d.model_input = ModelInput::from_tokens(std::vector<token_id>(t.begin(), t.end() - 1));
  d.loss_fn_inputs["target_tokens"] = TensorData::from_tokens(std::vector<token_id>(t.begin() + 1, t.end()));
  d.loss_fn_inputs["weights"] = TensorData::from_floats(std::vector<float>(t.size() - 1, 1.0f));
  return d;
}

inline SessionOptions tiny(std::optional<LoraOptions> lora = std::nullopt, std::int64_t seed = 0) {
  SessionOptions o;
  o.base_model = "rlloop-tiny";
  o.lora = std::move(lora);
  o.seed = seed;
  return o;
}

inline LocalServiceOptions service_in(const std::string& dir) {
  LocalServiceOptions s;
  s.checkpoint_dir = dir;
  s.device = "cpu";
  s.num_threads = 1;  // bit-exact comparisons across processes need the same reduction order
  return s;
}

}  // namespace test_util
