// OpenAI's chat-completion and completion request bodies, read into the sampler's terms with OpenAI's field names
// (its own request rules too: at most 4 stop strings, logprobs 0-5; the sampling bounds are rlloop/limits.hpp's).
// A bad field throws rlloop::invalid_argument naming it ("'temperature' must be a number"); the server answers it
// as OpenAI's invalid_request_error (400).
#pragma once
#include <optional>
#include <string>
#include <vector>

#include <rlloop/chat.hpp>
#include <rlloop/types.hpp>

#include "wire/read.hpp"

namespace rlloop::wire::openai {

struct Request {
  bool chat = true;
  std::string model;
  std::vector<Message> messages;        // chat
  std::optional<std::string> prompt;    // completions: text
  std::vector<token_id> prompt_tokens;  // completions: already tokenized
  int n = 1;
  SamplingParams params;  // max_tokens, temperature, top_p, seed, stop (the user's stop strings)
  bool logprobs = false;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
};

// chat = /v1/chat/completions shape (messages), else /v1/completions (prompt). model_required: /v1/* paths.
Request parse_request(const std::string& body, bool chat, bool model_required);

// A response's `usage`: prompt_tokens, completion_tokens and total_tokens.
json usage_to_json(const TokenUsage& u);

}  // namespace rlloop::wire::openai
