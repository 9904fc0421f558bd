// GPT-2's byte-level alphabet: each byte is shown as a printable code point in vocab files
// (space -> 'Ġ' U+0120, newline -> 'Ċ' U+010A, ...). Token strings in encoder.json / tokenizer.json are
// written in this alphabet; inside rlloop tokens are kept as the raw bytes they stand for.
#pragma once
#include <array>
#include <optional>
#include <string>
#include <string_view>

#include "unicode.hpp"

namespace rlloop::tokenizer_detail {

// The code point that shows byte b.
inline char32_t byte_to_char(unsigned char b) {
  static const std::array<char32_t, 256> table = [] {
    std::array<char32_t, 256> t{};
    char32_t next = 256;
    for (int c = 0; c < 256; ++c) {
      const bool printable = (c >= '!' && c <= '~') || (c >= 0xA1 && c <= 0xAC) || (c >= 0xAE && c <= 0xFF);
      t[c] = printable ? static_cast<char32_t>(c) : next++;
    }
    return t;
  }();
  return table[b];
}

// The raw bytes a byte-level token string stands for, or nothing when it uses a character outside the alphabet.
inline std::optional<std::string> byte_level_to_bytes(std::string_view token) {
  static const std::array<int, 324> inverse = [] {
    std::array<int, 324> t{};
    t.fill(-1);
    for (int b = 0; b < 256; ++b) t[byte_to_char(static_cast<unsigned char>(b))] = b;
    return t;
  }();
  std::string out;
  out.reserve(token.size());
  for (std::size_t i = 0; i < token.size();) {
    const Decoded d = decode_utf8(token, i);
    if (!d.valid || d.cp >= inverse.size() || inverse[d.cp] < 0) return std::nullopt;
    out.push_back(static_cast<char>(inverse[d.cp]));
    i += d.len;
  }
  return out;
}

inline std::string bytes_to_byte_level(std::string_view bytes) {
  std::string out;
  for (unsigned char b : bytes) append_utf8(out, byte_to_char(b));
  return out;
}

}  // namespace rlloop::tokenizer_detail
