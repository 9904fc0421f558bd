// The built-in losses and their specifications, described once: `kLosses` holds one row per loss (its name, the
// LossSpec parameters it reads and their bounds, the loss inputs it needs, the metrics it reports, the model output
// it is computed on), and every layer reads that row instead of keeping its own list: batch validation
// (rlloop/batch_checks.hpp), the engine's dispatch (src/engine/runtime/loss.cpp: one function per row, where the formulas
// are), the wire (src/wire/loss_config.hpp: the only place that knows lossFnConfig's key names), the service
// metrics. Adding a loss: docs/algorithms.md, "Adding a loss".
#pragma once
#include <array>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include <rlloop/error.hpp>

namespace rlloop {

// The built-in losses. All are summed over tokens, never averaged. `value` is the critic's regression loss for PPO
// with a value head (an rlloop extension, local sessions created with value_head). `gspo` is GSPO-token (Zheng et
// al. 2025, "Group Sequence Policy Optimization"): PPO's clipped objective on each token with the ratio of its whole
// sequence (the datum) in place of its own. `stable_reinforce` is rlloop's reading of Tinker's loss of that name,
// whose objective Tinker has not published (docs/algorithms.md, "stable_reinforce"): REINFORCE with the truncated
// importance weight min(r, C) of Yao et al. 2025 ("truncated importance sampling") and an optional KL penalty
// towards the sampler.
enum class LossFn { cross_entropy, importance_sampling, ppo, cispo, dro, value, gspo, stable_reinforce };

namespace detail {
// The number of LossFn's enumerators. The switch names each one and has no default, so -Wswitch (in -Wall; an error
// under RLLOOP_WERROR, as CI builds) stops the build at a new enumerator until it is named here; the tables sized
// by kLossCount then want its row (their static_asserts say so).
constexpr std::size_t count_loss_fns() {
  for (std::size_t n = 0;; ++n) {
    switch (static_cast<LossFn>(n)) {
      case LossFn::cross_entropy:
      case LossFn::importance_sampling:
      case LossFn::ppo:
      case LossFn::cispo:
      case LossFn::dro:
      case LossFn::value:
      case LossFn::gspo:
      case LossFn::stable_reinforce:
        continue;
    }
    return n;
  }
}
}  // namespace detail

inline constexpr std::size_t kLossCount = detail::count_loss_fns();

// A loss with its configuration. ppo and cispo clip the ratio r = exp(lp - q) to [1 - epsilon_low,
// 1 + epsilon_high] (PPO's epsilon; asymmetric in DAPO), the convention of the algorithm options too; beta weights
// the quadratic penalty of dro; value_clip bounds how far a new value may move from "old_values" in the value
// loss (0 = no clipping); truncation is the cap C of stable_reinforce's importance weight min(r, C) and kl_coeff the
// weight of its KL penalty. Each parameter's bounds are its row of kLossParams; which loss reads which, kLosses.
//
// The wire configures the clip by its bounds instead (lossFnConfig's clip_low_threshold = 1 - epsilon_low,
// clip_high_threshold = 1 + epsilon_high; src/wire/loss_config.hpp translates). For bounds in [0.5, 2] both
// subtractions are exact (Sterbenz's lemma), so min_ratio() / max_ratio() on the receiving side equal the bounds
// sent, bit for bit.
struct LossSpec {
  LossFn fn = LossFn::cross_entropy;
  double epsilon_low = 0.2;
  double epsilon_high = 0.2;
  double beta = 0.1;
  double value_clip = 0.2;
  double truncation = 2.0;
  double kl_coeff = 0.0;

  static LossSpec cross_entropy() { return {LossFn::cross_entropy}; }
  static LossSpec importance_sampling() { return {LossFn::importance_sampling}; }
  static LossSpec ppo(double epsilon_low = 0.2, double epsilon_high = 0.2) {
    return {LossFn::ppo, epsilon_low, epsilon_high};
  }
  static LossSpec cispo(double epsilon_low = 0.2, double epsilon_high = 0.2) {
    return {LossFn::cispo, epsilon_low, epsilon_high};
  }
  static LossSpec dro(double beta = 0.1) { return {.fn = LossFn::dro, .beta = beta}; }
  // GSPO's clip range is narrow, the ratio being a geometric mean over the sequence: the paper's 3e-4 and 4e-4.
  static LossSpec gspo(double epsilon_low = 3e-4, double epsilon_high = 4e-4) {
    return {LossFn::gspo, epsilon_low, epsilon_high};
  }
  // 0.5 * sum(w * max((v - R)^2, (v_clip - R)^2)), v_clip = old + clamp(v - old, -clip, clip) when "old_values"
  // are given; inputs "returns" (R), optional "old_values", optional "weights".
  static LossSpec value(double clip = 0.2) { return {.fn = LossFn::value, .value_clip = clip}; }
  // C = 2 is the truncation Yao et al. use against a sampler whose numerics differ from the trainer's.
  static LossSpec stable_reinforce(double truncation = 2.0, double kl_coeff = 0.0) {
    return {.fn = LossFn::stable_reinforce, .truncation = truncation, .kl_coeff = kl_coeff};
  }

  // The clip range of the ratio.
  double min_ratio() const { return 1.0 - epsilon_low; }
  double max_ratio() const { return 1.0 + epsilon_high; }

  // Throws invalid_argument naming the first parameter outside its bounds (every parameter is checked, whichever
  // loss reads it), or an `fn` that is no enumerator.
  void validate() const;
  bool operator==(const LossSpec&) const = default;
};

// ---- the parameters -------------------------------------------------------------------------------------------

// A parameter is a double member of LossSpec; `hi` infinite means any finite number >= lo.
using LossParam = double LossSpec::*;

struct LossParamInfo {
  LossParam member;
  std::string_view name;
  double lo;
  double hi;
};

inline constexpr double kUnbounded = std::numeric_limits<double>::infinity();

inline constexpr std::array<LossParamInfo, 6> kLossParams{{
    {&LossSpec::epsilon_low, "epsilon_low", 0.0, 1.0},
    {&LossSpec::epsilon_high, "epsilon_high", 0.0, 9.0},
    {&LossSpec::beta, "beta", 0.0, kUnbounded},
    {&LossSpec::value_clip, "value_clip", 0.0, kUnbounded},
    {&LossSpec::truncation, "truncation", 1.0, kUnbounded},
    {&LossSpec::kl_coeff, "kl_coeff", 0.0, kUnbounded},
}};

namespace detail {
// Whether S is brace-initialisable from an LossFn and N doubles: LossSpec is that for N = its parameter count and
// not for one more, so a member added to LossSpec without a row in kLossParams fails the static_assert below.
template <class S, std::size_t... I>
constexpr bool takes_doubles(std::index_sequence<I...>) {
  return requires { S{LossFn{}, (static_cast<void>(I), 0.0)...}; };
}
}  // namespace detail
static_assert(detail::takes_doubles<LossSpec>(std::make_index_sequence<kLossParams.size()>{}) &&
                  !detail::takes_doubles<LossSpec>(std::make_index_sequence<kLossParams.size() + 1>{}),
              "every double member of LossSpec is a parameter with a row in kLossParams");

// ---- the loss inputs ------------------------------------------------------------------------------------------

// Every loss input key a datum may carry. All are per token ([tokens]) but "routed_experts", the experts each token
// is routed to for routing replay: int64 [tokens, sparse layers, experts per token]. "ref_log_prob" and
// "temperature" are accepted for clients that send them; no built-in loss reads them. "sequence_ratio_mask"
// (Tinker's, gspo): the tokens whose mean log ratio is the sequence's ratio (nonzero: in), where the loss-bearing ones
// are otherwise.
inline constexpr std::array<std::string_view, 10> kLossInputs{
    "target_tokens", "weights",    "advantages",     "logprobs",           "ref_log_prob",
    "temperature",   "returns",    "old_values",     "routed_experts",     "sequence_ratio_mask"};

constexpr bool is_known_loss_input(std::string_view key) {
  for (std::string_view k : kLossInputs)
    if (key == k) return true;
  return false;
}

// ---- the table of losses --------------------------------------------------------------------------------------

// The model output a loss is computed on: the target tokens' logprobs, or the value head's values.
enum class LossOutput { logprobs, values };

struct LossInfo {
  LossFn fn;
  std::string_view name;
  std::span<const LossParam> params;                   // the LossSpec parameters it reads
  std::span<const std::string_view> required_inputs;  // loss inputs every datum must carry
  std::span<const std::string_view> optional_inputs;  // read when given ("weights": 1 per token otherwise)
  LossOutput output;
  // The metric holding the share of loss-bearing tokens where its clipped branch is taken; empty: it never clips.
  // Every loss reports "loss:sum" (the sum over tokens) too.
  std::string_view clip_metric;
  // A policy-gradient loss (on sampled tokens, with advantages and the sampler's logprobs): the service adds
  // actor/pg_loss, actor/ppo_kl and actor/pg_clipfrac (docs/wire.md, "Metrics").
  bool policy;
};

namespace detail {
inline constexpr LossParam kClipParams[] = {&LossSpec::epsilon_low, &LossSpec::epsilon_high};
inline constexpr LossParam kDroParams[] = {&LossSpec::beta};
inline constexpr LossParam kValueParams[] = {&LossSpec::value_clip};
inline constexpr LossParam kStableReinforceParams[] = {&LossSpec::truncation, &LossSpec::kl_coeff};
inline constexpr std::string_view kSupervisedInputs[] = {"target_tokens", "weights"};
inline constexpr std::string_view kPolicyInputs[] = {"target_tokens", "advantages", "logprobs"};
inline constexpr std::string_view kWeights[] = {"weights"};
inline constexpr std::string_view kReturns[] = {"returns"};
inline constexpr std::string_view kValueOptional[] = {"old_values", "weights"};
inline constexpr std::string_view kGspoOptional[] = {"weights", "sequence_ratio_mask"};
}  // namespace detail

// One row per LossFn, in the enum's order (the static_assert below checks both). The formulas are in
// src/engine/runtime/loss.hpp beside their code.
inline constexpr std::array<LossInfo, kLossCount> kLosses{{
    {.fn = LossFn::cross_entropy,
     .name = "cross_entropy",
     .params = {},
     .required_inputs = detail::kSupervisedInputs,
     .optional_inputs = {},
     .output = LossOutput::logprobs,
     .clip_metric = {},
     .policy = false},
    {.fn = LossFn::importance_sampling,
     .name = "importance_sampling",
     .params = {},
     .required_inputs = detail::kPolicyInputs,
     .optional_inputs = detail::kWeights,
     .output = LossOutput::logprobs,
     .clip_metric = {},
     .policy = true},
    {.fn = LossFn::ppo,
     .name = "ppo",
     .params = detail::kClipParams,
     .required_inputs = detail::kPolicyInputs,
     .optional_inputs = detail::kWeights,
     .output = LossOutput::logprobs,
     .clip_metric = "clip_fraction",
     .policy = true},
    {.fn = LossFn::cispo,
     .name = "cispo",
     .params = detail::kClipParams,
     .required_inputs = detail::kPolicyInputs,
     .optional_inputs = detail::kWeights,
     .output = LossOutput::logprobs,
     .clip_metric = "clip_fraction",
     .policy = true},
    {.fn = LossFn::dro,
     .name = "dro",
     .params = detail::kDroParams,
     .required_inputs = detail::kPolicyInputs,
     .optional_inputs = detail::kWeights,
     .output = LossOutput::logprobs,
     .clip_metric = {},
     .policy = true},
    {.fn = LossFn::value,
     .name = "value",
     .params = detail::kValueParams,
     .required_inputs = detail::kReturns,
     .optional_inputs = detail::kValueOptional,
     .output = LossOutput::values,
     .clip_metric = "value_clip_fraction",
     .policy = false},
    {.fn = LossFn::gspo,
     .name = "gspo",
     .params = detail::kClipParams,
     .required_inputs = detail::kPolicyInputs,
     .optional_inputs = detail::kGspoOptional,
     .output = LossOutput::logprobs,
     .clip_metric = "clip_fraction",
     .policy = true},
    {.fn = LossFn::stable_reinforce,
     .name = "stable_reinforce",
     .params = detail::kStableReinforceParams,
     .required_inputs = detail::kPolicyInputs,
     .optional_inputs = detail::kWeights,
     .output = LossOutput::logprobs,
     .clip_metric = "clip_fraction",
     .policy = true},
}};

namespace detail {
constexpr bool rows_follow_the_enum() {
  for (std::size_t i = 0; i < kLosses.size(); ++i)
    if (static_cast<std::size_t>(kLosses[i].fn) != i || kLosses[i].name.empty()) return false;
  return true;
}
constexpr bool names_are_distinct() {
  for (std::size_t i = 0; i < kLosses.size(); ++i)
    for (std::size_t j = 0; j < i; ++j)
      if (kLosses[i].name == kLosses[j].name) return false;
  return true;
}
constexpr bool inputs_are_known() {
  for (const LossInfo& row : kLosses) {
    for (std::string_view k : row.required_inputs)
      if (!is_known_loss_input(k)) return false;
    for (std::string_view k : row.optional_inputs)
      if (!is_known_loss_input(k)) return false;
  }
  return true;
}
constexpr bool params_are_known() {
  for (const LossInfo& row : kLosses)
    for (LossParam p : row.params) {
      bool known = false;
      for (const LossParamInfo& info : kLossParams) known = known || info.member == p;
      if (!known) return false;
    }
  return true;
}
}  // namespace detail
static_assert(detail::rows_follow_the_enum(), "kLosses: row i describes LossFn i, one named row per enumerator");
static_assert(detail::names_are_distinct(), "kLosses: two losses share a name");
static_assert(detail::inputs_are_known(), "kLosses: a loss input missing from kLossInputs");
static_assert(detail::params_are_known(), "kLosses: a parameter missing from kLossParams");

// The row of a loss; an `f` that is no enumerator (a cast from a bad integer) throws invalid_argument.
inline const LossInfo& loss_info(LossFn f) {
  const auto i = static_cast<std::size_t>(f);
  if (i >= kLossCount) throw invalid_argument("LossSpec::fn " + std::to_string(i) + " is no loss function");
  return kLosses[i];
}

inline const char* to_string(LossFn f) {
  const auto i = static_cast<std::size_t>(f);
  return i < kLossCount ? kLosses[i].name.data() : "?";  // the names are literals: NUL-terminated
}

namespace detail {
// "a, b or c": the choices an error message offers.
template <class Range>
std::string one_of(const Range& names) {
  std::string out;
  const auto n = static_cast<std::size_t>(std::size(names));
  std::size_t i = 0;
  for (std::string_view name : names) {
    out += i == 0 ? "" : i + 1 == n ? " or " : ", ";
    out += name;
    ++i;
  }
  return out;
}

// A bound as an error message shows it: 0, 1, 0.5 (the shortest form that reads back the same).
inline std::string format_bound(double v) {
  char buf[32];
  const auto end = std::to_chars(buf, buf + sizeof buf, v).ptr;
  return std::string(buf, end);
}

// "in [lo, hi]" or "a finite number >= lo".
inline std::string describe_bounds(double lo, double hi) {
  if (hi == kUnbounded) return "a finite number >= " + format_bound(lo);
  return "in [" + format_bound(lo) + ", " + format_bound(hi) + "]";
}

inline bool within(double v, double lo, double hi) { return v >= lo && v <= hi && std::isfinite(v); }
}  // namespace detail

inline LossFn loss_fn_from_string(std::string_view name) {
  for (const LossInfo& row : kLosses)
    if (name == row.name) return row.fn;
  std::array<std::string_view, kLossCount> names;
  for (std::size_t i = 0; i < kLossCount; ++i) names[i] = kLosses[i].name;
  throw invalid_argument("unknown loss function '" + std::string(name) + "' (expected " + detail::one_of(names) +
                         ")");
}

// Whether loss `f` reads parameter `p`.
inline bool reads_param(LossFn f, LossParam p) {
  for (LossParam q : loss_info(f).params)
    if (q == p) return true;
  return false;
}

inline void LossSpec::validate() const {
  loss_info(fn);
  for (const LossParamInfo& p : kLossParams) {
    const double v = this->*p.member;
    if (!detail::within(v, p.lo, p.hi))
      throw invalid_argument("LossSpec::" + std::string(p.name) + " must be " + detail::describe_bounds(p.lo, p.hi) +
                             ", got " + std::to_string(v));
  }
}

}  // namespace rlloop
