// Format checks on the completion text alone, and a reward built from one. Combine with a correctness reward
// through with_format_bonus / with_format_penalty (combinators.hpp).
#pragma once
#include <concepts>
#include <regex>
#include <string>
#include <string_view>

#include <rlloop/reward.hpp>
#include <rlloop/rewards/math.hpp>

namespace rlloop::rewards {

// A check of the completion's shape: callable as bool(std::string_view).
template <class P>
concept FormatCheck = std::copy_constructible<P> && std::predicate<const P&, std::string_view>;

// The completion states a final answer the math reward can find (\boxed{...} or "#### ...").
struct has_final_answer {
  bool operator()(std::string_view c) const { return extract_boxed(c) || extract_after_hashes(c); }
};

// The whole completion matches an ECMAScript regular expression.
class matches_regex {
 public:
  explicit matches_regex(const std::string& pattern) : re_(pattern, std::regex::ECMAScript | std::regex::optimize) {}
  bool operator()(std::string_view c) const { return std::regex_match(c.begin(), c.end(), re_); }

 private:
  std::regex re_;
};

// The completion is at most `max_chars` long.
struct max_length {
  std::size_t max_chars = 1000;
  bool operator()(std::string_view c) const { return c.size() <= max_chars; }
};

// `pass` when the check holds, `fail` otherwise; a failed check is still an `ok` score (it was graded).
template <FormatCheck P>
struct FormatReward {
  P check;
  double pass = 1.0;
  double fail = 0.0;

  template <class Ctx>
  Score operator()(const Ctx&, std::string_view completion) const {
    const bool good = check(completion);
    return {good ? pass : fail, ScoreStatus::ok, good ? "format ok" : "format not met"};
  }
};

template <FormatCheck P>
FormatReward<P> format_reward(P check, double pass = 1.0, double fail = 0.0) {
  return {std::move(check), pass, fail};
}

}  // namespace rlloop::rewards
