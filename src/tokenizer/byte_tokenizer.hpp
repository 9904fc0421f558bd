// Byte-level tokenizer for models trained from scratch: one id per byte plus a few specials.
#pragma once
#include <rlloop/tokenizer.hpp>

namespace rlloop {

class ByteTokenizer final : public Tokenizer {
 public:
  std::vector<token_id> encode(std::string_view text, bool allow_special = true) const override;
  std::string decode(std::span<const token_id> ids, bool skip_special = false) const override;
  std::int64_t vocab_size() const override { return byte_tokens::vocab_size; }
  std::optional<token_id> token_to_id(std::string_view token) const override;
  std::optional<token_id> eos_token_id() const override { return byte_tokens::endoftext; }
};

}  // namespace rlloop
