// The tokenizer in a GGUF file's metadata (tokenizer.ggml.*), read as llama.cpp reads it.
#include <map>

#include <rlloop/gguf.hpp>

#include "tokenizer_files.hpp"

namespace rlloop::tokenizer_detail {
namespace {

// llama.cpp's token types (llama_token_type): control tokens are matched in text only when special tokens are
// allowed; user-defined ones always.
constexpr std::int64_t kControl = 3;
constexpr std::int64_t kUserDefined = 4;

// tokenizer.ggml.pre names, as llama.cpp's converter writes them, for the split patterns rlloop implements.
const std::map<std::string, SplitPattern>& pre_tokenizers() {
  static const std::map<std::string, SplitPattern> names{{"gpt-2", SplitPattern::gpt2},
                                                         {"smollm", SplitPattern::gpt2_digits},
                                                         {"llama-bpe", SplitPattern::llama3},
                                                         {"llama3", SplitPattern::llama3},
                                                         {"qwen2", SplitPattern::qwen2}};
  return names;
}

}  // namespace

BpeSpec read_gguf_tokenizer(const std::filesystem::path& path) {
  const gguf::File file = gguf::File::open(path.string());
  const std::string source = path.string();
  auto missing = [&](const std::string& key) {
    throw invalid_argument("load_tokenizer: '" + source + "' holds no tokenizer (no " + key + " in its metadata)");
  };
  if (!file.find("tokenizer.ggml.model")) missing("tokenizer.ggml.model");
  const std::string model = file.string("tokenizer.ggml.model");
  if (model != "gpt2")
    throw unsupported("load_tokenizer: '" + source + "': tokenizer.ggml.model '" + model +
                      "' is not supported (rlloop reads \"gpt2\", byte-level BPE)");
  const std::string pre = file.find("tokenizer.ggml.pre") ? file.string("tokenizer.ggml.pre") : "default";
  const auto pattern = pre_tokenizers().find(pre);
  if (pattern == pre_tokenizers().end()) {
    std::string known;
    for (const auto& [name, p] : pre_tokenizers()) known += (known.empty() ? "" : ", ") + name;
    throw unsupported("load_tokenizer: '" + source + "': pre-tokenizer tokenizer.ggml.pre '" + pre +
                      "' is not supported (rlloop implements " + known + ")");
  }
  for (const char* key : {"tokenizer.ggml.tokens", "tokenizer.ggml.merges"})
    if (!file.find(key)) missing(key);
  const std::vector<std::string> tokens = file.strings("tokenizer.ggml.tokens");
  const std::vector<std::int64_t> types =
      file.find("tokenizer.ggml.token_type") ? file.integers("tokenizer.ggml.token_type") : std::vector<std::int64_t>{};
  if (!types.empty() && types.size() != tokens.size())
    throw invalid_argument("load_tokenizer: '" + source + "': tokenizer.ggml.token_type has " +
                           std::to_string(types.size()) + " entries for " + std::to_string(tokens.size()) + " tokens");

  BpeSpec spec;
  spec.source = source;
  spec.pattern = pattern->second;
  spec.nfc = false;
  spec.vocab.reserve(tokens.size());
  for (std::size_t id = 0; id < tokens.size(); ++id) {
    const std::int64_t type = types.empty() ? 1 : types[id];
    const auto tid = static_cast<token_id>(id);
    // The converter stores added tokens as their text, the others in the byte-level alphabet.
    if (type == kControl || type == kUserDefined)
      spec.added_tokens.push_back({tokens[id], tid, type == kControl});
    else
      spec.vocab.emplace_back(byte_level_token(tokens[id], source), tid);
  }
  for (const std::string& merge : file.strings("tokenizer.ggml.merges"))
    spec.merges.push_back(byte_level_merge(merge, source));
  if (file.find("tokenizer.ggml.eos_token_id")) {
    const std::int64_t eos = file.integer("tokenizer.ggml.eos_token_id");
    if (eos < 0 || eos >= static_cast<std::int64_t>(tokens.size()))
      throw invalid_argument("load_tokenizer: '" + source + "': tokenizer.ggml.eos_token_id " + std::to_string(eos) +
                             " is not a token id (the vocabulary has " + std::to_string(tokens.size()) + ")");
    spec.eos_token = tokens[static_cast<std::size_t>(eos)];
  }
  return spec;
}

}  // namespace rlloop::tokenizer_detail
