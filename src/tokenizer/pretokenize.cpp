// The regex strings each scanner implements, as they appear in tokenizer.json files.
#include "pretokenize.hpp"

namespace rlloop::tokenizer_detail {
namespace {
constexpr const char* kGpt2 = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
constexpr const char* kLlama3 =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kQwen2 =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
// tiktoken's spelling (and gpt-oss's tokenizer.json's), and js-tiktoken's, which expands the case-insensitive group.
constexpr const char* kO200k =
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|)"
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|)"
    R"(\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kO200kExpandedCase =
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+)"
    R"(('s|'S|'t|'T|'re|'rE|'Re|'RE|'ve|'vE|'Ve|'VE|'m|'M|'ll|'lL|'Ll|'LL|'d|'D)?|)"
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*)"
    R"(('s|'S|'t|'T|'re|'rE|'Re|'RE|'ve|'vE|'Ve|'VE|'m|'M|'ll|'lL|'Ll|'LL|'d|'D)?|)"
    R"(\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
}  // namespace

const char* split_regex(SplitPattern pattern) {
  switch (pattern) {
    case SplitPattern::llama3: return kLlama3;
    case SplitPattern::qwen2: return kQwen2;
    case SplitPattern::o200k: return kO200k;
    case SplitPattern::gpt2:
    case SplitPattern::gpt2_digits: return nullptr;
  }
  return nullptr;
}

bool split_pattern_from_regex(std::string_view regex, SplitPattern& out) {
  if (regex == kGpt2)
    out = SplitPattern::gpt2;
  else if (regex == kLlama3)
    out = SplitPattern::llama3;
  else if (regex == kQwen2)
    out = SplitPattern::qwen2;
  else if (regex == kO200k || regex == kO200kExpandedCase)
    out = SplitPattern::o200k;
  else
    return false;
  return true;
}

}  // namespace rlloop::tokenizer_detail
