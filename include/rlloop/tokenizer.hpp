// The Tokenizer interface. Sessions take token ids only; the client tokenizes. Implementations, and
// load_tokenizer, live in the compiled rlloop::tokenizer library (src/tokenizer/): the interface alone needs no
// library, a call of load_tokenizer links rlloop::tokenizer.
#pragma once
#include <algorithm>
#include <concepts>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
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

  // Encodes many texts, spread over up to `threads` threads (0 = hardware concurrency). Implementations are
  // safe to call concurrently, so this only partitions the work.
  std::vector<std::vector<token_id>> encode_batch(std::span<const std::string> texts, bool allow_special = true,
                                                  unsigned threads = 0) const {
    std::vector<std::vector<token_id>> out(texts.size());
    if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
    threads = static_cast<unsigned>(std::min<std::size_t>(threads, texts.size()));
    if (threads <= 1) {
      for (std::size_t i = 0; i < texts.size(); ++i) out[i] = encode(texts[i], allow_special);
      return out;
    }
    std::vector<std::thread> pool;
    for (unsigned t = 0; t < threads; ++t)
      pool.emplace_back([&, t] {
        for (std::size_t i = t; i < texts.size(); i += threads) out[i] = encode(texts[i], allow_special);
      });
    for (auto& th : pool) th.join();
    return out;
  }
};

// Incremental decoding for streamed responses: push ids as they are sampled and get back only text that
// ends on a complete UTF-8 character, so a multi-byte character split across tokens is never emitted
// half-way. Bytes that can never become valid UTF-8 are replaced by U+FFFD, so every piece returned is
// valid UTF-8. Relies on decode() of a sequence being the concatenation of decode() of each id, which holds
// for byte-level tokenizers (all those rlloop implements).
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tokenizer, bool skip_special = false)
      : tokenizer_(&tokenizer), skip_special_(skip_special) {}

  // Text that became complete with this id (often empty mid-character).
  std::string push(token_id id) {
    const token_id one[1] = {id};
    pending_ += tokenizer_->decode(std::span<const token_id>(one, 1), skip_special_);
    return take(false);
  }
  // Whatever is still held back at the end of the stream (an unfinished character becomes U+FFFD).
  std::string finish() { return take(true); }

 private:
  // Length of the UTF-8 sequence that lead byte b starts, or 0 when b cannot start one.
  static int sequence_length(unsigned char b) {
    if (b < 0x80) return 1;
    if (b >= 0xC2 && b <= 0xDF) return 2;
    if (b >= 0xE0 && b <= 0xEF) return 3;
    if (b >= 0xF0 && b <= 0xF4) return 4;
    return 0;
  }
  // Whether bytes s[i..i+n) are a valid sequence so far (checks continuation bytes and the second-byte ranges
  // that exclude overlong forms, surrogates and values past U+10FFFF).
  static bool valid_prefix(std::string_view s, std::size_t i, std::size_t n) {
    const auto b0 = static_cast<unsigned char>(s[i]);
    for (std::size_t k = 1; k < n; ++k) {
      const auto b = static_cast<unsigned char>(s[i + k]);
      unsigned char lo = 0x80, hi = 0xBF;
      if (k == 1) {
        if (b0 == 0xE0)
          lo = 0xA0;
        else if (b0 == 0xED)
          hi = 0x9F;
        else if (b0 == 0xF0)
          lo = 0x90;
        else if (b0 == 0xF4)
          hi = 0x8F;
      }
      if (b < lo || b > hi) return false;
    }
    return true;
  }
  std::string take(bool flush) {
    static constexpr std::string_view kReplacement = "\xEF\xBF\xBD";
    std::string out;
    std::size_t i = 0;
    while (i < pending_.size()) {
      const int len = sequence_length(static_cast<unsigned char>(pending_[i]));
      if (len == 0) {
        out += kReplacement;
        ++i;
        continue;
      }
      const std::size_t have = std::min<std::size_t>(static_cast<std::size_t>(len), pending_.size() - i);
      if (!valid_prefix(pending_, i, have)) {
        out += kReplacement;  // the maximal invalid prefix is one byte here; resync at the next byte
        ++i;
        continue;
      }
      if (have < static_cast<std::size_t>(len)) {
        if (!flush) break;  // incomplete: wait for the next token
        out += kReplacement;
        i += have;
        continue;
      }
      out.append(pending_, i, have);
      i += have;
    }
    pending_.erase(0, i);
    return out;
  }

  const Tokenizer* tokenizer_;
  bool skip_special_;
  std::string pending_;
};

// Loads a tokenizer: "byte" (the byte-level tokenizer), a Hugging Face tokenizer.json path (byte-level BPE:
// GPT-2, Llama 3, Qwen2/2.5/3, gpt-oss), a model directory that holds tokenizer.json, a directory (or the
// encoder.json in it) with GPT-2's encoder.json + vocab.bpe, a tiktoken rank file named by its encoding
// (o200k_base.tiktoken, o200k_harmony.tiktoken, cl100k_base.tiktoken) or a .gguf file. Throws
// rlloop::invalid_argument (malformed file), unsupported (a model type or component rlloop does not implement),
// not_found, io_error.
std::shared_ptr<const Tokenizer> load_tokenizer(const std::string& spec);

// The tokenizer of a training client's model (what its get_info().tokenizer names):
//   auto tokenizer = rlloop::load_tokenizer(client);
template <class Client>
requires requires(const Client& c) {
  { c.get_info() } -> std::convertible_to<SessionInfo>;
}
std::shared_ptr<const Tokenizer> load_tokenizer(const Client& client) {
  return load_tokenizer(client.get_info().tokenizer);
}

// The byte-level tokenizer: ids 0..255 are bytes, then these specials.
namespace byte_tokens {
inline constexpr token_id endoftext = 256;  // EOS
inline constexpr token_id im_start = 257;
inline constexpr token_id im_end = 258;
inline constexpr token_id pad = 259;
inline constexpr std::int64_t vocab_size = 260;
}  // namespace byte_tokens

}  // namespace rlloop
