// Chooses the tokenizer implementation from a spec string.
#include <filesystem>
#include <memory>

#include "byte_tokenizer.hpp"

namespace rlloop {

std::shared_ptr<const Tokenizer> load_tokenizer(const std::string& spec) {
  if (spec == "byte") return std::make_shared<ByteTokenizer>();
  namespace fs = std::filesystem;
  fs::path p(spec);
  if (fs::is_directory(p)) p /= "tokenizer.json";
  if (!fs::exists(p)) throw not_found("load_tokenizer: no tokenizer at '" + p.string() + "'");
  throw unsupported("load_tokenizer: '" + p.string() + "': Hugging Face tokenizer.json support is not built yet");
}

}  // namespace rlloop
