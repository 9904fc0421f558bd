// UTF-8 decoding and the Unicode character facts the tokenizer needs: the class of a code point as the
// pre-tokenizer regexes see it (\p{L}, \p{N}, \s, letter cases) and NFC normalization.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>

namespace rlloop::tokenizer_detail {

// Class of a code point in the pre-tokenizer patterns. `invalid` marks a byte that is not part of valid
// UTF-8: it belongs to no class (like punctuation) so byte-level BPE can still carry it through unchanged.
enum class CharClass : std::uint8_t { other = 0, letter = 1, number = 2, space = 3, invalid = 4 };

struct Decoded {
  char32_t cp;       // the code point, or the raw byte when the sequence is invalid
  std::uint8_t len;  // bytes consumed (1 for an invalid byte)
  bool valid;
};

// Decodes one UTF-8 sequence at s[i] (i < s.size()). Rejects overlong forms, surrogates and values past
// U+10FFFF, consuming exactly one byte in that case.
inline Decoded decode_utf8(std::string_view s, std::size_t i) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  if (b0 < 0x80) return {b0, 1, true};
  int n;
  char32_t cp;
  char32_t min;
  if ((b0 & 0xE0) == 0xC0)
    n = 1, cp = b0 & 0x1F, min = 0x80;
  else if ((b0 & 0xF0) == 0xE0)
    n = 2, cp = b0 & 0x0F, min = 0x800;
  else if ((b0 & 0xF8) == 0xF0)
    n = 3, cp = b0 & 0x07, min = 0x10000;
  else
    return {b0, 1, false};
  if (i + static_cast<std::size_t>(n) >= s.size()) return {b0, 1, false};  // truncated sequence
  for (int k = 1; k <= n; ++k) {
    const auto b = static_cast<unsigned char>(s[i + k]);
    if ((b & 0xC0) != 0x80) return {b0, 1, false};
    cp = (cp << 6) | (b & 0x3F);
  }
  if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return {b0, 1, false};
  return {cp, static_cast<std::uint8_t>(n + 1), true};
}

inline void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// Class of a valid code point, with ECMAScript's definition of \s (what the reference implementations use).
CharClass char_class(char32_t cp);

// What o200k's pattern asks of a letter or mark: its word sets are [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}] (upper,
// caseless, mark) and [\p{Ll}\p{Lm}\p{Lo}\p{M}] (lower, caseless, mark). A mark is not \p{L}: its CharClass is
// other.
enum class LetterCase : std::uint8_t { none = 0, upper = 1, lower = 2, caseless = 3, mark = 4 };
LetterCase letter_case(char32_t cp);

// Unicode Normalization Form C. Invalid UTF-8 bytes are kept as they are and block composition.
std::string nfc(std::string_view text);

// True when no code point in the text is >= U+0300: such text is already in NFC (fast path).
bool trivially_nfc(std::string_view text);

}  // namespace rlloop::tokenizer_detail
