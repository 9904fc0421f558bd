// Llama 3 Instruct: <|begin_of_text|> then <|start_header_id|>role<|end_header_id|>\n\n + trimmed content +
// <|eot_id|> per message (the Meta-Llama-3 chat template).
#include "chat_renderer_base.hpp"

namespace rlloop::tokenizer_detail {
namespace {

class Llama3 final : public EndOfTurnRenderer {
 public:
  explicit Llama3(std::shared_ptr<const Tokenizer> tok) : EndOfTurnRenderer(std::move(tok)) {
    for (const char* t : {"<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>"}) require_token(t);
    ends_turns_with("<|eot_id|>", {"<|end_of_text|>", "<|eom_id|>"});
  }
  std::string name() const override { return "llama3"; }

 protected:
  std::vector<Segment> segments(std::span<const Message> messages, bool gen, TrainOn train_on) const override {
    check_roles(messages, name());
    const auto last = last_assistant(messages);
    std::vector<Segment> out{{"<|begin_of_text|>", false}};
    for (std::size_t i = 0; i < messages.size(); ++i) {
      const Message& m = messages[i];
      const std::string role = m.role == "tool" ? "ipython" : m.role;
      out.push_back({"<|start_header_id|>" + role + "<|end_header_id|>\n\n", false});
      const bool train = !gen && m.role == "assistant" &&
                         (train_on == TrainOn::all_assistant || static_cast<std::ptrdiff_t>(i) == last);
      out.push_back({strip(m.content) + "<|eot_id|>", train});
    }
    if (gen) out.push_back({"<|start_header_id|>assistant<|end_header_id|>\n\n", false});
    return out;
  }

};

}  // namespace

std::unique_ptr<ChatRenderer> make_llama3_renderer(std::shared_ptr<const Tokenizer> tok) {
  return std::make_unique<Llama3>(std::move(tok));
}

}  // namespace rlloop::tokenizer_detail
