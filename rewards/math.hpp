// Math answers: GSM8K references ("... #### 72") and model answers in \boxed{...} or after "####", compared
// as numbers (commas, "$", trailing ".0", fractions and signs do not matter).
#pragma once
#include <optional>
#include <string>
#include <string_view>

#include <rlloop/error.hpp>
#include <rlloop/reward.hpp>
#include <rlloop/rewards/number.hpp>

namespace rlloop::rewards {

// The content of the last \boxed{...} (braces balanced), or nullopt.
inline std::optional<std::string> extract_boxed(std::string_view text) {
  const auto at = text.rfind("\\boxed");
  if (at == std::string_view::npos) return std::nullopt;
  auto open = at + 6;
  while (open < text.size() && text[open] == ' ') ++open;
  if (open >= text.size() || text[open] != '{') return std::nullopt;
  int depth = 0;
  for (std::size_t i = open; i < text.size(); ++i) {
    if (text[i] == '{') ++depth;
    if (text[i] == '}' && --depth == 0) return std::string(text.substr(open + 1, i - open - 1));
  }
  return std::nullopt;  // unbalanced: the model stopped mid-answer
}

// What follows the last "####" up to the end of that line, or nullopt.
inline std::optional<std::string> extract_after_hashes(std::string_view text) {
  const auto at = text.rfind("####");
  if (at == std::string_view::npos) return std::nullopt;
  auto rest = text.substr(at + 4);
  rest = rest.substr(0, rest.find('\n'));
  rest = detail::trim(rest);
  if (rest.empty()) return std::nullopt;
  return std::string(rest);
}

// The first number-looking run inside `text` ("18 dollars" -> 18, "x = -3/4" -> -0.75).
inline std::optional<double> first_number_in(std::string_view text) {
  for (std::size_t i = 0; i < text.size(); ++i) {
    const bool digit = std::isdigit(static_cast<unsigned char>(text[i]));
    if (!digit) continue;
    std::size_t b = i;
    while (b > 0 && (text[b - 1] == '-' || text[b - 1] == '$')) --b;
    std::size_t e = i;
    while (e < text.size() &&
           (std::isdigit(static_cast<unsigned char>(text[e])) || text[e] == ',' || text[e] == '.' || text[e] == '/'))
      ++e;
    if (auto v = parse_number(text.substr(b, e - b))) return v;
    return std::nullopt;
  }
  return std::nullopt;
}

// The number an answer string states: parsed whole, or else its first number.
inline std::optional<double> answer_value(std::string_view answer) {
  if (auto v = parse_number(answer)) return v;
  return first_number_in(answer);
}

// GSM8K reference: the text after "####" of the official `answer` field (a bare number is accepted too).
// Throws rlloop::invalid_argument: a reference without a number is a broken data set, not a model error.
inline double reference_value(std::string_view reference) {
  const auto tail = extract_after_hashes(reference);
  auto v = answer_value(tail ? std::string_view(*tail) : reference);
  if (!v) throw invalid_argument("math reward: reference answer has no number: '" + std::string(reference) + "'");
  return *v;
}

struct MathAnswerOptions {
  double correct = 1.0;
  double wrong = 0.0;
  double unparseable = 0.0;
  double rel_tol = 1e-9;
  // Also accept the last number of the completion when it has neither \boxed{} nor "####". Off by default:
  // rewarding a stray number teaches the model to skip the answer format.
  bool fallback_to_last_number = false;

  void validate() const {
    if (!(rel_tol >= 0)) throw invalid_argument("MathAnswerOptions::rel_tol must be >= 0");
  }
};

// The model's stated answer: the last \boxed{}, else the text after the last "####" (else, optionally, the last
// number in the completion).
inline std::optional<std::string> extract_model_answer(std::string_view completion,
                                                       bool fallback_to_last_number = false) {
  if (auto b = extract_boxed(completion)) return b;
  if (auto h = extract_after_hashes(completion)) return h;
  if (!fallback_to_last_number) return std::nullopt;
  for (std::size_t e = completion.size(); e > 0; --e) {
    if (!std::isdigit(static_cast<unsigned char>(completion[e - 1]))) continue;
    std::size_t b = e;
    while (b > 0 && (std::isdigit(static_cast<unsigned char>(completion[b - 1])) || completion[b - 1] == ',' ||
                     completion[b - 1] == '.' || completion[b - 1] == '-'))
      --b;
    return std::string(completion.substr(b, e - b));
  }
  return std::nullopt;
}

// A context the math reward can check against: a string (the reference) or anything with an `answer` member.
template <class Ctx>
concept HasReferenceAnswer = std::convertible_to<const Ctx&, std::string_view> || requires(const Ctx& c) {
  { c.answer } -> std::convertible_to<std::string_view>;
};

template <HasReferenceAnswer Ctx>
std::string_view reference_of(const Ctx& c) {
  if constexpr (std::convertible_to<const Ctx&, std::string_view>)
    return std::string_view(c);
  else
    return std::string_view(c.answer);
}

// 1 for the right number, 0 otherwise; "no answer found" is ScoreStatus::unparseable.
class MathAnswerReward {
 public:
  explicit MathAnswerReward(MathAnswerOptions opts = {}) : opts_(opts) { opts_.validate(); }

  template <HasReferenceAnswer Ctx>
  Score operator()(const Ctx& ctx, std::string_view completion) const {
    const double expected = reference_value(reference_of(ctx));
    const auto stated = extract_model_answer(completion, opts_.fallback_to_last_number);
    if (!stated) return {opts_.unparseable, ScoreStatus::unparseable, "no \\boxed{} or #### answer"};
    const auto got = answer_value(*stated);
    if (!got) return {opts_.unparseable, ScoreStatus::unparseable, "answer is not a number: '" + *stated + "'"};
    if (numbers_equal(*got, expected, opts_.rel_tol)) return {opts_.correct, ScoreStatus::ok, "correct: " + *stated};
    return {opts_.wrong, ScoreStatus::wrong_answer, "expected " + format_number(expected) + ", got '" + *stated + "'"};
  }

  const MathAnswerOptions& options() const noexcept { return opts_; }

 private:
  static std::string format_number(double v) {
    std::string s = std::to_string(v);
    while (!s.empty() && s.back() == '0') s.pop_back();
    if (!s.empty() && s.back() == '.') s.pop_back();
    return s;
  }
  MathAnswerOptions opts_;
};

}  // namespace rlloop::rewards
