// Parsing the numbers that math answers are written as: "1,234", "$18", "18.0", "-3", "3/4", "\frac{3}{4}",
// "\$1,000.50", "50%". Used by the math reward for both reference and model answers.
#pragma once
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>

namespace rlloop::rewards {

namespace detail {
inline std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

inline bool strip_prefix(std::string_view& s, std::string_view p) {
  if (s.substr(0, p.size()) != p) return false;
  s.remove_prefix(p.size());
  return true;
}
inline bool strip_suffix(std::string_view& s, std::string_view p) {
  if (s.size() < p.size() || s.substr(s.size() - p.size()) != p) return false;
  s.remove_suffix(p.size());
  return true;
}

// A plain decimal: optional sign, digits with optional thousands commas, optional fraction. Nothing else.
inline std::optional<double> parse_decimal(std::string_view s) {
  std::string digits;
  std::size_t i = 0;
  if (i < s.size() && (s[i] == '-' || s[i] == '+')) digits += s[i++];
  bool any = false, dot = false;
  for (; i < s.size(); ++i) {
    const char c = s[i];
    if (std::isdigit(static_cast<unsigned char>(c))) {
      digits += c;
      any = true;
    } else if (c == ',' && any && !dot && i + 1 < s.size() && std::isdigit(static_cast<unsigned char>(s[i + 1]))) {
      continue;  // thousands separator
    } else if (c == '.' && !dot) {
      dot = true;
      digits += c;
    } else {
      return std::nullopt;
    }
  }
  if (!any) return std::nullopt;
  return std::strtod(digits.c_str(), nullptr);
}
}  // namespace detail

// The value of one written number, or nullopt when the text is not a single number.
inline std::optional<double> parse_number(std::string_view text) {
  std::string_view s = detail::trim(text);
  // Decorations that do not change the value.
  for (bool changed = true; changed && !s.empty();) {
    changed = detail::strip_prefix(s, "\\$") || detail::strip_prefix(s, "$") || detail::strip_suffix(s, "$") ||
              detail::strip_suffix(s, ".") || detail::strip_suffix(s, "\\%") || detail::strip_suffix(s, "%") ||
              detail::strip_prefix(s, "\\(") || detail::strip_suffix(s, "\\)") || detail::strip_prefix(s, " ") ||
              detail::strip_suffix(s, " ");
  }
  std::string_view sign;
  std::string_view body = s;
  if (!body.empty() && (body.front() == '-' || body.front() == '+')) {
    sign = body.substr(0, 1);
    body = detail::trim(body.substr(1));
  } else if (detail::strip_prefix(body, "\xE2\x88\x92")) {  // U+2212 minus sign
    sign = "-";
  }
  if (!sign.empty()) {
    detail::strip_prefix(body, "\\$") || detail::strip_prefix(body, "$");                    // -$5
    if (!body.empty() && (body.front() == '-' || body.front() == '+')) return std::nullopt;  // "--4"
  }
  const double k = sign == "-" ? -1.0 : 1.0;
  // \frac{a}{b}, \dfrac{a}{b}, \tfrac{a}{b}
  for (std::string_view cmd : {"\\frac{", "\\dfrac{", "\\tfrac{"}) {
    std::string_view f = body;
    if (!detail::strip_prefix(f, cmd)) continue;
    const auto close = f.find('}');
    if (close == std::string_view::npos || close + 1 >= f.size() || f[close + 1] != '{' || f.back() != '}')
      return std::nullopt;
    auto num = detail::parse_decimal(detail::trim(f.substr(0, close)));
    auto den = detail::parse_decimal(detail::trim(f.substr(close + 2, f.size() - close - 3)));
    if (!num || !den || *den == 0) return std::nullopt;
    return k * *num / *den;
  }
  // a/b
  if (const auto slash = body.find('/'); slash != std::string_view::npos) {
    auto num = detail::parse_decimal(detail::trim(body.substr(0, slash)));
    auto den = detail::parse_decimal(detail::trim(body.substr(slash + 1)));
    if (!num || !den || *den == 0) return std::nullopt;
    return k * *num / *den;
  }
  auto v = detail::parse_decimal(body);
  if (!v) return std::nullopt;
  return k * *v;
}

// Equal up to floating-point noise: 0.5 == 1/2 == 0.50, but 0.333 != 1/3.
inline bool numbers_equal(double a, double b, double rel_tol = 1e-9) {
  return std::fabs(a - b) <= rel_tol * std::fmax(1.0, std::fmax(std::fabs(a), std::fabs(b)));
}

}  // namespace rlloop::rewards
