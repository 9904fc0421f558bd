// A convenience training loop and optional hooks for it. train() drives any algorithm whose step() returns
// StepStats: the policy-gradient family (GRPO, PPO, ...: step(problems, reward)) and SFT, DPO / IPO, KTO
// (step(batch)). Callbacks are passed as a pack: each implements any of
//   on_step(const Stats&)  -> void, or bool (true = stop training)
//   on_end(const Stats&)   -> void (called once with the last step's stats)
// A type with none of them is refused at compile time, naming the StepCallback concept.
//
//   auto last = rlloop::algorithms::train(grpo, 100, [&] { return task.sample(16, Split::train); }, reward,
//                                         JsonlLogger(log), StopWhen{"reward_mean", 0.95});
//   auto last = rlloop::algorithms::train(dpo, 100, [&] { return next_pairs(); }, JsonlLogger(log));
#pragma once
#include <concepts>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include <nlohmann/json.hpp>

#include <rlloop/error.hpp>
#include <rlloop/metrics.hpp>

namespace rlloop::algorithms {

// What a step reports: its step number and a flat JSON object of its numbers (to_json, found by
// argument-dependent lookup), which JsonlLogger writes and StopWhen reads.
template <class T>
concept StepStats = std::copyable<T> && requires(const T& s) {
  { s.step } -> std::convertible_to<std::int64_t>;
  { to_json(s) } -> std::same_as<nlohmann::json>;
};

// An algorithm train() can drive: algo.step(next(), extra...) returns StepStats.
template <class Algo, class NextBatch, class... Extra>
concept Steppable = requires(Algo& algo, NextBatch& next, const Extra&... extra) {
  { algo.step(next(), extra...) } -> StepStats;
};

template <class Algo, class NextBatch, class... Extra>
using step_stats_t = std::remove_cvref_t<decltype(std::declval<Algo&>().step(std::declval<NextBatch&>()(),
                                                                             std::declval<const Extra&>()...))>;

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

// `steps` calls of step(), with the callbacks after each; stops early when one asks.
template <class Step, class... Callbacks>
auto run_steps(int steps, const Step& step, Callbacks&... callbacks) {
  decltype(step()) last{};
  for (int i = 0; i < steps; ++i) {
    last = step();
    const bool stop = (detail::call_on_step(callbacks, last) | ... | false);
    if (stop) break;
  }
  (detail::call_on_end(callbacks, last), ...);
  return last;
}
}  // namespace detail

// A convenience loop (the user may just as well write the for loop): `steps` calls of algo.step(next(), reward),
// with the callbacks after each step; stops early when one asks. Returns the last step's stats.
template <class Algo, class NextBatch, class R, class... Callbacks>
  requires Steppable<Algo, NextBatch, R> && (StepCallback<Callbacks, step_stats_t<Algo, NextBatch, R>> && ...)
step_stats_t<Algo, NextBatch, R> train(Algo& algo, int steps, NextBatch&& next, const R& reward,
                                       Callbacks... callbacks) {
  return detail::run_steps(steps, [&] { return algo.step(next(), reward); }, callbacks...);
}

// The same for algorithms whose batch is all they need (SFT, DPO / IPO, KTO): `steps` calls of algo.step(next()).
template <class Algo, class NextBatch, class... Callbacks>
  requires Steppable<Algo, NextBatch> && (StepCallback<Callbacks, step_stats_t<Algo, NextBatch>> && ...)
step_stats_t<Algo, NextBatch> train(Algo& algo, int steps, NextBatch&& next, Callbacks... callbacks) {
  return detail::run_steps(steps, [&] { return algo.step(next()); }, callbacks...);
}

}  // namespace rlloop::algorithms
