// Hand-written scanners equivalent to the pre-tokenizer split regexes of GPT-2, Llama 3, Qwen2/2.5/3 and o200k.
// A std::regex cannot express \p{L}, \p{N} or the lookahead `\s+(?!\S)`, and a scanner is much faster.
#pragma once
#include <cstddef>
#include <string>
#include <string_view>

namespace rlloop::tokenizer_detail {

enum class SplitPattern {
  // 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
  gpt2,
  // (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
  llama3,
  // The Llama 3 pattern with \p{N} (one digit per piece): Qwen2, Qwen2.5, Qwen3.
  qwen2,
  // Every \p{N} character a piece of its own first, then the GPT-2 pattern on the text between them: SmolLM and
  // SmolLM2 (tokenizer.json's Sequence [Digits(individual_digits), ByteLevel]; llama.cpp's pre-tokenizer "smollm").
  gpt2_digits,
  // OpenAI's o200k (GPT-4o, gpt-oss), words split at case changes with their contractions attached:
  // [^\r\n\p{L}\p{N}]?[U]*[W]+C?|[^\r\n\p{L}\p{N}]?[U]+[W]*C?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|
  // \s*[\r\n]+|\s+(?!\S)|\s+
  // with U = [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}], W = [\p{Ll}\p{Lm}\p{Lo}\p{M}], C = (?i:'s|'t|'re|'ve|'m|'ll|'d).
  o200k,
};

// The pattern a tokenizer.json regex string denotes, or nothing when it is not one we implement.
bool split_pattern_from_regex(std::string_view regex, SplitPattern& out);
// The regex a tokenizer.json's Split pre-tokenizer spells `pattern` with (tiktoken's spelling for o200k); nullptr
// for gpt2 and gpt2_digits, which tokenizer.json spells with ByteLevel's own regex (and Digits first).
const char* split_regex(SplitPattern pattern);

// Calls emit(start, end) for each piece of `text` (byte offsets), in order; the pieces tile the text.
// Invalid UTF-8 bytes are single characters of no class (like punctuation).
template <class Emit>
void split_pieces(SplitPattern pattern, std::string_view text, Emit&& emit);

}  // namespace rlloop::tokenizer_detail

#include "pretokenize_impl.hpp"
