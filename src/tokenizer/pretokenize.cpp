// The regex strings each scanner implements, as they appear in tokenizer.json files.
#include "pretokenize.hpp"

namespace rlloop::tokenizer_detail {
namespace {
constexpr const char* kGpt2 = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
constexpr const char* kLlama3 =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kQwen2 =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
}  // namespace

bool split_pattern_from_regex(std::string_view regex, SplitPattern& out) {
  if (regex == kGpt2)
    out = SplitPattern::gpt2;
  else if (regex == kLlama3)
    out = SplitPattern::llama3;
  else if (regex == kQwen2)
    out = SplitPattern::qwen2;
  else
    return false;
  return true;
}

}  // namespace rlloop::tokenizer_detail
