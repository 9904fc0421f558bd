// tiktoken rank files: OpenAI's encodings as published (o200k_base.tiktoken, cl100k_base.tiktoken) and gpt-oss's
// o200k_harmony, which is o200k_base with the harmony chat format's special tokens.
#include <limits>
#include <map>
#include <optional>
#include <sstream>
#include <string_view>

#include <rlloop/error.hpp>

#include "tokenizer_files.hpp"

namespace rlloop::tokenizer_detail {
namespace {

// The bytes of standard base64 text (with '=' padding), or nullopt when it is not base64.
std::optional<std::string> decode_base64(std::string_view text) {
  static constexpr std::string_view kAlphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  if (text.empty() || text.size() % 4 != 0) return std::nullopt;
  std::string out;
  std::uint32_t bits = 0;
  int count = 0;
  std::size_t padding = 0;
  for (char c : text) {
    if (c == '=') {
      ++padding;
      continue;
    }
    const auto v = kAlphabet.find(c);
    if (v == std::string_view::npos || padding > 0) return std::nullopt;
    bits = (bits << 6) | static_cast<std::uint32_t>(v);
    if (++count == 4) {
      out += {static_cast<char>(bits >> 16), static_cast<char>((bits >> 8) & 0xFF), static_cast<char>(bits & 0xFF)};
      bits = 0;
      count = 0;
    }
  }
  if (padding > 2) return std::nullopt;  // whole quads (checked above): count + padding is 4 in the last one
  if (count == 2) out += static_cast<char>(bits >> 4);
  if (count == 3) out += {static_cast<char>(bits >> 10), static_cast<char>((bits >> 2) & 0xFF)};
  return out;
}

struct Encoding {
  SplitPattern pattern;
  std::vector<AddedToken> specials;
  std::string eos;
};

// o200k_harmony's special tokens (openai-harmony's HARMONY_GPT_OSS): every id from 199,998 to 201,087 (a vocabulary
// of 201,088, gpt-oss's), the chat format's by name and the others reserved (openai-harmony names 200,018
// <|reserved_200018|>, o200k_base's <|endofprompt|>).
std::vector<AddedToken> harmony_specials() {
  const std::map<token_id, std::string> named{{199998, "<|startoftext|>"}, {199999, "<|endoftext|>"},
                                              {200002, "<|return|>"},      {200003, "<|constrain|>"},
                                              {200005, "<|channel|>"},     {200006, "<|start|>"},
                                              {200007, "<|end|>"},         {200008, "<|message|>"},
                                              {200012, "<|call|>"}};
  std::vector<AddedToken> specials;
  for (token_id id = 199998; id < 201088; ++id) {
    auto it = named.find(id);
    specials.push_back({it != named.end() ? it->second : "<|reserved_" + std::to_string(id) + "|>", id});
  }
  return specials;
}

Encoding encoding_named(const std::string& stem, const std::string& source) {
  if (stem == "o200k_base")
    return {SplitPattern::o200k, {{"<|endoftext|>", 199999}, {"<|endofprompt|>", 200018}}, "<|endoftext|>"};
  if (stem == "o200k_harmony") return {SplitPattern::o200k, harmony_specials(), "<|return|>"};
  if (stem == "cl100k_base")  // cl100k's split regex is the one Llama 3 adopted
    return {SplitPattern::llama3,
            {{"<|endoftext|>", 100257},
             {"<|fim_prefix|>", 100258},
             {"<|fim_middle|>", 100259},
             {"<|fim_suffix|>", 100260},
             {"<|endofprompt|>", 100276}},
            "<|endoftext|>"};
  throw unsupported("load_tokenizer: '" + source + "': a tiktoken file's name says its encoding; '" + stem +
                    "' is none of o200k_base, o200k_harmony, cl100k_base");
}

}  // namespace

BpeSpec read_tiktoken_file(const std::filesystem::path& path) {
  BpeSpec spec;
  spec.source = path.string();
  Encoding enc = encoding_named(path.stem().string(), spec.source);
  std::istringstream lines(read_file(path));
  std::string line;
  for (std::size_t n = 1; std::getline(lines, line); ++n) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty()) continue;
    const auto space = line.find(' ');
    auto bad = [&] {
      return invalid_argument("load_tokenizer: '" + spec.source + "' line " + std::to_string(n) +
                              ": expected '<base64 token> <rank>', got '" + line.substr(0, 80) + "'");
    };
    if (space == std::string::npos) throw bad();
    auto bytes = decode_base64(std::string_view(line).substr(0, space));
    std::size_t used = 0;
    long long rank = -1;
    try {
      rank = std::stoll(line.substr(space + 1), &used);
    } catch (const std::exception&) {
      throw bad();
    }
    if (!bytes || used != line.size() - space - 1 || rank < 0 || rank > std::numeric_limits<token_id>::max())
      throw bad();
    spec.vocab.emplace_back(std::move(*bytes), static_cast<token_id>(rank));
  }
  spec.pattern = enc.pattern;
  spec.merge_by_rank = true;
  spec.nfc = false;
  spec.added_tokens = std::move(enc.specials);
  spec.eos_token = enc.eos;
  return spec;
}

}  // namespace rlloop::tokenizer_detail
