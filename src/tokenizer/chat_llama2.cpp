// Llama 2 Chat (the meta-llama/Llama-2-*-chat-hf chat template): each user turn as "<s>[INST] " + stripped content +
// " [/INST]", the first one opened by the system message in <<SYS>> tags, each assistant turn as " " + stripped
// content + " </s>". Written as text with <s> and </s> in it: a SentencePiece tokenizer matches them as specials and
// prefixes each stretch of text after one with "▁", as llama.cpp and Hugging Face's (legacy) Llama tokenizer do, so
// the tokens are the template's text encoded as one.
#include "chat_renderer_base.hpp"

namespace rlloop::tokenizer_detail {
namespace {

class Llama2 final : public SegmentRenderer {
 public:
  explicit Llama2(std::shared_ptr<const Tokenizer> tok) : SegmentRenderer(std::move(tok)) {
    require_token("<s>");
    eos_ = require_token("</s>");
  }
  std::string name() const override { return "llama2"; }
  std::vector<std::string> stop_sequences() const override { return {}; }
  std::vector<token_id> stop_token_ids() const override { return {eos_}; }
  ParsedResponse parse_response(std::span<const token_id> tokens) const override {
    // The template writes " " + content.strip() + " " before </s>: the answer is what lies between.
    auto [text, complete] = text_until_stop(tokens);
    return {Message{"assistant", strip(text), std::nullopt}, complete};
  }

 protected:
  std::vector<Segment> segments(std::span<const Message> messages, bool gen, TrainOn train_on) const override {
    check_roles(messages, name());
    const bool has_system = !messages.empty() && messages[0].role == "system";
    const std::span<const Message> turns = messages.subspan(has_system ? 1 : 0);
    const auto last = last_assistant(turns);
    std::vector<Segment> out;
    for (std::size_t i = 0; i < turns.size(); ++i) {
      const Message& m = turns[i];
      // The template's own check (raise_exception), with the message's index in the whole conversation.
      if ((m.role == "user") != (i % 2 == 0))
        throw invalid_argument(name() + ": message " + std::to_string(i + (has_system ? 1 : 0)) + " has role '" +
                               m.role + "'; after an optional system message, conversation roles must alternate "
                               "user/assistant/user/assistant/...");
      if (m.role == "user") {
        const std::string content =
            i == 0 && has_system ? "<<SYS>>\n" + messages[0].content + "\n<</SYS>>\n\n" + m.content : m.content;
        // Appended piece by piece: GCC 12's -Wrestrict misfires on "literal" + std::string&& + "literal".
        std::string text = "<s>[INST] ";
        text += strip(content);
        text += " [/INST]";
        out.push_back({std::move(text), false});
      } else {
        const bool train = !gen && (train_on == TrainOn::all_assistant || static_cast<std::ptrdiff_t>(i) == last);
        std::string text = " ";
        text += strip(m.content);
        text += " </s>";
        out.push_back({std::move(text), train});
      }
    }
    if (gen && (turns.empty() || turns.back().role != "user"))
      throw invalid_argument(name() + ": a generation prompt needs the conversation to end with a user message");
    return out;
  }

 private:
  token_id eos_;
};

}  // namespace

std::unique_ptr<ChatRenderer> make_llama2_renderer(std::shared_ptr<const Tokenizer> tok) {
  return std::make_unique<Llama2>(std::move(tok));
}

}  // namespace rlloop::tokenizer_detail
