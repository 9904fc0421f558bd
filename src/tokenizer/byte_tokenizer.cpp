#include "byte_tokenizer.hpp"

#include <array>
#include <string>

namespace rlloop {
namespace {
constexpr std::array<std::string_view, 4> kSpecials = {"<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"};
}  // namespace

std::vector<token_id> ByteTokenizer::encode(std::string_view text, bool allow_special) const {
  std::vector<token_id> ids;
  ids.reserve(text.size());
  for (std::size_t i = 0; i < text.size();) {
    if (allow_special && text[i] == '<') {
      bool matched = false;
      for (std::size_t s = 0; s < kSpecials.size(); ++s)
        if (text.substr(i, kSpecials[s].size()) == kSpecials[s]) {
          ids.push_back(static_cast<token_id>(256 + s));
          i += kSpecials[s].size();
          matched = true;
          break;
        }
      if (matched) continue;
    }
    ids.push_back(static_cast<unsigned char>(text[i]));
    ++i;
  }
  return ids;
}

std::string ByteTokenizer::decode(std::span<const token_id> ids, bool skip_special) const {
  std::string out;
  out.reserve(ids.size());
  for (token_id id : ids) {
    if (id < 0 || id >= byte_tokens::vocab_size)
      throw invalid_argument("decode: token id " + std::to_string(id) + " is out of range [0, " +
                             std::to_string(byte_tokens::vocab_size) + ")");
    if (id < 256)
      out.push_back(static_cast<char>(id));
    else if (!skip_special)
      out.append(kSpecials[static_cast<std::size_t>(id - 256)]);
  }
  return out;
}

std::optional<token_id> ByteTokenizer::token_to_id(std::string_view token) const {
  for (std::size_t s = 0; s < kSpecials.size(); ++s)
    if (token == kSpecials[s]) return static_cast<token_id>(256 + s);
  if (token.size() == 1) return static_cast<unsigned char>(token[0]);
  return std::nullopt;
}

}  // namespace rlloop
