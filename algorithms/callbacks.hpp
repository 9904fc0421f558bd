// Optional hooks for a training loop, passed as a pack: each callback implements any of
//   on_step(const Stats&)  -> void, or bool (true = stop training)
//   on_end(const Stats&)   -> void (called once with the last step's stats)
// A type with none of them is refused at compile time, naming the StepCallback concept.
//
//   auto last = rlloop::algorithms::train(grpo, 100, [&] { return task.sample(16, Split::train); }, reward,
//                                         JsonlLogger(log), StopWhen{"reward_mean", 0.95});
#pragma once
#include <concepts>
#include <functional>
#include <string>
#include <utility>

#include <nlohmann/json.hpp>

#include <rlloop/algorithms/policy_gradient.hpp>
#include <rlloop/metrics.hpp>

namespace rlloop::algorithms {

inline nlohmann::json to_json(const PolicyGradientStats& s) {
  return {{"step", s.step},
          {"reward_mean", s.reward_mean},
          {"reward_std", s.reward_std},
          {"accuracy", s.accuracy},
          {"groups_used", s.groups_used},
          {"groups_dropped", s.groups_dropped},
          {"sampled_tokens", s.sampled_tokens},
          {"trained_tokens", s.trained_tokens},
          {"loss", s.loss},
          {"clip_fraction", s.clip_fraction},
          {"kl", s.kl},
          {"entropy", s.entropy},
          {"seconds_sampling", s.seconds_sampling},
          {"seconds_training", s.seconds_training},
          {"staleness", s.staleness}};
}

template <class C, class Stats>
concept StepCallback = std::copy_constructible<C> &&(
    requires(C& c, const Stats& s) { c.on_step(s); } || requires(C & c, const Stats& s) { c.on_end(s); });

// Appends every step's stats to a MetricsLog (JSONL).
struct JsonlLogger {
  MetricsLog* log;
  template <class Stats>
  void on_step(const Stats& s) {
    log->write(to_json(s));
  }
};

// Stops once a stats field reaches a threshold (e.g. reward_mean >= 0.95).
struct StopWhen {
  std::string field;
  double at_least;
  template <class Stats>
  bool on_step(const Stats& s) {
    const auto j = to_json(s);
    if (!j.contains(field)) throw invalid_argument("StopWhen: the stats have no field '" + field + "'");
    return j[field].template get<double>() >= at_least;
  }
};

namespace detail {
template <class C, class Stats>
bool call_on_step(C& c, const Stats& s) {
  if constexpr (requires {
                  { c.on_step(s) } -> std::convertible_to<bool>;
                }) {
    return static_cast<bool>(c.on_step(s));
  } else if constexpr (requires { c.on_step(s); }) {
    c.on_step(s);
  }
  return false;
}
template <class C, class Stats>
void call_on_end(C& c, const Stats& s) {
  if constexpr (requires { c.on_end(s); }) c.on_end(s);
}
}  // namespace detail

// A convenience loop (the user may just as well write the for loop): `steps` calls of algo.step(next(), reward),
// with the callbacks after each step; stops early when one asks. Returns the last step's stats.
template <class Algo, class NextBatch, class R, class... Callbacks>
requires(StepCallback<Callbacks, PolicyGradientStats>&&...) PolicyGradientStats
    train(Algo& algo, int steps, NextBatch&& next, const R& reward, Callbacks... callbacks) {
  PolicyGradientStats last;
  for (int i = 0; i < steps; ++i) {
    last = algo.step(next(), reward);
    const bool stop = (detail::call_on_step(callbacks, last) | ... | false);
    if (stop) break;
  }
  (detail::call_on_end(callbacks, last), ...);
  return last;
}

}  // namespace rlloop::algorithms
