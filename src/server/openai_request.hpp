// Parsing of OpenAI chat-completion / completion request bodies into the sampler's terms, with OpenAI's field
// names and limits; a bad field is an api_error naming it (400), never a crash.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include <rlloop/chat.hpp>

#include "server/api_impl.hpp"

namespace rlloop::server::openai {

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

}  // namespace rlloop::server::openai
