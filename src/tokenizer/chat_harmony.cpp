// gpt-oss's harmony format, as OpenAI's openai-harmony renders it (HARMONY_GPT_OSS, o200k_harmony tokens):
//   <|start|>system<|message|>{model identity, knowledge cutoff, reasoning effort, channels}<|end|>
//   <|start|>developer<|message|># Instructions\n\n{a first system message's content}<|end|>
//   <|start|>user<|message|>{content}<|end|>
//   <|start|>assistant<|channel|>analysis<|message|>{reasoning}<|end|>
//   <|start|>assistant<|channel|>final<|message|>{content}<|end|>   (<|return|> when it ends a training example)
// and a generation prompt of <|start|>assistant: the model writes its analysis, then its final answer, and stops
// at <|return|> (or <|call|> for a tool call). The system message is openai-harmony's SystemContent.new() (no
// date, reasoning medium). Reasoning of turns before the last user message is dropped, as harmony's
// auto_drop_analysis does for a completed turn (harmony keeps the reasoning of the second and later completed
// turns: rlloop drops every completed turn's); the reasoning of the turn after it is rendered, and trained on.
#include "chat_renderer_base.hpp"

namespace rlloop::tokenizer_detail {
namespace {

constexpr const char* kSystem =
    "You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: 2024-06\n\nReasoning: medium\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message.";

class Harmony final : public SegmentRenderer {
 public:
  explicit Harmony(std::shared_ptr<const Tokenizer> tok) : SegmentRenderer(std::move(tok)) {
    channel_ = require_token("<|channel|>");
    start_ = require_token("<|start|>");
    message_ = require_token("<|message|>");
    end_ = require_token("<|end|>");
    return_ = require_token("<|return|>");
    call_ = require_token("<|call|>");
  }
  std::string name() const override { return "harmony"; }
  std::vector<std::string> stop_sequences() const override { return {}; }
  // The end of the assistant's turn (<|end|> only ends one of its messages, such as the analysis).
  std::vector<token_id> stop_token_ids() const override { return {return_, call_}; }

  // The sampled messages after <|start|>assistant: the analysis channel's text is the reasoning, the final
  // channel's (or a message's without a header) the content; complete when <|return|> or <|call|> ended the turn (a
  // tool call's arguments come back as content: rlloop renders no tool messages yet).
  ParsedResponse parse_response(std::span<const token_id> tokens) const override {
    ParsedResponse out{Message{"assistant", "", std::nullopt}, false};
    const auto ends_message = [&](token_id t) { return t == end_ || t == return_ || t == call_ || t == start_; };
    std::size_t i = 0;
    while (i < tokens.size()) {
      if (tokens[i] == start_) {  // the next message's <|start|>: its role and channel follow in its header
        ++i;
        continue;
      }
      std::size_t body = i;  // the header (role, channel, recipient) runs to <|message|>, if the message has one
      while (body < tokens.size() && tokens[body] != message_ && !ends_message(tokens[body])) ++body;
      std::string header;
      if (body < tokens.size() && tokens[body] == message_)
        header = tok_->decode(tokens.subspan(i, body++ - i));
      else
        body = i;
      std::size_t end = body;
      while (end < tokens.size() && !ends_message(tokens[end])) ++end;
      // A header that ended before its <|message|> carries no text.
      const bool unfinished_header = body == i && tokens[i] == channel_;
      const std::string text = unfinished_header ? "" : tok_->decode(tokens.subspan(body, end - body));
      if (channel_of(header) == "analysis")
        out.message.reasoning_content = out.message.reasoning_content.value_or("") + text;
      else
        out.message.content += text;
      if (end == tokens.size()) break;
      out.complete = tokens[end] == return_ || tokens[end] == call_;
      if (out.complete) break;
      i = tokens[end] == start_ ? end : end + 1;
    }
    return out;
  }

 protected:
  std::vector<Segment> segments(std::span<const Message> messages, bool gen, TrainOn train_on) const override {
    check_roles(messages, name());
    const auto last = last_assistant(messages);
    std::ptrdiff_t last_user = -1;
    for (std::size_t i = 0; i < messages.size(); ++i)
      if (messages[i].role == "user") last_user = static_cast<std::ptrdiff_t>(i);
    std::vector<Segment> out{{std::string("<|start|>system<|message|>") + kSystem + "<|end|>", false}};
    for (std::size_t i = 0; i < messages.size(); ++i) {
      const Message& m = messages[i];
      if (m.role == "system") {
        if (i != 0)
          throw invalid_argument("harmony: message " + std::to_string(i) +
                                 " is a system message; only the first message may be one (the developer's "
                                 "instructions)");
        out.push_back({"<|start|>developer<|message|># Instructions\n\n" + m.content + "<|end|>", false});
      } else if (m.role == "user") {
        out.push_back({"<|start|>user<|message|>" + m.content + "<|end|>", false});
      } else if (m.role == "assistant") {
        const auto at = static_cast<std::ptrdiff_t>(i);
        const bool train = !gen && (train_on == TrainOn::all_assistant || at == last);
        out.push_back({"<|start|>assistant", false});
        if (m.reasoning_content && at > last_user) {
          out.push_back({"<|channel|>analysis<|message|>" + *m.reasoning_content + "<|end|>", train});
          out.push_back({"<|start|>assistant", train});
        }
        const bool ends_example = !gen && i + 1 == messages.size();
        out.push_back({"<|channel|>final<|message|>" + m.content + (ends_example ? "<|return|>" : "<|end|>"), train});
      } else {
        throw invalid_argument("harmony: message " + std::to_string(i) +
                               " is a tool message; harmony's tool messages (functions.NAME on the commentary "
                               "channel) are not supported yet");
      }
    }
    if (gen) out.push_back({"<|start|>assistant", false});
    return out;
  }

 private:
  // The channel a message header names ("<|channel|>final", "<|channel|>commentary to=functions.f
  // <|constrain|>json"), or "" without one.
  static std::string channel_of(const std::string& header) {
    const auto at = header.find("<|channel|>");
    if (at == std::string::npos) return "";
    const auto from = at + std::string("<|channel|>").size();
    const auto to = header.find_first_of(" <", from);
    return header.substr(from, to == std::string::npos ? std::string::npos : to - from);
  }

  token_id channel_, start_, message_, end_, return_, call_;
};

}  // namespace

std::unique_ptr<ChatRenderer> make_harmony_renderer(std::shared_ptr<const Tokenizer> tok) {
  return std::make_unique<Harmony>(std::move(tok));
}

}  // namespace rlloop::tokenizer_detail
