// SentencePiece-style BPE (Llama 2, TinyLlama, Mistral v0.1): spaces written as U+2581 ("▁") with one prepended to
// each stretch of text that starts the input or follows a special token, then adjacent symbols merged again and
// again; characters no piece covers become byte pieces (<0x41>). Two ways to choose the next merge:
//  - by score, as llama.cpp runs the GGUF "llama" model: the adjacent pair whose concatenation is a piece with the
//    highest score (any such pair);
//  - by rank, as Hugging Face runs a tokenizer.json BPE model with byte_fallback: the adjacent pair of the merge list
//    with the lowest rank (only listed pairs; unknown characters become byte pieces first, which never merge).
#pragma once
#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <rlloop/tokenizer.hpp>

#include "bpe_tokenizer.hpp"  // StringHash, StringMap

namespace rlloop::tokenizer_detail {

// llama.cpp's token types (llama_token_type), as tokenizer.ggml.token_type stores them.
enum class PieceType : std::int32_t { normal = 1, unknown = 2, control = 3, user_defined = 4, unused = 5, byte = 6 };

struct SpmPiece {
  std::string text;  // as the vocabulary writes it: "▁the", "<0x0A>", "<s>"
  float score = 0;
  PieceType type = PieceType::normal;
};

struct SpmSpec {
  std::string source;  // the file it came from, for error messages
  std::vector<SpmPiece> pieces;  // by id
  bool add_space_prefix = true;
  // Where the prefix goes: before each stretch of text at the start or after a special token (llama.cpp, Hugging
  // Face's legacy normalizer, Metaspace's "always"), or only before text at the very start (Metaspace's "first").
  bool prefix_after_special = true;
  // Metaspace's rule: no prefix for text that already starts with a space (or "▁").
  bool prefix_unless_space = false;
  std::optional<token_id> eos;
  std::optional<token_id> unk;
  // Empty: merges by score. Otherwise the merge list in rank order (pieces' texts), and merges go by rank.
  std::vector<std::pair<std::string, std::string>> merges;
};

class SpmTokenizer final : public Tokenizer {
 public:
  // Throws invalid_argument naming the source for duplicate pieces or ids out of range.
  explicit SpmTokenizer(SpmSpec spec);

  // Control and unknown pieces written in the text are matched when allow_special is set, user-defined ones always
  // (the longest at the leftmost place). No BOS is added: chat renderers and callers write it.
  std::vector<token_id> encode(std::string_view text, bool allow_special = true) const override;
  // Pieces with "▁" as spaces, byte pieces as their bytes, control and unknown ones as their text unless skipped.
  // Concatenative, as every rlloop tokenizer: decode(a) + decode(b) == decode(a + b), which streaming decoders
  // rely on. So the space prefix encode added stays (" Hello"), where llama.cpp's detokenizer and Hugging Face's
  // decoder drop one leading space from a whole sequence ("Hello").
  std::string decode(std::span<const token_id> ids, bool skip_special = false) const override;
  std::int64_t vocab_size() const override { return static_cast<std::int64_t>(pieces_.size()); }
  std::optional<token_id> token_to_id(std::string_view token) const override;
  std::optional<token_id> eos_token_id() const override { return eos_; }

 private:
  void encode_text(std::string_view text, bool space_prefix, std::vector<token_id>& out) const;
  void emit_symbol(std::string_view symbol, std::vector<token_id>& out) const;
  const SpmPiece* match_special(std::string_view text, std::size_t at, bool allow_special, token_id& id) const;
  std::optional<token_id> find(std::string_view text) const;

  std::string source_;
  std::vector<SpmPiece> pieces_;
  StringMap ids_;                                  // every piece's text, as llama.cpp's text_to_token
  std::vector<token_id> specials_;                 // control, unknown and user-defined pieces, longest first
  std::array<bool, 256> special_first_byte_{};     // bytes a special piece starts with
  std::vector<token_id> byte_ids_;                 // <0xXX> per byte, -1 where absent
  // By rank: (left id, right id) -> (rank, merged id). Empty: by score.
  std::unordered_map<std::uint64_t, std::pair<std::int32_t, token_id>> ranks_;
  bool add_space_prefix_ = true;
  bool prefix_after_special_ = true;
  bool prefix_unless_space_ = false;
  std::optional<token_id> eos_, unk_;
};

}  // namespace rlloop::tokenizer_detail
