// Gemma 2 Instruct (the google/gemma-2-*-it chat template): <bos>, then per message "<start_of_turn>" + role ("user",
// or "model" for the assistant) + "\n" + trimmed content + "<end_of_turn>\n", and "<start_of_turn>model\n" as the
// generation prompt. As the template does, a system message is refused, and the roles must alternate from the user.
#include "chat_renderer_base.hpp"

namespace rlloop::tokenizer_detail {
namespace {

class Gemma final : public EndOfTurnRenderer {
 public:
  explicit Gemma(std::shared_ptr<const Tokenizer> tok) : EndOfTurnRenderer(std::move(tok)) {
    require_token("<bos>");
    require_token("<start_of_turn>");
    ends_turns_with("<end_of_turn>", {"<eos>"});
  }
  std::string name() const override { return "gemma"; }

 protected:
  std::vector<Segment> segments(std::span<const Message> messages, bool gen, TrainOn train_on) const override {
    check_roles(messages, name());
    const auto last = last_assistant(messages);
    std::vector<Segment> out{{"<bos>", false}};
    for (std::size_t i = 0; i < messages.size(); ++i) {
      const Message& m = messages[i];
      if (m.role == "system")
        throw invalid_argument(name() + ": the system role is not supported (Gemma's template refuses it)");
      // The template's own check (raise_exception).
      if ((m.role == "user") != (i % 2 == 0))
        throw invalid_argument(name() + ": message " + std::to_string(i) + " has role '" + m.role +
                               "'; conversation roles must alternate user/assistant/user/assistant/...");
      out.push_back({"<start_of_turn>" + std::string(m.role == "assistant" ? "model" : m.role) + "\n", false});
      const bool train = !gen && m.role == "assistant" &&
                         (train_on == TrainOn::all_assistant || static_cast<std::ptrdiff_t>(i) == last);
      out.push_back({strip(m.content) + "<end_of_turn>", train});
      out.push_back({"\n", false});
    }
    if (gen) out.push_back({"<start_of_turn>model\n", false});
    return out;
  }

};

}  // namespace

std::unique_ptr<ChatRenderer> make_gemma_renderer(std::shared_ptr<const Tokenizer> tok) {
  return std::make_unique<Gemma>(std::move(tok));
}

}  // namespace rlloop::tokenizer_detail
