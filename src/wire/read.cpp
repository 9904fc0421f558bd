#include "wire/read.hpp"

#include <cmath>

#include <rlloop/error.hpp>

namespace rlloop::wire::read {

std::string join(const std::string& path, const std::string& key) { return path.empty() ? key : path + "." + key; }
std::string at(const std::string& path, std::size_t i) { return path + "[" + std::to_string(i) + "]"; }

void fail(const std::string& path, const std::string& what) {
  throw invalid_argument((path.empty() ? std::string("request body") : path) + ": " + what);
}

const json& object(const json& j, const std::string& path) {
  if (!j.is_object()) fail(path, "expected an object");
  return j;
}
const json& array(const json& j, const std::string& path) {
  if (!j.is_array()) fail(path, "expected an array");
  return j;
}
const json* find(const json& obj, const std::string& key) {
  auto it = obj.find(key);
  return it == obj.end() || it->is_null() ? nullptr : &*it;
}
const json& need(const json& obj, const std::string& path, const std::string& key) {
  if (const json* v = find(obj, key)) return *v;
  fail(join(path, key), "required field is missing");
}
std::string string(const json& j, const std::string& path) {
  if (!j.is_string()) fail(path, "expected a string");
  return j.get<std::string>();
}
bool boolean(const json& j, const std::string& path) {
  if (!j.is_boolean()) fail(path, "expected a boolean");
  return j.get<bool>();
}
double number(const json& j, const std::string& path) {
  if (j.is_string()) {
    const auto& s = j.get_ref<const std::string&>();
    if (s == "NaN") return std::numeric_limits<double>::quiet_NaN();
    if (s == "Infinity") return std::numeric_limits<double>::infinity();
    if (s == "-Infinity") return -std::numeric_limits<double>::infinity();
  }
  if (!j.is_number()) fail(path, "expected a number");
  return j.get<double>();
}
std::int64_t integer(const json& j, const std::string& path, std::int64_t lo, std::int64_t hi) {
  std::int64_t v = 0;
  if (j.is_number_integer()) {
    if (j.is_number_unsigned() &&
        j.get<std::uint64_t>() > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
      fail(path, "integer out of range");
    v = j.get<std::int64_t>();
  } else if (j.is_number_float() && std::isfinite(j.get<double>()) && j.get<double>() == std::floor(j.get<double>()) &&
             std::fabs(j.get<double>()) < 9.0e15) {
    v = static_cast<std::int64_t>(j.get<double>());  // 3.0 is an integer to JSON writers that only know doubles
  } else {
    fail(path, "expected an integer");
  }
  if (v < lo || v > hi)
    fail(path, "must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " + std::to_string(v));
  return v;
}
double in_range(double v, const std::string& path, double lo, double hi) {
  if (!(v >= lo && v <= hi))
    fail(path, "must be in [" + json(lo).dump() + ", " + json(hi).dump() + "], got " + json(v).dump());
  return v;
}
void only_keys(const json& obj, const std::string& path, std::initializer_list<const char*> keys) {
  for (auto it = obj.begin(); it != obj.end(); ++it) {
    bool known = false;
    for (const char* k : keys) known = known || it.key() == k;
    if (!known) fail(join(path, it.key()), "unknown field");
  }
}
std::int64_t page_offset(const json& body) {
  const json* tok = find(body, "NextToken");
  if (!tok) return 0;
  const std::string s = string(*tok, "NextToken");
  // At most 18 digits: std::stoll would throw out_of_range (a 500) on longer ones.
  if (s.empty() || s.size() > 18 || s.find_first_not_of("0123456789") != std::string::npos)
    fail("NextToken", "is not a token from a previous page");
  return std::stoll(s);
}
std::string union_member(const json& j, const std::string& path, std::initializer_list<const char*> members) {
  return union_member(j, path, std::span<const char* const>(members.begin(), members.size()));
}

std::string union_member(const json& j, const std::string& path, std::span<const char* const> members) {
  object(j, path);
  std::string names;
  for (const char* m : members) names += (names.empty() ? "" : ", ") + std::string(m);
  if (j.size() != 1) fail(path, "expected exactly one of " + names + " (got " + std::to_string(j.size()) + " members)");
  const std::string key = j.begin().key();
  for (const char* m : members)
    if (key == m) return key;
  fail(join(path, key), "unknown member (expected one of " + names + ")");
}

}  // namespace rlloop::wire::read
