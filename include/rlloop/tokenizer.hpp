// The Tokenizer interface. Sessions take token ids only; the client tokenizes. Implementations live in the
// compiled rlloop::tokenizer library (src/tokenizer/).
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <rlloop/types.hpp>

namespace rlloop {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // Text to ids; special tokens written in the text are matched (never split) when allow_special is set.
  virtual std::vector<token_id> encode(std::string_view text, bool allow_special = true) const = 0;
  // Ids to text; throws rlloop::invalid_argument for an id out of range.
  virtual std::string decode(std::span<const token_id> ids, bool skip_special = false) const = 0;
  virtual std::int64_t vocab_size() const = 0;
  virtual std::optional<token_id> token_to_id(std::string_view token) const = 0;
  virtual std::optional<token_id> eos_token_id() const = 0;
};

// Loads a tokenizer: "byte" (the byte-level tokenizer), a tokenizer.json path, or a model directory that
// holds tokenizer.json. Throws rlloop::invalid_argument / io_error naming what is wrong.
std::shared_ptr<const Tokenizer> load_tokenizer(const std::string& spec);

// The byte-level tokenizer: ids 0..255 are bytes, then these specials.
namespace byte_tokens {
inline constexpr token_id endoftext = 256;  // EOS
inline constexpr token_id im_start = 257;
inline constexpr token_id im_end = 258;
inline constexpr token_id pad = 259;
inline constexpr std::int64_t vocab_size = 260;
}  // namespace byte_tokens

}  // namespace rlloop
