// The field readers every wire reader is built from, public for the other JSON a wire peer reads (the control plane's
// bodies, the server's tenants file): each checks one member's type or presence and throws rlloop::invalid_argument
// naming the JSON path ("LoraConfig.Rank: expected an integer"); `path` is where `j` / `obj` sits ("" = the body).
#pragma once
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <span>
#include <string>

#include <nlohmann/json.hpp>

namespace rlloop::wire {

using json = nlohmann::json;

namespace read {

std::string join(const std::string& path, const std::string& key);
std::string at(const std::string& path, std::size_t i);

[[noreturn]] void fail(const std::string& path, const std::string& what);

const json& object(const json& j, const std::string& path);
const json& array(const json& j, const std::string& path);
// The member, or nullptr when absent (JSON null counts as absent, as AWS SDKs treat it).
const json* find(const json& obj, const std::string& key);
const json& need(const json& obj, const std::string& path, const std::string& key);
std::string string(const json& j, const std::string& path);
bool boolean(const json& j, const std::string& path);
// AWS's JSON protocols write the doubles JSON has no literal for as the strings "NaN", "Infinity" and
// "-Infinity" (botocore parses them so); a number member accepts those three strings too.
double number(const json& j, const std::string& path);
// An integer in [lo, hi]; 3.0 counts as one (JSON writers that only know doubles send it so).
std::int64_t integer(const json& j, const std::string& path, std::int64_t lo = std::numeric_limits<std::int64_t>::min(),
                     std::int64_t hi = std::numeric_limits<std::int64_t>::max());
double in_range(double v, const std::string& path, double lo, double hi);
// Rejects members a request type does not define, so a typo is an error rather than a silently ignored field.
void only_keys(const json& obj, const std::string& path, std::initializer_list<const char*> keys);
// The page a List* call asks for: its NextToken (a token this service's previous page gave: the offset where the
// next page starts), or 0 without one.
std::int64_t page_offset(const json& body);
// A union: exactly one member, and it must be one of `members`. Returns the member's name.
std::string union_member(const json& j, const std::string& path, std::span<const char* const> members);
std::string union_member(const json& j, const std::string& path, std::initializer_list<const char*> members);

}  // namespace read

}  // namespace rlloop::wire
