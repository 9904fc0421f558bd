#include "wire/loss_config.hpp"

#include <algorithm>
#include <cmath>

#include <rlloop/error.hpp>

namespace rlloop::wire {

namespace {
const LossConfigKey* find_key(std::string_view key) {
  for (const LossConfigKey& k : kLossConfigKeys)
    if (k.key == key) return &k;
  return nullptr;
}

// The parameter's row of kLossParams; kLossConfigKeys follows its order.
const LossParamInfo& param_of(const LossConfigKey& k) {
  return kLossParams[static_cast<std::size_t>(&k - kLossConfigKeys.data())];
}

void check_bounds(const LossConfigKey& k, double value) {
  const LossParamInfo& p = param_of(k);
  const double a = k.to_wire(p.lo), b = k.to_wire(p.hi);
  const double lo = std::min(a, b), hi = std::max(a, b);
  if (!(value >= lo && value <= hi))
    throw invalid_argument(std::string(k.key) + " must be " + rlloop::detail::describe_bounds(lo, hi) + ", got " +
                           std::to_string(value));
}
}  // namespace

std::vector<std::string> loss_config_keys(LossFn fn) {
  std::vector<std::string> keys;
  for (const LossConfigKey& k : kLossConfigKeys)
    if (reads_param(fn, k.param)) keys.emplace_back(k.key);
  return keys;
}

LossSpec loss_from_config(std::string_view name, const std::map<std::string, double>& config) {
  LossSpec s;
  s.fn = loss_fn_from_string(name);
  for (const auto& [key, value] : config) {
    const LossConfigKey* k = find_key(key);
    if (!k || !reads_param(s.fn, k->param))
      throw invalid_argument("loss '" + std::string(name) + "' does not accept config key '" + key + "'");
    if (!std::isfinite(value)) throw invalid_argument("loss config '" + key + "' is not a finite number");
    check_bounds(*k, value);
    s.*(k->param) = k->to_spec(value);
  }
  s.validate();
  return s;
}

std::map<std::string, double> loss_config(const LossSpec& spec) {
  std::map<std::string, double> config;
  for (const LossConfigKey& k : kLossConfigKeys)
    if (reads_param(spec.fn, k.param)) config[std::string(k.key)] = k.to_wire(spec.*(k.param));
  return config;
}

}  // namespace rlloop::wire
