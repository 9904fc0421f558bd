// default_chat_renderer: which renderer writes what a model's own chat template writes.
#include <algorithm>
#include <filesystem>
#include <string_view>

#include <rlloop/chat.hpp>
#include <rlloop/error.hpp>
#include <rlloop/gguf.hpp>

namespace rlloop {
namespace {

// Recognises the chat templates rlloop renders by the markers only they have (the template is not executed).
std::optional<std::string> renderer_for_template(std::string_view jinja) {
  auto has = [&](std::string_view marker) { return jinja.find(marker) != std::string_view::npos; };
  if (has("<|im_start|>") && has("You are a helpful AI assistant named SmolLM, trained by Hugging Face"))
    return "smollm2";
  if (has("<|im_start|>") && has("<think>")) return "qwen3_no_thinking";
  if (has("<|start_header_id|>") && has("<|eot_id|>")) return "llama3";
  if (has("[INST]") && has("<<SYS>>")) return "llama2";
  if (has("<|start|>") && has("<|channel|>") && has("<|message|>")) return "harmony";
  if (has("<start_of_turn>") && has("<end_of_turn>")) return "gemma";
  return std::nullopt;
}

}  // namespace

std::string default_chat_renderer(const std::string& tokenizer_spec, const std::string& family_renderer) {
  // A model_type passed where the renderer name belongs ("llama", "qwen2": the parameter's meaning before the
  // architecture registry) is refused rather than turned into another format.
  const auto& names = chat_renderer_names();
  if (!family_renderer.empty() && std::find(names.begin(), names.end(), family_renderer) == names.end())
    throw invalid_argument("default_chat_renderer: '" + family_renderer +
                           "' is not a renderer name (pass SessionInfo::chat_renderer, the model family's)");
  if (tokenizer_spec == "byte") return "role_colon";
  if (std::filesystem::path(tokenizer_spec).extension() == ".gguf") {
    const auto file = gguf::File::open(tokenizer_spec);
    if (file.find("tokenizer.chat_template"))
      if (auto name = renderer_for_template(file.string("tokenizer.chat_template"))) return *name;
    // A SentencePiece vocabulary (Llama 1/2, Mistral, TinyLlama) lacks Llama 3's header tokens, and their chat
    // formats differ: without a template rlloop recognises, the plain format any tokenizer can write.
    if (file.find("tokenizer.ggml.model") && file.string("tokenizer.ggml.model") == "llama") return "role_colon";
  }
  return family_renderer.empty() ? "role_colon" : family_renderer;
}

}  // namespace rlloop
