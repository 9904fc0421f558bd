// Implementation of split_pieces (a template so the per-piece callback inlines into the encoder loop).
#pragma once
#include <algorithm>

#include "unicode.hpp"

namespace rlloop::tokenizer_detail {

namespace scan {

struct Char {
  CharClass cls;
  std::uint8_t len;
  char32_t cp;
};

inline Char at(std::string_view s, std::size_t i) {
  const auto b = static_cast<unsigned char>(s[i]);
  if (b < 0x80) return {char_class(b), 1, b};
  const Decoded d = decode_utf8(s, i);
  return {d.valid ? char_class(d.cp) : CharClass::invalid, d.len, d.cp};
}

// "Other" for the patterns: not whitespace, letter or number ([^\s\p{L}\p{N}]); invalid bytes count.
inline bool is_other(CharClass c) { return c == CharClass::other || c == CharClass::invalid; }
inline bool is_newline(char32_t cp) { return cp == '\r' || cp == '\n'; }

// Length of a contraction ('s 't 're 've 'm 'll 'd) at i, or 0.
inline std::size_t contraction(std::string_view s, std::size_t i, bool ignore_case) {
  if (i + 1 >= s.size() || s[i] != '\'') return 0;
  auto low = [&](char c) { return ignore_case && c >= 'A' && c <= 'Z' ? static_cast<char>(c + 32) : c; };
  const char a = low(s[i + 1]);
  if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
  if (i + 2 >= s.size()) return 0;
  const char b = low(s[i + 2]);
  if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
  return 0;
}

// End of the run of characters of class `cls` starting at i (max_count characters at most).
template <class Pred>
inline std::size_t run(std::string_view s, std::size_t i, Pred pred, std::size_t max_count = ~std::size_t{0}) {
  std::size_t n = 0;
  while (i < s.size() && n < max_count) {
    const Char c = at(s, i);
    if (!pred(c)) break;
    i += c.len;
    ++n;
  }
  return i;
}

// Whitespace at i: `\s+(?!\S)|\s+` — the run, minus its last character when a non-space follows and the
// run is longer than one character (so that the last space can lead the next word).
inline std::size_t trailing_space_rule(std::string_view s, std::size_t i) {
  std::size_t end = i, last = i, count = 0;
  while (end < s.size()) {
    const Char c = at(s, end);
    if (c.cls != CharClass::space) break;
    last = end;
    end += c.len;
    ++count;
  }
  if (end < s.size() && count > 1) return last;
  return end;
}

// Whitespace at i in the Llama 3 / Qwen2 / o200k patterns: `\s*[\r\n]+` (the run up to and including its last
// newline, if it has one), else `\s+(?!\S)|\s+`.
inline std::size_t space_piece(std::string_view s, std::size_t i) {
  std::size_t j = i, last_newline_end = 0;
  while (j < s.size()) {
    const Char w = at(s, j);
    if (w.cls != CharClass::space) break;
    j += w.len;
    if (is_newline(w.cp)) last_newline_end = j;
  }
  return last_newline_end ? last_newline_end : trailing_space_rule(s, i);
}

// The single-regex patterns (all but gpt2_digits).
template <class Emit>
void split_regex_pieces(SplitPattern pattern, std::string_view s, Emit&& emit) {
  const auto letter = [](const scan::Char& c) { return c.cls == CharClass::letter; };
  const auto number = [](const scan::Char& c) { return c.cls == CharClass::number; };
  const auto other = [](const scan::Char& c) { return scan::is_other(c.cls); };
  const auto newline = [](const scan::Char& c) { return scan::is_newline(c.cp) && c.cls == CharClass::space; };
  std::size_t i = 0;
  while (i < s.size()) {
    const scan::Char c = at(s, i);
    std::size_t end = 0;
    if (pattern == SplitPattern::gpt2) {
      if (std::size_t n = scan::contraction(s, i, false)) {
        end = i + n;
      } else {
        // ` ?X+` for the three classes: an optional single space joins the run that follows it.
        std::size_t j = i;
        scan::Char d = c;
        if (c.cp == ' ' && i + 1 < s.size()) {
          d = at(s, i + 1);
          if (d.cls == CharClass::letter || d.cls == CharClass::number || scan::is_other(d.cls))
            j = i + 1;
          else
            d = c;
        }
        if (d.cls == CharClass::letter)
          end = scan::run(s, j, letter);
        else if (d.cls == CharClass::number)
          end = scan::run(s, j, number);
        else if (scan::is_other(d.cls))
          end = scan::run(s, j, other);
        else
          end = scan::trailing_space_rule(s, i);
      }
    } else {
      const std::size_t max_digits = pattern == SplitPattern::llama3 ? 3 : 1;
      if (std::size_t n = scan::contraction(s, i, true)) {
        end = i + n;
      } else if (c.cls == CharClass::letter) {
        end = scan::run(s, i, letter);
      } else if (c.cls != CharClass::number && !(c.cls == CharClass::space && scan::is_newline(c.cp)) &&
                 i + c.len < s.size() && at(s, i + c.len).cls == CharClass::letter) {
        // [^\r\n\p{L}\p{N}]?\p{L}+ : one non-letter, non-digit, non-newline character leads a word.
        end = scan::run(s, i + c.len, letter);
      } else if (c.cls == CharClass::number) {
        end = scan::run(s, i, number, max_digits);
      } else if (scan::is_other(c.cls) || (c.cp == ' ' && i + 1 < s.size() && scan::is_other(at(s, i + 1).cls))) {
        // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
        end = scan::run(s, c.cp == ' ' ? i + 1 : i, other);
        end = scan::run(s, end, newline);
      } else {
        end = scan::space_piece(s, i);  // c is whitespace
      }
    }
    emit(i, end);
    i = end;
  }
}

// o200k's word sets (SplitPattern::o200k): U = upper, title, modifier and other letters and marks; W = lower,
// modifier and other letters and marks. An invalid byte is in neither.
inline LetterCase case_of(const Char& c) { return c.cls == CharClass::invalid ? LetterCase::none : letter_case(c.cp); }
inline bool in_upper_set(const Char& c) {
  const LetterCase l = case_of(c);
  return l == LetterCase::upper || l == LetterCase::caseless || l == LetterCase::mark;
}
inline bool in_lower_set(const Char& c) {
  const LetterCase l = case_of(c);
  return l == LetterCase::lower || l == LetterCase::caseless || l == LetterCase::mark;
}
// [^\r\n\p{L}\p{N}]: the character that may lead a word (a space, punctuation, a mark, an invalid byte).
inline bool leads_word(const Char& c) {
  return c.cls != CharClass::letter && c.cls != CharClass::number && !(c.cls == CharClass::space && is_newline(c.cp));
}
constexpr std::size_t kNoMatch = ~std::size_t{0};

// `[U]*[W]+` at j: U* as far as it goes, then W+; when no W character follows, U* gives characters back until
// the last one it took that is also in W, which then is W+'s only character. kNoMatch when nothing fits.
inline std::size_t upper_then_lower(std::string_view s, std::size_t j) {
  std::size_t k = j, last_lower_end = kNoMatch;
  while (k < s.size()) {
    const Char c = at(s, k);
    if (!in_upper_set(c)) break;
    k += c.len;
    if (in_lower_set(c)) last_lower_end = k;
  }
  if (k < s.size() && in_lower_set(at(s, k))) return run(s, k, in_lower_set);
  return last_lower_end;
}

// `[U]+[W]*` at j, or kNoMatch.
inline std::size_t upper_run_then_lower(std::string_view s, std::size_t j) {
  if (j >= s.size() || !in_upper_set(at(s, j))) return kNoMatch;
  return run(s, run(s, j, in_upper_set), in_lower_set);
}

// The two word alternatives of o200k at i, each tried with its optional leading character first, then
// without; the end of the word and its contraction, or kNoMatch.
inline std::size_t o200k_word(std::string_view s, std::size_t i) {
  const Char c = at(s, i);
  const bool lead = leads_word(c);
  for (auto body : {upper_then_lower, upper_run_then_lower}) {
    std::size_t end = lead && i + c.len < s.size() ? body(s, i + c.len) : kNoMatch;
    if (end == kNoMatch) end = body(s, i);
    if (end != kNoMatch) return end + contraction(s, end, true);
  }
  return kNoMatch;
}

// SplitPattern::o200k.
template <class Emit>
void split_o200k_pieces(std::string_view s, Emit&& emit) {
  const auto number = [](const Char& c) { return c.cls == CharClass::number; };
  const auto other = [](const Char& c) { return is_other(c.cls); };
  const auto newline_or_slash = [](const Char& c) {
    return (is_newline(c.cp) && c.cls == CharClass::space) || c.cp == '/';
  };
  std::size_t i = 0;
  while (i < s.size()) {
    const Char c = at(s, i);
    std::size_t end = o200k_word(s, i);
    if (end == kNoMatch) {
      if (c.cls == CharClass::number)
        end = run(s, i, number, 3);
      else if (is_other(c.cls) || (c.cp == ' ' && i + 1 < s.size() && is_other(at(s, i + 1).cls)))
        end = run(s, run(s, c.cp == ' ' ? i + 1 : i, other), newline_or_slash);  // ` ?[^\s\p{L}\p{N}]+[\r\n/]*`
      else
        end = space_piece(s, i);
    }
    end = std::max(end, i + c.len);  // never an empty piece, whatever the tables say of a character
    emit(i, end);
    i = end;
  }
}

}  // namespace scan

template <class Emit>
void split_pieces(SplitPattern pattern, std::string_view s, Emit&& emit) {
  if (pattern == SplitPattern::o200k) return scan::split_o200k_pieces(s, emit);
  if (pattern != SplitPattern::gpt2_digits) return scan::split_regex_pieces(pattern, s, emit);
  // Each number character alone; the GPT-2 pattern sees the text between two of them as a whole text (so a space
  // before a digit is a piece of its own, as llama.cpp and the Digits pre-tokenizer make it).
  std::size_t from = 0, i = 0;
  auto flush = [&](std::size_t to) {
    if (to > from)
      scan::split_regex_pieces(SplitPattern::gpt2, s.substr(from, to - from),
                               [&](std::size_t a, std::size_t b) { emit(from + a, from + b); });
  };
  while (i < s.size()) {
    const scan::Char c = scan::at(s, i);
    if (c.cls == CharClass::number) {
      flush(i);
      emit(i, i + c.len);
      from = i + c.len;
    }
    i += c.len;
  }
  flush(s.size());
}

}  // namespace rlloop::tokenizer_detail
