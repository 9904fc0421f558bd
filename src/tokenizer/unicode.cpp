// Character classes and NFC over the tables generated into unicode_tables.inc.
#include "unicode.hpp"

#include <algorithm>
#include <array>
#include <cstddef>
#include <vector>

namespace rlloop::tokenizer_detail {
namespace {

struct ClassRange {
  char32_t first, last;
  std::uint8_t cls;
};
struct Decomposition {
  char32_t cp;
  std::uint16_t offset, length;
};
struct MarkRank {
  char32_t cp;
  std::uint8_t rank;  // order-preserving stand-in for the canonical combining class; 0 = starter
};
struct Composition {
  char32_t first, second, composite;
};

#include "unicode_tables.inc"

constexpr std::array<CharClass, 128> make_ascii_classes() {
  std::array<CharClass, 128> t{};
  for (int c = 0; c < 128; ++c) {
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'))
      t[c] = CharClass::letter;
    else if (c >= '0' && c <= '9')
      t[c] = CharClass::number;
    else if (c == ' ' || (c >= '\t' && c <= '\r'))
      t[c] = CharClass::space;
    else
      t[c] = CharClass::other;
  }
  return t;
}
constexpr auto kAscii = make_ascii_classes();

// Hangul syllables compose and decompose arithmetically (Unicode 3.12).
constexpr char32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
constexpr char32_t kLCount = 19, kVCount = 21, kTCount = 28, kNCount = kVCount * kTCount, kSCount = kLCount * kNCount;

// Invalid bytes travel through normalization as values past the Unicode range.
constexpr char32_t kRawByteBase = 0x110000;

std::uint8_t mark_rank(char32_t cp) {
  if (cp < 0x300 || cp >= kRawByteBase) return 0;
  auto it = std::lower_bound(std::begin(kMarkRanks), std::end(kMarkRanks), cp,
                             [](const MarkRank& m, char32_t c) { return m.cp < c; });
  return (it != std::end(kMarkRanks) && it->cp == cp) ? it->rank : 0;
}

void decompose(char32_t cp, std::vector<char32_t>& out) {
  if (cp >= kSBase && cp < kSBase + kSCount) {
    const char32_t s = cp - kSBase;
    out.push_back(kLBase + s / kNCount);
    out.push_back(kVBase + (s % kNCount) / kTCount);
    if (s % kTCount) out.push_back(kTBase + s % kTCount);
    return;
  }
  if (cp >= 0xC0 && cp < kRawByteBase) {
    auto it = std::lower_bound(std::begin(kDecompositions), std::end(kDecompositions), cp,
                               [](const Decomposition& d, char32_t c) { return d.cp < c; });
    if (it != std::end(kDecompositions) && it->cp == cp) {
      out.insert(out.end(), kDecompositionData + it->offset, kDecompositionData + it->offset + it->length);
      return;
    }
  }
  out.push_back(cp);
}

// The primary composite of (first, second), or 0 when there is none.
char32_t compose_pair(char32_t first, char32_t second) {
  if (first >= kLBase && first < kLBase + kLCount && second >= kVBase && second < kVBase + kVCount)
    return kSBase + ((first - kLBase) * kVCount + (second - kVBase)) * kTCount;
  if (first >= kSBase && first < kSBase + kSCount && (first - kSBase) % kTCount == 0 && second > kTBase &&
      second < kTBase + kTCount)
    return first + (second - kTBase);
  auto it = std::lower_bound(std::begin(kCompositions), std::end(kCompositions), std::pair{first, second},
                             [](const Composition& c, const std::pair<char32_t, char32_t>& k) {
                               return c.first < k.first || (c.first == k.first && c.second < k.second);
                             });
  if (it != std::end(kCompositions) && it->first == first && it->second == second) return it->composite;
  return 0;
}

}  // namespace

namespace {
// The value of the range holding cp in a sorted table of ranges, or 0.
template <std::size_t N>
std::uint8_t range_value(const ClassRange (&table)[N], char32_t cp) {
  auto it = std::upper_bound(std::begin(table), std::end(table), cp,
                             [](char32_t c, const ClassRange& r) { return c < r.first; });
  if (it == std::begin(table)) return 0;
  --it;
  return cp <= it->last ? it->cls : 0;
}
}  // namespace

CharClass char_class(char32_t cp) {
  if (cp < 0x80) return kAscii[cp];
  return static_cast<CharClass>(range_value(kClassRanges, cp));
}

LetterCase letter_case(char32_t cp) {
  if (cp < 0x80) return cp >= 'A' && cp <= 'Z' ? LetterCase::upper : cp >= 'a' && cp <= 'z' ? LetterCase::lower
                                                                                            : LetterCase::none;
  return static_cast<LetterCase>(range_value(kCaseRanges, cp));
}

bool trivially_nfc(std::string_view text) {
  // U+0300 is the first code point whose NFC quick-check is not "yes"; its lead byte is 0xCC.
  for (unsigned char b : text)
    if (b >= 0xCC) return false;
  return true;
}

std::string nfc(std::string_view text) {
  if (trivially_nfc(text)) return std::string(text);
  std::vector<char32_t> cps;
  cps.reserve(text.size());
  for (std::size_t i = 0; i < text.size();) {
    const Decoded d = decode_utf8(text, i);
    if (d.valid)
      decompose(d.cp, cps);
    else
      cps.push_back(kRawByteBase + d.cp);
    i += d.len;
  }
  // Canonical ordering: stable sort of each run of marks by combining class (runs are short).
  for (std::size_t i = 1; i < cps.size(); ++i) {
    const std::uint8_t r = mark_rank(cps[i]);
    if (r == 0) continue;
    for (std::size_t j = i; j > 0 && mark_rank(cps[j - 1]) > r; --j) std::swap(cps[j], cps[j - 1]);
  }
  // Canonical composition: a character joins the last starter when nothing between them blocks it (an
  // intervening character blocks when it is a starter or has a class >= the candidate's).
  std::ptrdiff_t starter = -1;
  std::uint8_t last_rank = 0;
  std::size_t out_len = 0;
  for (std::size_t i = 0; i < cps.size(); ++i) {
    const char32_t c = cps[i];
    const std::uint8_t r = mark_rank(c);
    if (starter >= 0) {
      const bool adjacent = out_len == static_cast<std::size_t>(starter) + 1;
      if (adjacent || (last_rank != 0 && last_rank < r)) {
        if (const char32_t p = compose_pair(cps[static_cast<std::size_t>(starter)], c)) {
          cps[static_cast<std::size_t>(starter)] = p;
          continue;
        }
      }
    }
    if (r == 0) starter = static_cast<std::ptrdiff_t>(out_len);
    last_rank = r;
    cps[out_len++] = c;
  }
  cps.resize(out_len);
  std::string out;
  out.reserve(text.size());
  for (char32_t c : cps) {
    if (c >= kRawByteBase)
      out.push_back(static_cast<char>(c - kRawByteBase));
    else
      append_utf8(out, c);
  }
  return out;
}

}  // namespace rlloop::tokenizer_detail
