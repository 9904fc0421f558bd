// A loss on the wire (docs/wire.md): lossFnName is its name in kLosses (rlloop/loss.hpp), lossFnConfig sets its
// parameters by the keys below. This table is the only place that knows those keys: a loss that reads a parameter
// accepts that parameter's key, so adding a loss over existing parameters adds nothing here.
#pragma once
#include <array>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include <rlloop/loss.hpp>

namespace rlloop::wire {

// One key of lossFnConfig: the LossSpec parameter it sets and the translation between the wire's convention and
// the spec's. The key's bounds are the parameter's (kLossParams) carried through to_wire.
struct LossConfigKey {
  std::string_view key;
  LossParam param;
  double (*to_spec)(double wire);
  double (*to_wire)(double spec);
};

namespace detail {
constexpr double same(double v) { return v; }
constexpr double one_minus(double v) { return 1.0 - v; }  // clip_low_threshold = 1 - epsilon_low, and back
constexpr double plus_one(double v) { return 1.0 + v; }   // clip_high_threshold = 1 + epsilon_high
constexpr double minus_one(double v) { return v - 1.0; }
}  // namespace detail

// One key per parameter, in kLossParams' order (checked below).
inline constexpr std::array<LossConfigKey, kLossParams.size()> kLossConfigKeys{{
    {"clip_low_threshold", &LossSpec::epsilon_low, detail::one_minus, detail::one_minus},
    {"clip_high_threshold", &LossSpec::epsilon_high, detail::minus_one, detail::plus_one},
    {"beta", &LossSpec::beta, detail::same, detail::same},
    {"value_clip", &LossSpec::value_clip, detail::same, detail::same},
    {"truncation", &LossSpec::truncation, detail::same, detail::same},
    {"kl_coeff", &LossSpec::kl_coeff, detail::same, detail::same},
}};

namespace detail {
constexpr bool keys_follow_the_params() {
  for (std::size_t i = 0; i < kLossConfigKeys.size(); ++i)
    if (kLossConfigKeys[i].param != kLossParams[i].member || kLossConfigKeys[i].key.empty()) return false;
  return true;
}
}  // namespace detail
static_assert(detail::keys_follow_the_params(), "kLossConfigKeys: row i is the key of kLossParams[i]");

// The keys loss `fn` accepts, in kLossParams' order.
std::vector<std::string> loss_config_keys(LossFn fn);

// The spec a request names. An unknown name or key, a value that is not finite or outside the key's bounds throws
// invalid_argument naming the wire's key ("clip_low_threshold must be in [0, 1], got 2.000000").
LossSpec loss_from_config(std::string_view name, const std::map<std::string, double>& config = {});

// The lossFnConfig of a spec: the keys of the parameters its loss reads (none: an empty map).
std::map<std::string, double> loss_config(const LossSpec& spec);

}  // namespace rlloop::wire
