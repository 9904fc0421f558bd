// Loss specifications and the validation every backend applies before touching a model, so a bad datum is
// rejected with the same message locally, in the remote client and in the server.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <rlloop/error.hpp>
#include <rlloop/types.hpp>

namespace rlloop {

// The built-in losses. All are summed over tokens, never averaged. `value` is the critic's
// regression loss for PPO with a value head (an rlloop extension, local sessions created with value_head).
enum class LossFn { cross_entropy, importance_sampling, ppo, cispo, dro, value };

inline const char* to_string(LossFn f) {
  switch (f) {
    case LossFn::cross_entropy:
      return "cross_entropy";
    case LossFn::importance_sampling:
      return "importance_sampling";
    case LossFn::ppo:
      return "ppo";
    case LossFn::cispo:
      return "cispo";
    case LossFn::dro:
      return "dro";
    case LossFn::value:
      return "value";
  }
  return "?";
}

inline LossFn loss_fn_from_string(std::string_view name) {
  for (LossFn f :
       {LossFn::cross_entropy, LossFn::importance_sampling, LossFn::ppo, LossFn::cispo, LossFn::dro, LossFn::value})
    if (name == to_string(f)) return f;
  throw invalid_argument("unknown loss function '" + std::string(name) +
                         "' (expected cross_entropy, importance_sampling, ppo, cispo, dro or value)");
}

// A loss with its configuration. ppo and cispo clip the ratio r = exp(lp - q) to [1 - epsilon_low,
// 1 + epsilon_high] (PPO's epsilon; asymmetric in DAPO), the convention of the algorithm options too; beta weights
// the quadratic penalty of dro; value_clip bounds how far a new value may move from "old_values" in the value
// loss (0 = no clipping).
//
// The wire (docs/wire.md) configures the clip by its bounds instead: lossFnConfig's clip_low_threshold =
// 1 - epsilon_low and clip_high_threshold = 1 + epsilon_high; parse() and config() translate. For bounds in
// [0.5, 2] both subtractions are exact (Sterbenz's lemma), so min_ratio() / max_ratio() on the receiving side
// equal the bounds sent, bit for bit.
struct LossSpec {
  LossFn fn = LossFn::cross_entropy;
  double epsilon_low = 0.2;
  double epsilon_high = 0.2;
  double beta = 0.1;
  double value_clip = 0.2;

  static LossSpec cross_entropy() { return {LossFn::cross_entropy}; }
  static LossSpec importance_sampling() { return {LossFn::importance_sampling}; }
  static LossSpec ppo(double epsilon_low = 0.2, double epsilon_high = 0.2) {
    return {LossFn::ppo, epsilon_low, epsilon_high};
  }
  static LossSpec cispo(double epsilon_low = 0.2, double epsilon_high = 0.2) {
    return {LossFn::cispo, epsilon_low, epsilon_high};
  }
  static LossSpec dro(double beta = 0.1) { return {.fn = LossFn::dro, .beta = beta}; }
  // 0.5 * sum(w * max((v - R)^2, (v_clip - R)^2)), v_clip = old + clamp(v - old, -clip, clip) when "old_values"
  // are given; inputs "returns" (R), optional "old_values", optional "weights".
  static LossSpec value(double clip = 0.2) { return {.fn = LossFn::value, .value_clip = clip}; }

  // The clip range of the ratio.
  double min_ratio() const { return 1.0 - epsilon_low; }
  double max_ratio() const { return 1.0 + epsilon_high; }

  // Config keys each loss accepts (the wire's lossFnConfig).
  static std::vector<std::string> config_keys(LossFn f) {
    switch (f) {
      case LossFn::ppo:
      case LossFn::cispo:
        return {"clip_low_threshold", "clip_high_threshold"};
      case LossFn::dro:
        return {"beta"};
      case LossFn::value:
        return {"value_clip"};
      default:
        return {};
    }
  }

  // Builds a spec from a name and a wire lossFnConfig; unknown names, keys or out-of-range values throw, naming
  // the wire's key.
  static LossSpec parse(std::string_view name, const std::map<std::string, double>& config = {}) {
    LossSpec s;
    s.fn = loss_fn_from_string(name);
    const auto keys = config_keys(s.fn);
    for (const auto& [key, value] : config) {
      bool known = false;
      for (const auto& k : keys) known = known || k == key;
      if (!known) throw invalid_argument("loss '" + std::string(name) + "' does not accept config key '" + key + "'");
      if (!std::isfinite(value)) throw invalid_argument("loss config '" + key + "' is not a finite number");
      if (key == "clip_low_threshold") {
        if (!(value >= 0.0 && value <= 1.0))
          throw invalid_argument("clip_low_threshold must be in [0, 1], got " + std::to_string(value));
        s.epsilon_low = 1.0 - value;
      }
      if (key == "clip_high_threshold") {
        if (!(value >= 1.0 && value <= 10.0))
          throw invalid_argument("clip_high_threshold must be in [1, 10], got " + std::to_string(value));
        s.epsilon_high = value - 1.0;
      }
      if (key == "beta") s.beta = value;
      if (key == "value_clip") s.value_clip = value;
    }
    s.validate();
    return s;
  }

  // The wire's lossFnConfig for this spec.
  std::map<std::string, double> config() const {
    switch (fn) {
      case LossFn::ppo:
      case LossFn::cispo:
        return {{"clip_low_threshold", min_ratio()}, {"clip_high_threshold", max_ratio()}};
      case LossFn::dro:
        return {{"beta", beta}};
      case LossFn::value:
        return {{"value_clip", value_clip}};
      default:
        return {};
    }
  }

  void validate() const {
    if (!(epsilon_low >= 0.0 && epsilon_low <= 1.0))
      throw invalid_argument("LossSpec::epsilon_low must be in [0, 1], got " + std::to_string(epsilon_low));
    if (!(epsilon_high >= 0.0 && epsilon_high <= 9.0))
      throw invalid_argument("LossSpec::epsilon_high must be in [0, 9], got " + std::to_string(epsilon_high));
    if (!(beta >= 0.0 && std::isfinite(beta))) throw invalid_argument("dro beta must be a finite number >= 0");
    if (!(value_clip >= 0.0 && std::isfinite(value_clip)))
      throw invalid_argument("value_clip must be a finite number >= 0, got " + std::to_string(value_clip));
  }

  // Loss inputs each loss requires; "weights" is optional for the RL losses (defaults to 1 per token).
  static std::vector<std::string> required_inputs(LossFn f) {
    if (f == LossFn::cross_entropy) return {"target_tokens", "weights"};
    if (f == LossFn::value) return {"returns"};
    return {"target_tokens", "advantages", "logprobs"};
  }
  bool operator==(const LossSpec&) const = default;
};

// Every loss input key the wire protocol accepts. All are per token ([tokens]) but "routed_experts", the experts
// each token is routed to for routing replay: int64 [tokens, sparse layers, experts per token].
inline bool is_known_loss_input(std::string_view key) {
  for (std::string_view k : {"target_tokens", "weights", "advantages", "logprobs", "ref_log_prob", "temperature",
                             "returns", "old_values", "routed_experts"})
    if (key == k) return true;
  return false;
}

namespace detail {
inline std::string datum_where(std::size_t index) { return "datum " + std::to_string(index) + ": "; }
}  // namespace detail

// Checks one model input: non-empty and every id in [0, vocab_size).
inline void validate_model_input(const ModelInput& input, std::int64_t vocab_size, const std::string& where = "") {
  if (input.length() == 0) throw invalid_argument(where + "model input is empty");
  std::size_t pos = 0;
  for (const auto& chunk : input.chunks)
    for (token_id t : chunk.tokens) {
      if (t < 0 || t >= vocab_size)
        throw invalid_argument(where + "token id " + std::to_string(t) + " at position " + std::to_string(pos) +
                               " is out of range [0, " + std::to_string(vocab_size) + ")");
      ++pos;
    }
}

// Checks the routes of a batch (loss input "routed_experts", routing replay): every datum carries them or none
// does (a forward routes all its tokens one way), each int64 [tokens, sparse layers, k] with k distinct expert ids
// per token and layer. `experts` is the model's shape when known (nullopt: not checked against it; a dense model
// takes no routes).
inline void validate_routes(std::span<const Datum> data, const std::optional<ExpertShape>& experts) {
  if (data.empty()) return;
  const std::string key = "routed_experts";
  const bool first = data.front().loss_fn_inputs.count(key) > 0;
  for (std::size_t i = 0; i < data.size(); ++i) {
    const std::string where = detail::datum_where(i);
    auto it = data[i].loss_fn_inputs.find(key);
    if ((it != data[i].loss_fn_inputs.end()) != first)
      throw invalid_argument(where + "loss input 'routed_experts' is " + (first ? "missing" : "given") +
                             " but datum 0's is " + (first ? "given" : "missing") +
                             " (routing replay routes every datum of a batch or none)");
    if (it == data[i].loss_fn_inputs.end()) continue;
    if (experts && !experts->any())
      throw invalid_argument(where + "loss input 'routed_experts': the model has no experts to route to");
    const TensorData& t = it->second;
    const auto n = static_cast<std::int64_t>(data[i].model_input.length());
    std::string shape;
    for (std::int64_t s : t.shape) shape += (shape.empty() ? "" : ", ") + std::to_string(s);
    if (t.dtype != DType::int64 || t.shape.size() != 3 || t.shape[0] != n)
      throw invalid_argument(where + "loss input 'routed_experts' must be int64 [tokens = " + std::to_string(n) +
                             ", sparse layers, experts per token], got " + to_string(t.dtype) + " [" + shape + "]");
    const std::int64_t layers = t.shape[1], k = t.shape[2];
    if (layers < 1 || k < 1)
      throw invalid_argument(where + "loss input 'routed_experts' is [" + shape + "]: no sparse layer or expert");
    if (experts && (layers != experts->sparse_layers || k != experts->experts_per_token))
      throw invalid_argument(where + "loss input 'routed_experts' is [" + shape + "] but the model routes each token " +
                             "to " + std::to_string(experts->experts_per_token) + " experts in " +
                             std::to_string(experts->sparse_layers) + " sparse layers");
    // A TensorData made in C++ need not hold what its shape says (the wire reader checks that itself).
    std::int64_t rows = 0, count = 0;
    if (__builtin_mul_overflow(n, layers, &rows) || __builtin_mul_overflow(rows, k, &count) ||
        static_cast<std::int64_t>(t.int_data.size()) != count)
      throw invalid_argument(where + "loss input 'routed_experts' holds " + std::to_string(t.int_data.size()) +
                             " values, not the product of its shape [" + shape + "]");
    for (std::int64_t row = 0; row < n * layers; ++row) {
      const std::int64_t* ids = t.int_data.data() + row * k;
      for (std::int64_t j = 0; j < k; ++j) {
        const bool out_of_range = ids[j] < 0 || (experts && ids[j] >= experts->num_experts);
        const bool twice = !out_of_range && std::find(ids, ids + j, ids[j]) != ids + j;
        if (!out_of_range && !twice) continue;
        const std::string at =
            " at token " + std::to_string(row / layers) + ", sparse layer " + std::to_string(row % layers);
        if (out_of_range)
          throw invalid_argument(where + "loss input 'routed_experts': expert id " + std::to_string(ids[j]) + at +
                                 " is out of range [0, " +
                                 (experts ? std::to_string(experts->num_experts) : std::string("experts")) + ")");
        throw invalid_argument(where + "loss input 'routed_experts': expert " + std::to_string(ids[j]) +
                               " is given twice" + at);
      }
    }
  }
}

// Checks a batch before anything runs: shapes, the required loss-input keys, ids and finite values; routes against
// the model's experts when `experts` is given.
inline void validate_batch(std::span<const Datum> data, const std::vector<std::string>& required_inputs,
                           const std::string& loss_name, std::int64_t vocab_size,
                           const std::optional<ExpertShape>& experts = std::nullopt) {
  if (data.empty()) throw invalid_argument("the batch holds no datum");
  validate_routes(data, experts);
  for (std::size_t i = 0; i < data.size(); ++i) {
    const Datum& d = data[i];
    const std::string where = detail::datum_where(i);
    validate_model_input(d.model_input, vocab_size, where);
    const std::size_t n = d.model_input.length();
    for (const auto& [key, tensor] : d.loss_fn_inputs) {
      if (!is_known_loss_input(key)) throw invalid_argument(where + "unknown loss input '" + key + "'");
      if (key == "routed_experts") continue;  // validate_routes
      if (tensor.size() != n)
        throw invalid_argument(where + "loss input '" + key + "' has " + std::to_string(tensor.size()) +
                               " values but the model input has " + std::to_string(n) + " tokens");
      if (tensor.dtype == DType::float32)
        for (std::size_t j = 0; j < tensor.float_data.size(); ++j)
          if (!std::isfinite(tensor.float_data[j]))
            throw invalid_argument(where + "loss input '" + key + "' holds a non-finite value at position " +
                                   std::to_string(j));
    }
    for (const auto& key : required_inputs)
      if (!d.loss_fn_inputs.count(key))
        throw invalid_argument(where + "loss '" + loss_name + "' needs loss input '" + key + "'");
    if (auto it = d.loss_fn_inputs.find("target_tokens"); it != d.loss_fn_inputs.end()) {
      const auto targets = it->second.as_doubles();
      for (std::size_t j = 0; j < targets.size(); ++j)
        if (targets[j] < 0 || targets[j] >= static_cast<double>(vocab_size) || targets[j] != std::floor(targets[j]))
          throw invalid_argument(where + "target token " + std::to_string(static_cast<long long>(targets[j])) +
                                 " at position " + std::to_string(j) + " is out of range [0, " +
                                 std::to_string(vocab_size) + ")");
    }
  }
}

// Checks a batch against a built-in loss.
inline void validate_batch(std::span<const Datum> data, LossFn loss, std::int64_t vocab_size,
                           const std::optional<ExpertShape>& experts = std::nullopt) {
  validate_batch(data, LossSpec::required_inputs(loss), to_string(loss), vocab_size, experts);
}

// Checks a batch for forward_backward_custom: only target_tokens are required.
inline void validate_custom_batch(std::span<const Datum> data, std::int64_t vocab_size,
                                  const std::optional<ExpertShape>& experts = std::nullopt) {
  validate_batch(data, {"target_tokens"}, "custom", vocab_size, experts);
}

}  // namespace rlloop
