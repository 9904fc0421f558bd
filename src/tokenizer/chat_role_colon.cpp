// "Role: content" turns separated by blank lines, for base models and the byte-level tokenizer, which have no
// chat special tokens: "User: 2+2?\n\nAssistant: 4\n\n". The model ends its turn by starting the next one,
// so the stop sequences are the next headers; the tokenizer's EOS also stops.
#include "chat_renderer_base.hpp"

namespace rlloop::tokenizer_detail {
namespace {

std::string header(const std::string& role) {
  std::string r = role;
  r[0] = static_cast<char>(r[0] - 'a' + 'A');
  return r + ":";
}

class RoleColon final : public SegmentRenderer {
 public:
  explicit RoleColon(std::shared_ptr<const Tokenizer> tok) : SegmentRenderer(std::move(tok)) {}
  std::string name() const override { return "role_colon"; }
  std::vector<std::string> stop_sequences() const override { return {"\n\nUser:", "\n\nSystem:", "\n\nTool:"}; }
  std::vector<token_id> stop_token_ids() const override {
    if (auto eos = tok_->eos_token_id()) return {*eos};
    return {};
  }
  ParsedResponse parse_response(std::span<const token_id> tokens) const override {
    auto [text, complete] = text_until_stop(tokens);
    if (text.starts_with(' ')) text.erase(0, 1);
    // A turn ends with a blank line; without a stop the trailing one still marks a finished turn.
    if (text.ends_with("\n\n")) {
      text.resize(text.size() - 2);
      complete = true;
    }
    return {Message{"assistant", std::move(text), std::nullopt}, complete};
  }

 protected:
  std::vector<Segment> segments(std::span<const Message> messages, bool gen, TrainOn train_on) const override {
    check_roles(messages, name());
    const auto last = last_assistant(messages);
    std::vector<Segment> out;
    for (std::size_t i = 0; i < messages.size(); ++i) {
      const Message& m = messages[i];
      const bool train = !gen && m.role == "assistant" &&
                         (train_on == TrainOn::all_assistant || static_cast<std::ptrdiff_t>(i) == last);
      // The space after the colon belongs to the answer so the prompt can end at "Assistant:".
      out.push_back({header(m.role), false});
      out.push_back({" " + m.content + "\n\n", train});
    }
    if (gen) out.push_back({"Assistant:", false});
    return out;
  }
};

}  // namespace

std::unique_ptr<ChatRenderer> make_role_colon_renderer(std::shared_ptr<const Tokenizer> tok) {
  return std::make_unique<RoleColon>(std::move(tok));
}

}  // namespace rlloop::tokenizer_detail
