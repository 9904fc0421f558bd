// Synthetic arithmetic for CPU demos: short prompts a tiny byte-level model can learn ("37+48="), answers in
// GSM8K format ("#### 85") so the math reward grades them. The difficulty knob is the number of digits per
// operand and the number of operands.
//
// Train and held-out problems are disjoint by construction: a problem's split is a hash of its text, not of
// the draw, so no seed can put the same expression in both. Draws use std::mt19937_64 (whose sequence the
// standard fixes) and no std distribution (whose output is implementation-defined): a seed reproduces the
// same problems on every platform.
#pragma once
#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include <rlloop/env.hpp>
#include <rlloop/error.hpp>
#include <rlloop/rewards/math.hpp>

namespace rlloop::envs {

struct ArithmeticOptions {
  int digits = 2;                       // operands have 1..digits digits (1..9)
  int operands = 2;                     // 2..8
  std::string operators = "+";          // any of "+-*"
  bool allow_negative = false;          // with '-', redraw problems whose result is negative
  double held_out_fraction = 0.1;       // share of the problem space reserved for evaluation
  std::string answer_prefix = "#### ";  // the completion a model should write is answer_prefix + N

  // Level 1: 1-digit a+b; 2: 2-digit a+b; 3: 2-digit a±b; 4: 3-digit a±b; 5: 2-digit a±b±c; 6: with '*'.
  static ArithmeticOptions for_difficulty(int level) {
    switch (level) {
      case 1:
        return {.digits = 1, .operands = 2, .operators = "+"};
      case 2:
        return {.digits = 2, .operands = 2, .operators = "+"};
      case 3:
        return {.digits = 2, .operands = 2, .operators = "+-"};
      case 4:
        return {.digits = 3, .operands = 2, .operators = "+-"};
      case 5:
        return {.digits = 2, .operands = 3, .operators = "+-"};
      case 6:
        return {.digits = 2, .operands = 3, .operators = "+-*"};
      default:
        throw invalid_argument("ArithmeticOptions::for_difficulty: level must be 1..6, got " + std::to_string(level));
    }
  }

  void validate() const {
    if (digits < 1 || digits > 9) throw invalid_argument("ArithmeticOptions::digits must be in 1..9");
    if (operands < 2 || operands > 8) throw invalid_argument("ArithmeticOptions::operands must be in 2..8");
    if (operators.empty() || operators.find_first_not_of("+-*") != std::string::npos)
      throw invalid_argument("ArithmeticOptions::operators must be a non-empty subset of \"+-*\"");
    if (!(held_out_fraction > 0 && held_out_fraction < 1))
      throw invalid_argument("ArithmeticOptions::held_out_fraction must be in (0, 1)");
  }
};

struct ArithmeticProblem {
  std::string prompt;  // "37+48="
  std::string answer;  // "85"
  std::string target;  // "#### 85": the completion that earns full reward
};

enum class Split { train, held_out };

class ArithmeticTask {
 public:
  explicit ArithmeticTask(ArithmeticOptions opts = {}, std::uint64_t seed = 0) : opts_(std::move(opts)), rng_(seed) {
    opts_.validate();
  }

  // Which split an expression belongs to: FNV-1a of its text (64-bit offset basis and prime) picks one of
  // split_buckets buckets, the first held_out_fraction of them held out. A prime bucket count makes the bucket
  // depend on every bit of the hash, not only the low ones.
  static constexpr std::uint64_t split_buckets = 1000003;
  static Split split_of(std::string_view expression, double held_out_fraction) {
    std::uint64_t h = 1469598103934665603ull;
    for (unsigned char c : expression) h = (h ^ c) * 1099511628211ull;
    h ^= h >> 29;  // fold the high bits in: FNV's low bits alone are weak for short strings
    return static_cast<double>(h % split_buckets) < held_out_fraction * static_cast<double>(split_buckets)
               ? Split::held_out
               : Split::train;
  }

  // Draws before next() gives up on a split: one this rare in the problem space is treated as empty.
  static constexpr int max_draws_per_problem = 100000;

  ArithmeticProblem next(Split split) {
    for (int attempt = 0; attempt < max_draws_per_problem; ++attempt) {
      auto p = draw();
      if (p && split_of(p->prompt, opts_.held_out_fraction) == split) return *p;
    }
    throw invalid_argument(
        "ArithmeticTask: no problem of the requested split in this problem space; "
        "raise digits/operands or change held_out_fraction");
  }

  std::vector<ArithmeticProblem> sample(std::size_t n, Split split) {
    std::vector<ArithmeticProblem> out;
    out.reserve(n);
    for (std::size_t i = 0; i < n; ++i) out.push_back(next(split));
    return out;
  }

  const ArithmeticOptions& options() const noexcept { return opts_; }

 private:
  std::uint64_t uniform(std::uint64_t n) { return rng_() % n; }  // n is tiny next to 2^64: bias is negligible

  std::optional<ArithmeticProblem> draw() {
    std::uint64_t max = 1;
    for (int i = 0; i < opts_.digits; ++i) max *= 10;
    std::vector<long long> terms;  // products folded in: '*' binds tighter than '+' and '-'
    std::vector<int> signs;        // +1 / -1 for each term
    std::string text;
    long long term = 0;
    int sign = +1;
    for (int i = 0; i < opts_.operands; ++i) {
      const long long x = static_cast<long long>(uniform(max));
      char op = i == 0 ? '+' : opts_.operators[uniform(opts_.operators.size())];
      if (i > 0) text += op;
      text += std::to_string(x);
      if (op == '*' && i > 0) {
        term *= x;
      } else {
        if (i > 0) terms.push_back(term), signs.push_back(sign);
        term = x;
        sign = op == '-' ? -1 : +1;
      }
    }
    terms.push_back(term);
    signs.push_back(sign);
    long long value = 0;
    for (std::size_t i = 0; i < terms.size(); ++i) value += signs[i] * terms[i];
    if (value < 0 && !opts_.allow_negative) return std::nullopt;
    ArithmeticProblem p;
    p.prompt = text + "=";
    p.answer = std::to_string(value);
    p.target = opts_.answer_prefix + p.answer;
    return p;
  }

  ArithmeticOptions opts_;
  std::mt19937_64 rng_;
};

// The math reward grades arithmetic completions ("#### 85" or "\boxed{85}").
using ArithmeticEnv = SingleTurnEnv<ArithmeticProblem, rewards::MathAnswerReward>;

inline ArithmeticEnv arithmetic_env(ArithmeticProblem p, rewards::MathAnswerOptions opts = {}) {
  return ArithmeticEnv(std::move(p), rewards::MathAnswerReward(opts));
}

}  // namespace rlloop::envs
