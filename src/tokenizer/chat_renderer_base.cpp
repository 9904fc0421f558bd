// Turns trained/untrained text segments into tokens and weights.
#include "chat_renderer_base.hpp"

#include <algorithm>

namespace rlloop::tokenizer_detail {

SegmentRenderer::SegmentRenderer(std::shared_ptr<const Tokenizer> tokenizer) : tok_(std::move(tokenizer)) {
  if (!tok_) throw invalid_argument("make_chat_renderer: tokenizer is null");
}

std::string SegmentRenderer::render_text(std::span<const Message> messages, bool add_generation_prompt) const {
  std::string out;
  for (const Segment& s : segments(messages, add_generation_prompt, TrainOn::last_assistant)) out += s.text;
  return out;
}

ModelInput SegmentRenderer::build_generation_prompt(std::span<const Message> messages) const {
  return ModelInput::from_tokens(tok_->encode(render_text(messages, true), true));
}

SupervisedExample SegmentRenderer::build_supervised_example(std::span<const Message> messages, TrainOn train_on) const {
  if (last_assistant(messages) < 0)
    throw invalid_argument(name() + ": a supervised example needs at least one assistant message");
  const std::vector<Segment> segs = segments(messages, false, train_on);
  std::string text;
  std::vector<std::pair<std::size_t, std::size_t>> trained;  // byte ranges
  for (const Segment& s : segs) {
    if (s.train && !s.text.empty()) trained.emplace_back(text.size(), text.size() + s.text.size());
    text += s.text;
  }
  SupervisedExample ex;
  // Encode the whole text at once so tokens match what the template + tokenizer produce, then weight each
  // token by whether its bytes overlap a trained range.
  ex.tokens = tok_->encode(text, true);
  std::vector<std::size_t> ends;
  ends.reserve(ex.tokens.size());
  std::size_t pos = 0;
  for (token_id id : ex.tokens) {
    const token_id one[1] = {id};
    pos += tok_->decode(std::span<const token_id>(one, 1)).size();
    ends.push_back(pos);
  }
  if (pos == text.size()) {
    std::size_t begin = 0;
    for (std::size_t i = 0; i < ex.tokens.size(); ++i) {
      const std::size_t end = ends[i];
      const bool t =
          std::any_of(trained.begin(), trained.end(), [&](const auto& r) { return begin < r.second && end > r.first; });
      ex.weights.push_back(t ? 1.0f : 0.0f);
      begin = end;
    }
    return ex;
  }
  // Decoded pieces do not add up to the text: the tokenizer added bytes (a SentencePiece ▁ prefix after each special
  // token) or rewrote them (a normalizer's NFC). Find the token boundaries by encoding prefixes instead.
  ex.weights = weights_by_prefixes(*tok_, text, ex.tokens, segs);
  return ex;
}

std::vector<float> SegmentRenderer::weights_by_prefixes(const Tokenizer& tok, const std::string& text,
                                                        const std::vector<token_id>& tokens,
                                                        const std::vector<Segment>& segs) {
  // Where the trained flag changes, in bytes. Tokens [0, lo) of the whole text are the encoding of the text before
  // the cut (their common prefix with its own encoding); when that encoding has more tokens than the common part,
  // token lo straddles the cut and belongs to both sides. A token weighs 1 when it overlaps a trained stretch.
  struct Cut {
    std::size_t lo, hi;  // tokens [0, lo) lie before the cut, tokens [hi, n) after it
  };
  auto cut_at = [&](std::size_t byte) {
    if (byte == 0) return Cut{0, 0};
    if (byte == text.size()) return Cut{tokens.size(), tokens.size()};
    const std::vector<token_id> prefix = tok.encode(std::string_view(text).substr(0, byte), true);
    const auto diverge = std::mismatch(prefix.begin(), prefix.end(), tokens.begin(), tokens.end());
    const auto lo = static_cast<std::size_t>(diverge.first - prefix.begin());
    return Cut{lo, diverge.first == prefix.end() ? lo : std::min(lo + 1, tokens.size())};
  };
  std::vector<float> weights(tokens.size(), 0.0f);
  std::size_t begin = 0;
  for (std::size_t i = 0; i < segs.size();) {
    // A stretch of segments with the same flag, bytes [begin, end).
    std::size_t end = begin, j = i;
    for (; j < segs.size() && segs[j].train == segs[i].train; ++j) end += segs[j].text.size();
    if (segs[i].train && end > begin) {
      const std::size_t first = cut_at(begin).lo, last = cut_at(end).hi;
      std::fill(weights.begin() + static_cast<std::ptrdiff_t>(first),
                weights.begin() + static_cast<std::ptrdiff_t>(last), 1.0f);
    }
    begin = end;
    i = j;
  }
  return weights;
}

void EndOfTurnRenderer::ends_turns_with(const std::string& end_of_turn, std::initializer_list<const char*> optional) {
  stops_ = {require_token(end_of_turn)};
  for (const char* token : optional)
    if (auto id = tok_->token_to_id(token)) stops_.push_back(*id);
}

ParsedResponse EndOfTurnRenderer::parse_response(std::span<const token_id> tokens) const {
  auto [text, complete] = text_until_stop(tokens);
  return {Message{"assistant", std::move(text), std::nullopt}, complete};
}

token_id SegmentRenderer::require_token(const std::string& token) const {
  auto id = tok_->token_to_id(token);
  if (!id)
    throw invalid_argument("make_chat_renderer: " + name() + " needs the token '" + token +
                           "', which the tokenizer lacks");
  return *id;
}

std::pair<std::string, bool> SegmentRenderer::text_until_stop(std::span<const token_id> tokens) const {
  const auto stops = stop_token_ids();
  auto it = std::find_first_of(tokens.begin(), tokens.end(), stops.begin(), stops.end());
  std::string text = tok_->decode(std::span<const token_id>(tokens.begin(), it));
  bool found = it != tokens.end();
  for (const std::string& s : stop_sequences()) {
    if (auto p = text.find(s); p != std::string::npos) {
      text.resize(p);
      found = true;
    }
  }
  return {text, found};
}

std::ptrdiff_t SegmentRenderer::last_assistant(std::span<const Message> messages) {
  for (std::ptrdiff_t i = static_cast<std::ptrdiff_t>(messages.size()) - 1; i >= 0; --i)
    if (messages[static_cast<std::size_t>(i)].role == "assistant") return i;
  return -1;
}

std::string SegmentRenderer::strip(const std::string& s) {
  const char* ws = " \t\n\r\f\v";
  const auto b = s.find_first_not_of(ws);
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(ws) - b + 1);
}

void SegmentRenderer::check_roles(std::span<const Message> messages, const std::string& renderer) {
  for (std::size_t i = 0; i < messages.size(); ++i) {
    const auto& r = messages[i].role;
    if (r != "system" && r != "user" && r != "assistant" && r != "tool")
      throw invalid_argument(renderer + ": message " + std::to_string(i) + " has unknown role '" + r +
                             "' (expected system, user, assistant or tool)");
  }
}

}  // namespace rlloop::tokenizer_detail
