// Chooses the tokenizer implementation from a spec string.
#include <filesystem>
#include <memory>

#include "bpe_tokenizer.hpp"
#include "byte_tokenizer.hpp"
#include "tokenizer_files.hpp"

namespace rlloop {

std::shared_ptr<const Tokenizer> load_tokenizer(const std::string& spec) {
  using tokenizer_detail::BpeTokenizer;
  if (spec == "byte") return std::make_shared<ByteTokenizer>();
  namespace fs = std::filesystem;
  const fs::path p(spec);
  if (spec.empty()) throw invalid_argument("load_tokenizer: empty tokenizer spec (expected \"byte\" or a path)");
  if (fs::is_directory(p)) {
    if (fs::exists(p / "tokenizer.json"))
      return tokenizer_detail::load_tokenizer_json(p / "tokenizer.json");
    if (fs::exists(p / "encoder.json") && fs::exists(p / "vocab.bpe"))
      return std::make_shared<BpeTokenizer>(tokenizer_detail::read_gpt2_files(p));
    throw not_found("load_tokenizer: directory '" + p.string() +
                    "' holds neither tokenizer.json nor encoder.json + vocab.bpe");
  }
  if (!fs::exists(p)) throw not_found("load_tokenizer: no tokenizer at '" + p.string() + "'");
  if (p.extension() == ".gguf") return tokenizer_detail::load_gguf_tokenizer(p);
  if (p.extension() == ".tiktoken") return std::make_shared<BpeTokenizer>(tokenizer_detail::read_tiktoken_file(p));
  if (p.filename() == "encoder.json" || p.filename() == "vocab.bpe")
    return std::make_shared<BpeTokenizer>(tokenizer_detail::read_gpt2_files(p.parent_path()));
  return tokenizer_detail::load_tokenizer_json(p);
}

}  // namespace rlloop
