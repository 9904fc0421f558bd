#include "spm_tokenizer.hpp"

#include <algorithm>
#include <queue>

#include <rlloop/error.hpp>

namespace rlloop::tokenizer_detail {
namespace {

constexpr std::string_view kSpace = "\xE2\x96\x81";  // U+2581, SentencePiece's visible space

// Bytes in the UTF-8 sequence a lead byte starts, from its high four bits as llama.cpp counts them (a stray
// continuation byte is 1; 0xF8..0xFF, never valid, count 4 as 0xF0..0xF7 do).
std::size_t utf8_length(unsigned char lead) {
  static constexpr std::size_t by_high_bits[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
  return by_high_bits[lead >> 4];
}

// The byte a piece "<0x41>" stands for (two hex digits, either case), or -1 for any other text.
int byte_piece_value(const std::string& text) {
  auto hex = [](char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  if (text.size() != 6 || text.compare(0, 3, "<0x") != 0 || text[5] != '>') return -1;
  const int high = hex(text[3]), low = hex(text[4]);
  return high < 0 || low < 0 ? -1 : high * 16 + low;
}

std::uint64_t pair_key(token_id a, token_id b) {
  return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(a)) << 32) | static_cast<std::uint32_t>(b);
}

}  // namespace

SpmTokenizer::SpmTokenizer(SpmSpec spec)
    : source_(std::move(spec.source)),
      pieces_(std::move(spec.pieces)),
      byte_ids_(256, -1),
      add_space_prefix_(spec.add_space_prefix),
      prefix_after_special_(spec.prefix_after_special),
      prefix_unless_space_(spec.prefix_unless_space),
      eos_(spec.eos),
      unk_(spec.unk) {
  const auto n = static_cast<token_id>(pieces_.size());
  for (token_id id = 0; id < n; ++id) {
    const SpmPiece& p = pieces_[static_cast<std::size_t>(id)];
    if (p.text.empty()) continue;  // an unused id (a gap in a tokenizer.json's numbering)
    // A later duplicate is unreachable by text (llama.cpp keeps the last one it reads; both exist by id).
    ids_[p.text] = id;
    if (p.type == PieceType::control || p.type == PieceType::unknown || p.type == PieceType::user_defined) {
      specials_.push_back(id);
      special_first_byte_[static_cast<unsigned char>(p.text[0])] = true;
    }
    if (p.type == PieceType::byte) {
      const int value = byte_piece_value(p.text);
      if (value < 0)
        throw invalid_argument("load_tokenizer: '" + source_ + "': byte piece " + std::to_string(id) + " is '" +
                               p.text + "', not <0xXX>");
      byte_ids_[static_cast<std::size_t>(value)] = id;
    }
  }
  std::stable_sort(specials_.begin(), specials_.end(), [&](token_id a, token_id b) {
    return pieces_[static_cast<std::size_t>(a)].text.size() > pieces_[static_cast<std::size_t>(b)].text.size();
  });
  for (auto id : {eos_, unk_})
    if (id && (*id < 0 || *id >= n))
      throw invalid_argument("load_tokenizer: '" + source_ + "': special token id " + std::to_string(*id) +
                             " is not in the vocabulary of " + std::to_string(n));
  for (std::size_t rank = 0; rank < spec.merges.size(); ++rank) {
    const auto& [left, right] = spec.merges[rank];
    const auto a = find(left), b = find(right), merged = find(left + right);
    if (!a || !b || !merged)
      throw invalid_argument("load_tokenizer: '" + source_ + "': merge '" + left + " " + right +
                             "' names a piece the vocabulary lacks");
    // The first listing of a pair is its rank, as in Hugging Face's BPE.
    ranks_.try_emplace(pair_key(*a, *b), static_cast<std::int32_t>(rank), *merged);
  }
}

std::optional<token_id> SpmTokenizer::find(std::string_view text) const {
  const auto it = ids_.find(text);
  if (it == ids_.end()) return std::nullopt;
  return it->second;
}

const SpmPiece* SpmTokenizer::match_special(std::string_view text, std::size_t at, bool allow_special,
                                            token_id& id) const {
  if (!special_first_byte_[static_cast<unsigned char>(text[at])]) return nullptr;
  for (token_id s : specials_) {
    const SpmPiece& p = pieces_[static_cast<std::size_t>(s)];
    if (!allow_special && p.type != PieceType::user_defined) continue;
    if (text.compare(at, p.text.size(), p.text) == 0) {
      id = s;
      return &p;
    }
  }
  return nullptr;
}

std::vector<token_id> SpmTokenizer::encode(std::string_view text, bool allow_special) const {
  std::vector<token_id> out;
  out.reserve(text.size() / 3 + 4);
  bool after_special = true;  // the input's start counts as one: it gets the space prefix too
  std::size_t segment = 0;
  for (std::size_t i = 0; i < text.size();) {
    token_id id = 0;
    if (const SpmPiece* p = match_special(text, i, allow_special, id)) {
      if (i > segment) {
        encode_text(text.substr(segment, i - segment), after_special, out);
      }
      out.push_back(id);
      after_special = prefix_after_special_;
      i += p->text.size();
      segment = i;
    } else {
      ++i;
    }
  }
  if (segment < text.size()) encode_text(text.substr(segment), after_special, out);
  return out;
}

void SpmTokenizer::encode_text(std::string_view raw, bool space_prefix, std::vector<token_id>& out) const {
  std::string text;
  text.reserve(raw.size() + 8);
  const bool starts_with_space = raw.starts_with(' ') || raw.starts_with(kSpace);
  if (add_space_prefix_ && space_prefix && !(prefix_unless_space_ && starts_with_space)) text += kSpace;
  for (char c : raw) {
    if (c == ' ')
      text += kSpace;
    else
      text += c;
  }
  // Symbols: one per UTF-8 character, linked so that a merge removes its right half from the chain. By rank, a
  // character without a piece is one symbol per byte instead, each its byte piece, which no merge lists.
  const bool by_rank = !ranks_.empty();
  struct Symbol {
    std::size_t start = 0, size = 0;
    int prev = -1, next = -1;
    token_id id = -1;  // by rank: the piece the symbol is (-1: the unknown piece, a byte without a byte piece)
  };
  std::vector<Symbol> symbols;
  auto add_symbol = [&](std::size_t at, std::size_t n, token_id id) {
    const int index = static_cast<int>(symbols.size());
    symbols.push_back({at, n, index - 1, index + 1, id});
  };
  for (std::size_t at = 0; at < text.size();) {
    const std::size_t n = std::min(utf8_length(static_cast<unsigned char>(text[at])), text.size() - at);
    const auto piece = by_rank ? find(std::string_view(text).substr(at, n)) : std::nullopt;
    if (!by_rank || piece) {
      add_symbol(at, n, piece.value_or(-1));
    } else {
      for (std::size_t k = 0; k < n; ++k) add_symbol(at + k, 1, byte_ids_[static_cast<unsigned char>(text[at + k])]);
    }
    at += n;
  }
  if (!symbols.empty()) symbols.back().next = -1;
  // Candidate merges, best first: the higher score, then the leftmost.
  struct Bigram {
    int left, right;
    float score;
    std::size_t size;
    token_id merged;  // by rank: the piece the pair becomes
  };
  auto worse = [](const Bigram& a, const Bigram& b) {
    return a.score < b.score || (a.score == b.score && a.left > b.left);
  };
  std::priority_queue<Bigram, std::vector<Bigram>, decltype(worse)> queue(worse);
  auto consider = [&](int left, int right) {
    if (left < 0 || right < 0) return;
    const std::size_t size = symbols[left].size + symbols[right].size;
    if (by_rank) {
      if (symbols[left].id < 0 || symbols[right].id < 0) return;
      const auto it = ranks_.find(pair_key(symbols[left].id, symbols[right].id));
      if (it != ranks_.end())
        queue.push({left, right, -static_cast<float>(it->second.first), size, it->second.second});
      return;
    }
    const auto id = find(std::string_view(text).substr(symbols[left].start, size));
    if (!id) return;
    queue.push({left, right, pieces_[static_cast<std::size_t>(*id)].score, size, *id});
  };
  for (int i = 1; i < static_cast<int>(symbols.size()); ++i) consider(i - 1, i);
  while (!queue.empty()) {
    const Bigram b = queue.top();
    queue.pop();
    Symbol& left = symbols[b.left];
    Symbol& right = symbols[b.right];
    // Stale: one side has merged with something else since this candidate was queued.
    if (left.size == 0 || right.size == 0 || left.size + right.size != b.size) continue;
    left.id = b.merged;
    left.size += right.size;
    right.size = 0;
    left.next = right.next;
    if (right.next >= 0) symbols[right.next].prev = b.left;
    consider(left.prev, b.left);
    consider(b.left, left.next);
  }
  for (int i = symbols.empty() ? -1 : 0; i != -1; i = symbols[i].next) {
    if (!by_rank) {
      emit_symbol(std::string_view(text).substr(symbols[i].start, symbols[i].size), out);
    } else if (symbols[i].id >= 0) {
      out.push_back(symbols[i].id);
    } else if (unk_ && (out.empty() || out.back() != *unk_ || i == 0 || symbols[symbols[i].prev].id >= 0)) {
      out.push_back(*unk_);  // consecutive unknown bytes fuse into one unknown piece (fuse_unk)
    }
  }
}

void SpmTokenizer::emit_symbol(std::string_view symbol, std::vector<token_id>& out) const {
  if (const auto id = find(symbol)) {
    out.push_back(*id);
    return;
  }
  // No piece: byte pieces, else the byte as a one-character piece, else the unknown piece.
  for (char c : symbol) {
    const token_id b = byte_ids_[static_cast<unsigned char>(c)];
    if (b >= 0) {
      out.push_back(b);
    } else if (const auto single = find(std::string_view(&c, 1))) {
      out.push_back(*single);
    } else if (unk_) {
      out.push_back(*unk_);
    }
  }
}

std::string SpmTokenizer::decode(std::span<const token_id> ids, bool skip_special) const {
  std::string out;
  out.reserve(ids.size() * 4);
  for (token_id id : ids) {
    if (id < 0 || static_cast<std::size_t>(id) >= pieces_.size())
      throw invalid_argument("decode: token id " + std::to_string(id) + " is out of range [0, " +
                             std::to_string(pieces_.size()) + ") in '" + source_ + "'");
    const SpmPiece& p = pieces_[static_cast<std::size_t>(id)];
    std::string piece;
    switch (p.type) {
      case PieceType::control:
      case PieceType::unknown:
        if (!skip_special) piece = p.text;
        break;
      case PieceType::user_defined:
        piece = p.text;
        break;
      case PieceType::normal:
        for (std::size_t at = 0; at < p.text.size();) {
          if (p.text.compare(at, kSpace.size(), kSpace) == 0) {
            piece += ' ';
            at += kSpace.size();
          } else {
            piece += p.text[at++];
          }
        }
        break;
      case PieceType::byte:
        piece += static_cast<char>(byte_piece_value(p.text));  // checked when the vocabulary was read
        break;
      case PieceType::unused:
        break;
    }
    out += piece;
  }
  return out;
}

std::optional<token_id> SpmTokenizer::token_to_id(std::string_view token) const {
  if (const auto id = find(token)) return id;
  // The raw text of a piece, spaces as spaces: " the" finds "▁the".
  std::string escaped;
  for (char c : token) {
    if (c == ' ')
      escaped += kSpace;
    else
      escaped += c;
  }
  return find(escaped);
}

}  // namespace rlloop::tokenizer_detail
