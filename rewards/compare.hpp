// Judging a program's output against the expected one, the way online judges do: token by token, so
// whitespace layout does not matter, and numbers within a tolerance count as equal.
#pragma once
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include <rlloop/error.hpp>

namespace rlloop::rewards {

struct OutputCompare {
  bool float_tolerant = true;  // compare numeric tokens as numbers
  double abs_tol = 1e-6;       // |a - b| <= max(abs_tol, rel_tol * |expected|)
  double rel_tol = 1e-6;

  void validate() const {
    if (!(abs_tol >= 0)) throw invalid_argument("OutputCompare::abs_tol must be >= 0");
    if (!(rel_tol >= 0)) throw invalid_argument("OutputCompare::rel_tol must be >= 0");
  }
};

namespace detail {
inline std::vector<std::string_view> tokens(std::string_view s) {
  std::vector<std::string_view> out;
  std::size_t i = 0;
  while (i < s.size()) {
    while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
    std::size_t j = i;
    while (j < s.size() && !std::isspace(static_cast<unsigned char>(s[j]))) ++j;
    if (j > i) out.push_back(s.substr(i, j - i));
    i = j;
  }
  return out;
}

// The token as a finite number when all of it is one ("3", "-2.5", "1e-3"); "nan", "0x1p3", "inf" are not.
inline bool numeric_token(std::string_view t, double& v) {
  if (t.empty() || t.size() > 64) return false;
  for (char c : t)
    if (!(std::isdigit(static_cast<unsigned char>(c)) || c == '-' || c == '+' || c == '.' || c == 'e' || c == 'E'))
      return false;
  std::string s(t);
  char* end = nullptr;
  v = std::strtod(s.c_str(), &end);
  return end == s.c_str() + s.size() && std::isfinite(v);
}
}  // namespace detail

inline bool outputs_match(std::string_view expected, std::string_view actual, const OutputCompare& cmp = {}) {
  const auto e = detail::tokens(expected);
  const auto a = detail::tokens(actual);
  if (e.size() != a.size()) return false;
  for (std::size_t i = 0; i < e.size(); ++i) {
    if (e[i] == a[i]) continue;
    double x, y;
    if (!cmp.float_tolerant || !detail::numeric_token(e[i], x) || !detail::numeric_token(a[i], y)) return false;
    if (std::fabs(x - y) > std::fmax(cmp.abs_tol, cmp.rel_tol * std::fabs(x))) return false;
  }
  return true;
}

}  // namespace rlloop::rewards
