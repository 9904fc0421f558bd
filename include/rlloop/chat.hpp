// Chat renderers: turn a conversation into tokens for generation or for supervised training, name the stop
// sequences, and parse a sampled completion back into a message. Implementations (ChatML, Qwen3 with thinking
// on and off, Llama 3, Llama 2, gpt-oss's harmony, a plain "Role: content" format) live in rlloop::tokenizer;
// make_chat_renderer picks one.
#pragma once
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <rlloop/tokenizer.hpp>
#include <rlloop/types.hpp>

namespace rlloop {

struct Message {
  std::string role;  // "system", "user", "assistant" or "tool"
  std::string content;
  std::optional<std::string> reasoning_content;  // an assistant's thinking (Qwen3), apart from its answer
  bool operator==(const Message&) const = default;
};

// Which assistant messages a supervised example trains on.
enum class TrainOn { last_assistant, all_assistant };

// A tokenized conversation with a weight per token: 1 on the tokens the model should learn to produce (an
// assistant's answer and its end-of-turn token), 0 on the prompt.
struct SupervisedExample {
  std::vector<token_id> tokens;
  std::vector<float> weights;

  // The next-token datum for the cross_entropy loss: model_input = tokens[:-1], target_tokens = tokens[1:],
  // weights = weights[1:].
  Datum to_datum() const {
    if (tokens.size() < 2 || weights.size() != tokens.size())
      throw invalid_argument("SupervisedExample::to_datum: need at least 2 tokens and one weight per token (got " +
                             std::to_string(tokens.size()) + " tokens, " + std::to_string(weights.size()) +
                             " weights)");
    Datum d;
    d.model_input = ModelInput::from_tokens({tokens.begin(), tokens.end() - 1});
    d.loss_fn_inputs["target_tokens"] =
        TensorData::from_tokens(std::vector<token_id>(tokens.begin() + 1, tokens.end()));
    d.loss_fn_inputs["weights"] = TensorData::from_floats({weights.begin() + 1, weights.end()});
    return d;
  }
};

struct ParsedResponse {
  Message message;
  bool complete = false;  // the completion ended with an end-of-turn token or a stop sequence
};

class ChatRenderer {
 public:
  virtual ~ChatRenderer() = default;
  virtual std::string name() const = 0;
  // The conversation as text, exactly as the model's chat template writes it.
  virtual std::string render_text(std::span<const Message> messages, bool add_generation_prompt) const = 0;
  // Tokens to sample the next assistant message from (ends with the assistant header).
  virtual ModelInput build_generation_prompt(std::span<const Message> messages) const = 0;
  virtual SupervisedExample build_supervised_example(std::span<const Message> messages,
                                                     TrainOn train_on = TrainOn::last_assistant) const = 0;
  // Where sampling should stop: strings (matched on decoded text) and token ids.
  virtual std::vector<std::string> stop_sequences() const = 0;
  virtual std::vector<token_id> stop_token_ids() const = 0;
  // Stop settings ready for SamplingParams.
  SamplingParams sampling_params(SamplingParams base = {}) const {
    base.stop = stop_sequences();
    base.stop_token_ids = stop_token_ids();
    return base;
  }
  // A sampled completion (the tokens after the generation prompt) back to an assistant message.
  virtual ParsedResponse parse_response(std::span<const token_id> tokens) const = 0;
};

// Renderers by name:
//   "chatml"            <|im_start|>role\ncontent<|im_end|>\n (Qwen2/2.5 style, no default system prompt)
//   "smollm2"           SmolLM2-Instruct's template: ChatML opened by its default system message
//   "qwen3"             Qwen3's chat template, thinking on (the model opens <think> itself)
//   "qwen3_no_thinking" Qwen3 with enable_thinking=false (the prompt ends with an empty think block)
//   "llama3"            Llama 3 Instruct headers and <|eot_id|>; "gemma": <start_of_turn>user/model\n..<end_of_turn>
//   "llama2"            Llama 2 Chat: <s>[INST] <<SYS>>..<</SYS>> user [/INST] answer </s> (SentencePiece vocabularies)
//   "role_colon"        "User: ...\n\nAssistant: ..." for base models and the byte-level tokenizer
//   "harmony"           gpt-oss's harmony format (openai-harmony's rendering, o200k_harmony's special tokens): the
//                       analysis channel carries reasoning_content, the final channel the content
// Throws invalid_argument for an unknown name, or when the tokenizer lacks a special token the format needs.
std::unique_ptr<ChatRenderer> make_chat_renderer(const std::string& name, std::shared_ptr<const Tokenizer> tokenizer);

// The name of the renderer that writes what a model's own chat template writes. A GGUF tokenizer's template
// (tokenizer.chat_template) decides when rlloop recognises it by its markers: SmolLM2-Instruct's -> "smollm2",
// Qwen3's -> "qwen3_no_thinking", Llama 3's, 2's -> "llama3", "llama2", gpt-oss's "harmony", Gemma's "gemma"; another
// SentencePiece GGUF gets "role_colon". Otherwise `family_renderer`, the model family's format
// (SessionInfo::chat_renderer: "llama3" for llama, "chatml" for qwen2, "qwen3_no_thinking" for qwen3, "harmony" for
// gpt_oss), and "role_colon" for the byte tokenizer or when that is empty. tokenizer_spec is what load_tokenizer
// takes (SessionInfo::tokenizer); throws as gguf::File::open for a bad GGUF, and invalid_argument when
// family_renderer is not a renderer name. (Before December 2026 the second
// argument was the model_type; pass SessionInfo::chat_renderer instead: "qwen3" as a renderer means thinking on.)
std::string default_chat_renderer(const std::string& tokenizer_spec, const std::string& family_renderer);

// The names make_chat_renderer takes.
const std::vector<std::string>& chat_renderer_names();

}  // namespace rlloop
