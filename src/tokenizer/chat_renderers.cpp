// make_chat_renderer: picks a renderer by name.
#include "chat_renderer_base.hpp"

namespace rlloop {

const std::vector<std::string>& chat_renderer_names() {
  static const std::vector<std::string> names = {"chatml", "smollm2",    "qwen3",   "qwen3_no_thinking", "llama3",
                                                 "llama2", "role_colon", "harmony", "gemma"};
  return names;
}

std::unique_ptr<ChatRenderer> make_chat_renderer(const std::string& name, std::shared_ptr<const Tokenizer> tokenizer) {
  using namespace tokenizer_detail;
  if (name == "chatml") return make_chatml_renderer(std::move(tokenizer));
  if (name == "smollm2") return make_smollm2_renderer(std::move(tokenizer));
  if (name == "qwen3") return make_qwen3_renderer(std::move(tokenizer), true);
  if (name == "qwen3_no_thinking") return make_qwen3_renderer(std::move(tokenizer), false);
  if (name == "llama3") return make_llama3_renderer(std::move(tokenizer));
  if (name == "llama2") return make_llama2_renderer(std::move(tokenizer));
  if (name == "role_colon") return make_role_colon_renderer(std::move(tokenizer));
  if (name == "harmony") return make_harmony_renderer(std::move(tokenizer));
  if (name == "gemma") return make_gemma_renderer(std::move(tokenizer));
  std::string known;
  for (const std::string& n : chat_renderer_names()) known += (known.empty() ? "" : ", ") + n;
  throw invalid_argument("make_chat_renderer: unknown renderer '" + name + "' (expected one of " + known + ")");
}

}  // namespace rlloop
