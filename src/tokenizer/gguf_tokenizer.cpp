// The tokenizer in a GGUF file's metadata (tokenizer.ggml.*), read as llama.cpp reads it.
#include <map>
#include <memory>

#include <rlloop/gguf.hpp>

#include "spm_tokenizer.hpp"
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
                                                         {"qwen2", SplitPattern::qwen2},
                                                         {"gpt-4o", SplitPattern::o200k}};  // gpt-4o, gpt-oss
  return names;
}

[[noreturn]] void missing(const std::string& source, const std::string& key) {
  throw invalid_argument("load_tokenizer: '" + source + "' holds no tokenizer (no " + key + " in its metadata)");
}

// A special token's id from the metadata, checked against the vocabulary; `fallback` when the key is absent.
std::optional<token_id> special_id(const gguf::File& file, const std::string& key, std::size_t vocab,
                                   std::optional<token_id> fallback) {
  if (!file.find(key)) return fallback;
  const std::int64_t id = file.integer(key);
  if (id < 0 || id >= static_cast<std::int64_t>(vocab))
    throw invalid_argument("load_tokenizer: '" + file.path() + "': " + key + " " + std::to_string(id) +
                           " is not a token id (the vocabulary has " + std::to_string(vocab) + ")");
  return static_cast<token_id>(id);
}

std::vector<std::int64_t> token_types(const gguf::File& file, std::size_t tokens) {
  const std::vector<std::int64_t> types =
      file.find("tokenizer.ggml.token_type") ? file.integers("tokenizer.ggml.token_type") : std::vector<std::int64_t>{};
  if (!types.empty() && types.size() != tokens)
    throw invalid_argument("load_tokenizer: '" + file.path() + "': tokenizer.ggml.token_type has " +
                           std::to_string(types.size()) + " entries for " + std::to_string(tokens) + " tokens");
  return types;
}

// The "llama" model: SentencePiece pieces with scores (llama.cpp's SPM tokenizer). As llama.cpp: the space prefix
// unless tokenizer.ggml.add_space_prefix says otherwise, eos 2 and unknown 0 unless the metadata names others.
SpmSpec read_spm(const gguf::File& file) {
  const std::string& source = file.path();
  if (!file.find("tokenizer.ggml.tokens")) missing(source, "tokenizer.ggml.tokens");
  const std::vector<std::string> tokens = file.strings("tokenizer.ggml.tokens");
  const std::vector<std::int64_t> types = token_types(file, tokens.size());
  std::vector<float> scores(tokens.size(), 0.0f);
  if (const gguf::Value* v = file.find("tokenizer.ggml.scores")) {
    const auto* a = std::get_if<gguf::Array>(&v->v);
    if (!a || a->size() != tokens.size())
      throw invalid_argument("load_tokenizer: '" + source + "': tokenizer.ggml.scores must be an array of " +
                             std::to_string(tokens.size()) + " float32 scores, one per token");
    for (std::size_t i = 0; i < a->size(); ++i) {
      const auto* f = std::get_if<float>(&(*a)[i].v);
      if (!f)
        throw invalid_argument("load_tokenizer: '" + source + "': tokenizer.ggml.scores holds " +
                               gguf::type_name((*a)[i]) + ", not float32");
      scores[i] = *f;
    }
  }
  SpmSpec spec;
  spec.source = source;
  spec.pieces.reserve(tokens.size());
  for (std::size_t id = 0; id < tokens.size(); ++id) {
    const std::int64_t type = types.empty() ? 1 : types[id];
    if (type < 1 || type > 6)
      throw invalid_argument("load_tokenizer: '" + source + "': token " + std::to_string(id) + " has type " +
                             std::to_string(type) + " (llama.cpp's types are 1 to 6)");
    spec.pieces.push_back({tokens[id], scores[id], static_cast<PieceType>(type)});
  }
  if (file.find("tokenizer.ggml.add_space_prefix"))
    spec.add_space_prefix = file.boolean("tokenizer.ggml.add_space_prefix");
  const auto default_id = [&](token_id id) {
    return id < static_cast<token_id>(tokens.size()) ? std::optional(id) : std::nullopt;
  };
  spec.eos = special_id(file, "tokenizer.ggml.eos_token_id", tokens.size(), default_id(2));
  spec.unk = special_id(file, "tokenizer.ggml.unknown_token_id", tokens.size(), default_id(0));
  return spec;
}

}  // namespace

std::shared_ptr<const Tokenizer> load_gguf_tokenizer(const std::filesystem::path& path) {
  const gguf::File file = gguf::File::open(path.string());
  if (!file.find("tokenizer.ggml.model")) missing(path.string(), "tokenizer.ggml.model");
  if (file.string("tokenizer.ggml.model") == "llama") return std::make_shared<SpmTokenizer>(read_spm(file));
  return std::make_shared<BpeTokenizer>(read_gguf_tokenizer(path));
}

BpeSpec read_gguf_tokenizer(const std::filesystem::path& path) {
  const gguf::File file = gguf::File::open(path.string());
  const std::string source = path.string();
  if (!file.find("tokenizer.ggml.model")) missing(source, "tokenizer.ggml.model");
  const std::string model = file.string("tokenizer.ggml.model");
  if (model != "gpt2")
    throw unsupported("load_tokenizer: '" + source + "': tokenizer.ggml.model '" + model +
                      "' is not supported (rlloop reads \"gpt2\", byte-level BPE, and \"llama\", SentencePiece)");
  const std::string pre = file.find("tokenizer.ggml.pre") ? file.string("tokenizer.ggml.pre") : "default";
  const auto pattern = pre_tokenizers().find(pre);
  if (pattern == pre_tokenizers().end()) {
    std::string known;
    for (const auto& [name, p] : pre_tokenizers()) known += (known.empty() ? "" : ", ") + name;
    throw unsupported("load_tokenizer: '" + source + "': pre-tokenizer tokenizer.ggml.pre '" + pre +
                      "' is not supported (rlloop implements " + known + ")");
  }
  for (const char* key : {"tokenizer.ggml.tokens", "tokenizer.ggml.merges"})
    if (!file.find(key)) missing(source, key);
  const std::vector<std::string> tokens = file.strings("tokenizer.ggml.tokens");
  const std::vector<std::int64_t> types = token_types(file, tokens.size());

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
  if (const auto eos = special_id(file, "tokenizer.ggml.eos_token_id", tokens.size(), std::nullopt))
    spec.eos_token = tokens[static_cast<std::size_t>(*eos)];
  return spec;
}

}  // namespace rlloop::tokenizer_detail
