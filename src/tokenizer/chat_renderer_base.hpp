// Shared machinery of the chat renderers: a renderer describes a conversation as text segments, each marked
// trained or not; this base turns them into tokens and per-token weights.
#pragma once
#include <initializer_list>

#include <rlloop/chat.hpp>

namespace rlloop::tokenizer_detail {

struct Segment {
  std::string text;
  bool train = false;
};

class SegmentRenderer : public ChatRenderer {
 public:
  explicit SegmentRenderer(std::shared_ptr<const Tokenizer> tokenizer);

  std::string render_text(std::span<const Message> messages, bool add_generation_prompt) const override;
  ModelInput build_generation_prompt(std::span<const Message> messages) const override;
  SupervisedExample build_supervised_example(std::span<const Message> messages, TrainOn train_on) const override;

 protected:
  // The conversation as segments; assistant parts are marked trained according to train_on (ignored when
  // add_generation_prompt is set).
  virtual std::vector<Segment> segments(std::span<const Message> messages, bool add_generation_prompt,
                                        TrainOn train_on) const = 0;
  // The id of a special token the format needs; throws naming the renderer and token when it is missing.
  token_id require_token(const std::string& token) const;
  // Tokens up to the first of `stops` (excluded), and whether one was found.
  std::pair<std::string, bool> text_until_stop(std::span<const token_id> tokens) const;
  // Index of the last assistant message, or -1.
  static std::ptrdiff_t last_assistant(std::span<const Message> messages);
  static void check_roles(std::span<const Message> messages, const std::string& renderer);
  // Python's str.strip() (the templates' `| trim` and `.strip()`) for ASCII whitespace; Unicode spaces at the ends
  // stay.
  static std::string strip(const std::string& s);
  // Per-token weights of `tokens` (the encoding of `text`, the segments' concatenation) found by encoding the text
  // up to each start and end of a trained stretch: for tokenizers whose pieces do not decode to the text's bytes.
  static std::vector<float> weights_by_prefixes(const Tokenizer& tok, const std::string& text,
                                                const std::vector<token_id>& tokens, const std::vector<Segment>& segs);

  std::shared_ptr<const Tokenizer> tok_;
};

// A format whose turns end with one special token (ChatML's <|im_end|>, Llama 3's <|eot_id|>, Gemma's <end_of_turn>):
// generation stops at it, or at the other end tokens the format names where the tokenizer has them, and a response
// is the text before the stop. A subclass names them in its constructor (ends_turns_with), among its other required
// tokens in the order it checks them.
class EndOfTurnRenderer : public SegmentRenderer {
 public:
  using SegmentRenderer::SegmentRenderer;
  std::vector<std::string> stop_sequences() const override { return {}; }
  std::vector<token_id> stop_token_ids() const override { return stops_; }
  ParsedResponse parse_response(std::span<const token_id> tokens) const override;

 protected:
  // `end_of_turn` is required (require_token); those of `optional` the tokenizer has stop generation too.
  void ends_turns_with(const std::string& end_of_turn, std::initializer_list<const char*> optional);

 private:
  std::vector<token_id> stops_;
};

}  // namespace rlloop::tokenizer_detail

namespace rlloop::tokenizer_detail {
// One per format (chat_qwen.cpp, chat_llama3.cpp, chat_llama2.cpp, chat_role_colon.cpp, chat_harmony.cpp,
// chat_gemma.cpp).
std::unique_ptr<ChatRenderer> make_chatml_renderer(std::shared_ptr<const Tokenizer> tok);
std::unique_ptr<ChatRenderer> make_smollm2_renderer(std::shared_ptr<const Tokenizer> tok);
std::unique_ptr<ChatRenderer> make_qwen3_renderer(std::shared_ptr<const Tokenizer> tok, bool thinking);
std::unique_ptr<ChatRenderer> make_llama3_renderer(std::shared_ptr<const Tokenizer> tok);
std::unique_ptr<ChatRenderer> make_llama2_renderer(std::shared_ptr<const Tokenizer> tok);
std::unique_ptr<ChatRenderer> make_role_colon_renderer(std::shared_ptr<const Tokenizer> tok);
std::unique_ptr<ChatRenderer> make_harmony_renderer(std::shared_ptr<const Tokenizer> tok);
std::unique_ptr<ChatRenderer> make_gemma_renderer(std::shared_ptr<const Tokenizer> tok);
}  // namespace rlloop::tokenizer_detail
