// ChatML, SmolLM2 and Qwen3 renderers. Qwen3 follows the chat template of Qwen3's tokenizer_config.json (without
// tools): the system message first, then each turn; assistant turns after the last user query carry a
// <think> block (always the final one), earlier ones lose their reasoning.
#include <algorithm>

#include "chat_renderer_base.hpp"

namespace rlloop::tokenizer_detail {
namespace {

bool starts_with(const std::string& s, std::string_view p) { return s.starts_with(p); }
std::string lstrip_newlines(std::string s) {
  return s.erase(0, s.find_first_not_of('\n') == std::string::npos ? s.size() : s.find_first_not_of('\n'));
}
std::string rstrip_newlines(std::string s) {
  const auto p = s.find_last_not_of('\n');
  s.resize(p == std::string::npos ? 0 : p + 1);
  return s;
}

class ChatMl : public EndOfTurnRenderer {
 public:
  explicit ChatMl(std::shared_ptr<const Tokenizer> tok) : EndOfTurnRenderer(std::move(tok)) {
    ends_turns_with("<|im_end|>", {"<|endoftext|>"});
    require_token("<|im_start|>");
  }
  std::string name() const override { return "chatml"; }

 protected:
  std::vector<Segment> segments(std::span<const Message> messages, bool gen, TrainOn train_on) const override {
    check_roles(messages, name());
    const auto last = last_assistant(messages);
    std::vector<Segment> out;
    for (std::size_t i = 0; i < messages.size(); ++i) {
      const Message& m = messages[i];
      out.push_back({"<|im_start|>" + m.role + "\n", false});
      const bool train = !gen && m.role == "assistant" &&
                         (train_on == TrainOn::all_assistant || static_cast<std::ptrdiff_t>(i) == last);
      out.push_back({m.content + "<|im_end|>", train});
      out.push_back({"\n", false});
    }
    if (gen) out.push_back({"<|im_start|>assistant\n", false});
    return out;
  }
};

// SmolLM2-Instruct's chat template: ChatML, opened by a default system message when the conversation has none.
class SmolLm2 final : public ChatMl {
 public:
  using ChatMl::ChatMl;
  std::string name() const override { return "smollm2"; }

 protected:
  std::vector<Segment> segments(std::span<const Message> messages, bool gen, TrainOn train_on) const override {
    std::vector<Segment> out = ChatMl::segments(messages, gen, train_on);
    if (!messages.empty() && messages.front().role != "system")
      out.insert(out.begin(), {"<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
                               "Face<|im_end|>\n",
                               false});
    return out;
  }
};

class Qwen3 final : public ChatMl {
 public:
  Qwen3(std::shared_ptr<const Tokenizer> tok, bool thinking) : ChatMl(std::move(tok)), thinking_(thinking) {
    require_token("<think>");
    require_token("</think>");
  }
  std::string name() const override { return thinking_ ? "qwen3" : "qwen3_no_thinking"; }

  ParsedResponse parse_response(std::span<const token_id> tokens) const override {
    auto [text, complete] = text_until_stop(tokens);
    Message m{"assistant", text, std::nullopt};
    // With thinking on the completion is "<think>\n...\n</think>\n\nanswer"; split it the way the template does.
    if (const auto close = text.find("</think>"); close != std::string::npos) {
      std::string reasoning = rstrip_newlines(text.substr(0, close));
      if (const auto open = reasoning.rfind("<think>"); open != std::string::npos) reasoning.erase(0, open + 7);
      m.reasoning_content = lstrip_newlines(reasoning);
      m.content = lstrip_newlines(text.substr(text.rfind("</think>") + 8));
    }
    return {std::move(m), complete};
  }

 protected:
  std::vector<Segment> segments(std::span<const Message> messages, bool gen, TrainOn train_on) const override {
    check_roles(messages, name());
    std::vector<Segment> out;
    const std::size_t n = messages.size();
    // last_query_index: the last user message that is not a wrapped tool response.
    std::size_t last_query = n ? n - 1 : 0;
    for (std::size_t k = n; k-- > 0;) {
      const Message& m = messages[k];
      if (m.role == "user" && !(starts_with(m.content, "<tool_response>") && m.content.ends_with("</tool_response>"))) {
        last_query = k;
        break;
      }
    }
    const auto last = last_assistant(messages);
    for (std::size_t i = 0; i < n; ++i) {
      const Message& m = messages[i];
      if (m.role == "user" || m.role == "system") {
        out.push_back({"<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n", false});
      } else if (m.role == "assistant") {
        std::string content = m.content, reasoning;
        if (m.reasoning_content) {
          reasoning = *m.reasoning_content;
        } else if (const auto close = m.content.find("</think>"); close != std::string::npos) {
          content = lstrip_newlines(m.content.substr(m.content.rfind("</think>") + 8));
          std::string before = rstrip_newlines(m.content.substr(0, close));
          if (const auto open = before.rfind("<think>"); open != std::string::npos) before.erase(0, open + 7);
          reasoning = lstrip_newlines(before);
        }
        const bool train = !gen && (train_on == TrainOn::all_assistant || static_cast<std::ptrdiff_t>(i) == last);
        out.push_back({"<|im_start|>assistant\n", false});
        if (i > last_query && (i + 1 == n || !reasoning.empty())) {
          // With thinking off the empty think block is part of the prompt, never generated, so not trained.
          const bool empty_block = rstrip_newlines(lstrip_newlines(reasoning)).empty();
          out.push_back({"<think>\n" + rstrip_newlines(lstrip_newlines(reasoning)) + "\n</think>\n\n",
                         train && (thinking_ || !empty_block)});
          content = lstrip_newlines(content);
        }
        out.push_back({content + "<|im_end|>", train});
        out.push_back({"\n", false});
      } else {  // tool
        if (i == 0 || messages[i - 1].role != "tool") out.push_back({"<|im_start|>user", false});
        out.push_back({"\n<tool_response>\n" + m.content + "\n</tool_response>", false});
        if (i + 1 == n || messages[i + 1].role != "tool") out.push_back({"<|im_end|>\n", false});
      }
    }
    // The template writes a leading system message specially but identically to the generic branch above.
    if (gen) {
      out.push_back({"<|im_start|>assistant\n", false});
      if (!thinking_) out.push_back({"<think>\n\n</think>\n\n", false});
    }
    return out;
  }

 private:
  bool thinking_;
};

}  // namespace

std::unique_ptr<ChatRenderer> make_chatml_renderer(std::shared_ptr<const Tokenizer> tok) {
  return std::make_unique<ChatMl>(std::move(tok));
}
std::unique_ptr<ChatRenderer> make_smollm2_renderer(std::shared_ptr<const Tokenizer> tok) {
  return std::make_unique<SmolLm2>(std::move(tok));
}
std::unique_ptr<ChatRenderer> make_qwen3_renderer(std::shared_ptr<const Tokenizer> tok, bool thinking) {
  return std::make_unique<Qwen3>(std::move(tok), thinking);
}

}  // namespace rlloop::tokenizer_detail
