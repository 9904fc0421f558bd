// write_hf_tokenizer (include/rlloop/hf_tokenizer.hpp): the inverse of tokenizer_files.cpp's tokenizer.json reader,
// for a GGUF file's byte-level BPE tokenizer.
#include <rlloop/hf_tokenizer.hpp>

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include <rlloop/error.hpp>
#include <rlloop/gguf.hpp>

#include "byte_level.hpp"
#include "tokenizer_files.hpp"

namespace rlloop {
namespace {
namespace fs = std::filesystem;
using nlohmann::json;
using tokenizer_detail::BpeSpec;
using tokenizer_detail::SplitPattern;
using tokenizer_detail::bytes_to_byte_level;

json byte_level(bool use_regex) {
  return {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", use_regex}};
}

// The pre_tokenizer section tokenizer.json files spell `pattern` with (read_pre_tokenizer reads each back).
json pre_tokenizer(SplitPattern pattern) {
  switch (pattern) {
    case SplitPattern::gpt2: return byte_level(true);
    case SplitPattern::gpt2_digits:
      return {{"type", "Sequence"},
              {"pretokenizers", {{{"type", "Digits"}, {"individual_digits", true}}, byte_level(true)}}};
    case SplitPattern::llama3:
    case SplitPattern::qwen2:
    case SplitPattern::o200k:
      return {{"type", "Sequence"},
              {"pretokenizers",
               {{{"type", "Split"},
                 {"pattern", {{"Regex", tokenizer_detail::split_regex(pattern)}}},
                 {"behavior", "Isolated"},
                 {"invert", false}},
                byte_level(false)}}};
  }
  throw std::logic_error("write_hf_tokenizer: a split pattern without a spelling");
}

json tokenizer_json(const BpeSpec& spec) {
  json added = json::array();
  json vocab = json::object();
  for (const auto& [bytes, id] : spec.vocab) vocab[bytes_to_byte_level(bytes)] = id;
  for (const auto& t : spec.added_tokens) {
    added.push_back({{"id", t.id},
                     {"content", t.content},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", t.special}});
    vocab[bytes_to_byte_level(t.content)] = t.id;  // as Hugging Face's files list them: in the vocabulary too
  }
  json merges = json::array();
  for (const auto& [a, b] : spec.merges) merges.push_back({bytes_to_byte_level(a), bytes_to_byte_level(b)});
  return {{"version", "1.0"},
          {"truncation", nullptr},
          {"padding", nullptr},
          {"added_tokens", std::move(added)},
          {"normalizer", spec.nfc ? json{{"type", "NFC"}} : json()},
          {"pre_tokenizer", pre_tokenizer(spec.pattern)},
          {"post_processor", nullptr},
          {"decoder", byte_level(true)},
          {"model",
           {{"type", "BPE"},
            {"dropout", nullptr},
            {"unk_token", nullptr},
            {"continuing_subword_prefix", nullptr},
            {"end_of_word_suffix", nullptr},
            {"fuse_unk", false},
            {"byte_fallback", false},
            {"ignore_merges", false},
            {"vocab", std::move(vocab)},
            {"merges", std::move(merges)}}}};
}

// tokenizer_config.json: the special tokens by text and the chat template, for AutoTokenizer.
json tokenizer_config(const BpeSpec& spec, const gguf::File& file) {
  const std::vector<std::string> tokens = file.strings("tokenizer.ggml.tokens");
  auto token_of = [&](const char* key) -> json {
    if (!file.find(key)) return nullptr;
    const std::int64_t id = file.integer(key);
    if (id < 0 || id >= static_cast<std::int64_t>(tokens.size()))
      throw invalid_argument("write_hf_tokenizer: '" + file.path() + "': " + key + " " + std::to_string(id) +
                             " is not a token id");
    return tokens[static_cast<std::size_t>(id)];
  };
  json config = {{"tokenizer_class", "PreTrainedTokenizerFast"},
                 {"clean_up_tokenization_spaces", false},
                 {"eos_token", spec.eos_token ? json(*spec.eos_token) : json()},
                 {"bos_token", token_of("tokenizer.ggml.bos_token_id")},
                 {"pad_token", token_of("tokenizer.ggml.padding_token_id")},
                 {"unk_token", token_of("tokenizer.ggml.unknown_token_id")},
                 {"add_bos_token", false}};
  if (file.find("tokenizer.chat_template")) config["chat_template"] = file.string("tokenizer.chat_template");
  return config;
}

void write_json(const fs::path& path, const json& j) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << j.dump(2, ' ', /*ensure_ascii=*/false) << '\n';
  if (!out) throw io_error("write_hf_tokenizer: cannot write '" + path.string() + "'");
}

}  // namespace

void write_hf_tokenizer(const std::string& gguf_path, const std::string& dir) {
  const gguf::File file = gguf::File::open(gguf_path);
  if (file.find("tokenizer.ggml.model") && file.string("tokenizer.ggml.model") == "llama")
    throw unsupported("write_hf_tokenizer: '" + gguf_path +
                      "' holds a SentencePiece tokenizer (tokenizer.ggml.model \"llama\"); only byte-level BPE "
                      "(\"gpt2\") is written as Hugging Face files yet");
  const BpeSpec spec = tokenizer_detail::read_gguf_tokenizer(gguf_path);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw io_error("write_hf_tokenizer: cannot make '" + dir + "': " + ec.message());
  write_json(fs::path(dir) / "tokenizer.json", tokenizer_json(spec));
  write_json(fs::path(dir) / "tokenizer_config.json", tokenizer_config(spec, file));
}

}  // namespace rlloop
