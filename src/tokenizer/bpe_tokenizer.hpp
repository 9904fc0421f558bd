// Byte-level BPE (GPT-2, Llama 3, Qwen2/2.5/3): added tokens matched first and never split, optional NFC,
// a pre-tokenizer split pattern, then merges by rank over the bytes of each piece.
#pragma once
#include <array>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <rlloop/tokenizer.hpp>

#include "pretokenize.hpp"

namespace rlloop::tokenizer_detail {

// Hash for maps keyed by std::string that are looked up by string_view without building a string (a hot lookup of
// both tokenizers).
struct StringHash {
  using is_transparent = void;
  std::size_t operator()(std::string_view s) const noexcept { return std::hash<std::string_view>{}(s); }
};
using StringMap = std::unordered_map<std::string, token_id, StringHash, std::equal_to<>>;

struct AddedToken {
  std::string content;
  token_id id = 0;
  bool special = true;
};

// Everything a byte-level BPE tokenizer is made of, with token strings already turned into raw bytes.
struct BpeSpec {
  std::string source;  // the file(s) it came from, for error messages
  std::vector<std::pair<std::string, token_id>> vocab;
  std::vector<std::pair<std::string, std::string>> merges;  // in rank order
  // tiktoken's rule instead of merges: of the adjacent pairs whose bytes together are a token, the one whose token
  // has the lowest id (its rank) merges, leftmost first, one pair at a time.
  bool merge_by_rank = false;
  std::vector<AddedToken> added_tokens;
  SplitPattern pattern = SplitPattern::gpt2;
  bool nfc = false;
  std::optional<std::string> eos_token;
};

// Open-addressing map from a pair of token ids to (merge rank, merged id): the hot lookup of BPE.
class MergeTable {
 public:
  struct Entry {
    std::uint64_t key;
    std::int32_t rank;
    token_id merged;
  };
  void build(const std::vector<Entry>& entries);
  const Entry* find(token_id a, token_id b) const {
    const std::uint64_t key = pack(a, b);
    for (std::size_t i = slot(key);; i = (i + 1) & mask_) {
      const Entry& e = slots_[i];
      if (e.key == key) return &e;
      if (e.key == kEmpty) return nullptr;
    }
  }

 private:
  static constexpr std::uint64_t kEmpty = ~std::uint64_t{0};
  static std::uint64_t pack(token_id a, token_id b) {
    return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(a)) << 32) | static_cast<std::uint32_t>(b);
  }
  std::size_t slot(std::uint64_t key) const { return (key * 0x9E3779B97F4A7C15ull) >> shift_; }
  std::vector<Entry> slots_;
  std::size_t mask_ = 0;
  int shift_ = 64;
};

class BpeTokenizer final : public Tokenizer {
 public:
  explicit BpeTokenizer(BpeSpec spec);

  std::vector<token_id> encode(std::string_view text, bool allow_special = true) const override;
  std::string decode(std::span<const token_id> ids, bool skip_special = false) const override;
  std::int64_t vocab_size() const override { return static_cast<std::int64_t>(id_to_bytes_.size()); }
  std::optional<token_id> token_to_id(std::string_view token) const override;
  std::optional<token_id> eos_token_id() const override { return eos_; }

 private:

  void encode_ordinary(std::string_view text, std::vector<token_id>& out) const;
  void encode_piece(std::string_view piece, std::vector<token_id>& out) const;
  // The piece's tokens by the merges table (GPT-2's procedure) or by token rank (tiktoken's).
  std::vector<token_id> merge_by_table(std::string_view piece) const;
  std::vector<token_id> merge_by_rank(std::string_view piece) const;
  // Leftmost-longest added token starting at text[i], or nullptr.
  const AddedToken* match_added(std::string_view text, std::size_t i, bool allow_special) const;

  std::string source_;
  SplitPattern pattern_;
  bool nfc_;
  bool merge_by_rank_;
  std::vector<std::string> id_to_bytes_;
  std::vector<std::uint8_t> id_kind_;  // 0 = unused id, 1 = BPE token, 2 = added token, 3 = special added token
  StringMap bytes_to_id_;
  static constexpr token_id kNoToken = -1;
  std::array<token_id, 256> byte_ids_{};  // kNoToken for a byte the vocabulary lacks
  MergeTable merges_;
  std::vector<AddedToken> added_;  // longest first, so the first match is the longest
  std::array<bool, 256> added_first_byte_{};
  std::optional<token_id> eos_;

  // Pieces repeat a lot in natural text; caching their ids is what makes encoding fast.
  static constexpr std::size_t kCacheMaxEntries = 1 << 18;
  static constexpr std::size_t kCacheMaxPieceBytes = 64;
  mutable std::mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<token_id>, StringHash, std::equal_to<>> cache_;
};

}  // namespace rlloop::tokenizer_detail
