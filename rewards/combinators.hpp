// Rewards built from rewards: weighted sums, clipping, format bonuses and penalties. Each result is itself a
// Reward for every context all of its parts accept, so they nest.
#pragma once
#include <algorithm>
#include <string_view>
#include <tuple>
#include <utility>

#include <rlloop/error.hpp>
#include <rlloop/reward.hpp>
#include <rlloop/rewards/format.hpp>

namespace rlloop::rewards {

namespace detail {
// The first non-ok status wins: "why did this earn little" should name the part that failed.
inline void merge_into(Score& total, const Score& part, double weight) {
  total.value += weight * part.value;
  if (total.status == ScoreStatus::ok && part.status != ScoreStatus::ok) total.status = part.status;
  if (!part.details.empty()) {
    if (!total.details.empty()) total.details += "; ";
    total.details += part.details;
  }
}
}  // namespace detail

template <class R>
struct Weighted {
  double weight;
  R reward;
};

// sum_i w_i * r_i(ctx, completion)
template <class... R>
class WeightedSum {
 public:
  explicit WeightedSum(Weighted<R>... parts) : parts_(std::move(parts)...) {}

  template <class Ctx>
  requires(Reward<R, Ctx>&&...) Score operator()(const Ctx& ctx, std::string_view completion) const {
    Score total{0.0, ScoreStatus::ok, {}};
    std::apply(
        [&](const auto&... p) { (detail::merge_into(total, score_one(p.reward, ctx, completion), p.weight), ...); },
        parts_);
    return total;
  }

 private:
  std::tuple<Weighted<R>...> parts_;
};

// weighted_sum(std::pair{1.0, math}, std::pair{0.1, format_reward(has_final_answer{})})
template <class... R>
WeightedSum<R...> weighted_sum(std::pair<double, R>... parts) {
  return WeightedSum<R...>(Weighted<R>{parts.first, std::move(parts.second)}...);
}

// r clamped to [lo, hi].
template <class R>
class Clipped {
 public:
  Clipped(R reward, double lo, double hi) : reward_(std::move(reward)), lo_(lo), hi_(hi) {
    if (!(lo <= hi)) throw invalid_argument("clip: lo must be <= hi");
  }
  template <class Ctx>
  requires Reward<R, Ctx> Score operator()(const Ctx& ctx, std::string_view completion) const {
    Score s = score_one(reward_, ctx, completion);
    s.value = std::clamp(s.value, lo_, hi_);
    return s;
  }

 private:
  R reward_;
  double lo_, hi_;
};

template <class R>
Clipped<R> clip(R reward, double lo, double hi) {
  return Clipped<R>(std::move(reward), lo, hi);
}

// r + bonus when the format check holds (bonus >= 0), or r - penalty when it does not (penalty >= 0).
template <class R, FormatCheck P>
class FormatAdjusted {
 public:
  FormatAdjusted(R reward, P check, double when_met, double when_missed)
      : reward_(std::move(reward)), check_(std::move(check)), when_met_(when_met), when_missed_(when_missed) {}

  template <class Ctx>
  requires Reward<R, Ctx> Score operator()(const Ctx& ctx, std::string_view completion) const {
    Score s = score_one(reward_, ctx, completion);
    const bool met = check_(completion);
    s.value += met ? when_met_ : when_missed_;
    if (!met) s.details += s.details.empty() ? "format not met" : "; format not met";
    return s;
  }

 private:
  R reward_;
  P check_;
  double when_met_, when_missed_;
};

template <class R, FormatCheck P>
FormatAdjusted<R, P> with_format_bonus(R reward, P check, double bonus) {
  if (!(bonus >= 0)) throw invalid_argument("with_format_bonus: bonus must be >= 0");
  return {std::move(reward), std::move(check), bonus, 0.0};
}

template <class R, FormatCheck P>
FormatAdjusted<R, P> with_format_penalty(R reward, P check, double penalty) {
  if (!(penalty >= 0)) throw invalid_argument("with_format_penalty: penalty must be >= 0");
  return {std::move(reward), std::move(check), 0.0, -penalty};
}

}  // namespace rlloop::rewards
