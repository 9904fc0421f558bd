// The checks every backend applies to a batch before touching a model, so a bad datum is rejected with the same
// message locally, in the remote client and in the server: model inputs, loss inputs (the keys each loss requires:
// its row of kLosses, rlloop/loss.hpp), routes for routing replay.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <rlloop/error.hpp>
#include <rlloop/loss.hpp>
#include <rlloop/types.hpp>

namespace rlloop {

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
inline void validate_batch(std::span<const Datum> data, std::span<const std::string_view> required_inputs,
                           std::string_view loss_name, std::int64_t vocab_size,
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
    for (std::string_view key : required_inputs)
      if (!d.loss_fn_inputs.count(std::string(key)))
        throw invalid_argument(where + "loss '" + std::string(loss_name) + "' needs loss input '" + std::string(key) +
                               "'");
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
  const LossInfo& info = loss_info(loss);
  validate_batch(data, info.required_inputs, info.name, vocab_size, experts);
}

// Checks a batch for forward_backward_custom: only target_tokens are required.
inline void validate_custom_batch(std::span<const Datum> data, std::int64_t vocab_size,
                                  const std::optional<ExpertShape>& experts = std::nullopt) {
  static constexpr std::string_view kTargets[] = {"target_tokens"};
  validate_batch(data, kTargets, "custom", vocab_size, experts);
}

}  // namespace rlloop
