#include "wire/openai.hpp"

#include <cstdint>
#include <limits>

#include <rlloop/error.hpp>
#include <rlloop/limits.hpp>

namespace rlloop::wire::openai {

namespace {

[[noreturn]] void bad(const std::string& field, const std::string& why) {
  throw invalid_argument("'" + field + "' " + why);
}

double number_or(const json& body, const char* key, double fallback) {
  if (!body.contains(key) || body[key].is_null()) return fallback;
  if (!body[key].is_number()) bad(key, "must be a number");
  return body[key].get<double>();
}

std::int64_t integer_in(const json& body, const char* key, std::int64_t lo, std::int64_t hi, std::int64_t fallback) {
  if (!body.contains(key) || body[key].is_null()) return fallback;
  if (!body[key].is_number_integer()) bad(key, "must be an integer");
  const auto v = body[key].get<std::int64_t>();
  if (v < lo || v > hi) bad(key, "must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  return v;
}

// A message's content: a string, or an array of {"type": "text", "text": ...} parts.
std::string content_of(const json& c, const std::string& where) {
  if (c.is_string()) return c.get<std::string>();
  if (c.is_null()) return "";
  if (!c.is_array()) bad(where, "must be a string or an array of text parts");
  std::string out;
  for (std::size_t i = 0; i < c.size(); ++i) {
    const json& part = c[i];
    const std::string pw = where + "[" + std::to_string(i) + "]";
    if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") || !part["text"].is_string())
      bad(pw, "must be {\"type\": \"text\", \"text\": string} (only text is supported)");
    out += part["text"].get<std::string>();
  }
  return out;
}

// A chat request's messages (OpenAI's "developer" role is the system role).
void read_messages(const json& body, Request& r) {
  if (!body.contains("messages") || !body["messages"].is_array() || body["messages"].empty())
    bad("messages", "must be a non-empty array");
  const json& ms = body["messages"];
  for (std::size_t i = 0; i < ms.size(); ++i) {
    const std::string w = "messages[" + std::to_string(i) + "]";
    if (!ms[i].is_object() || !ms[i].contains("role") || !ms[i]["role"].is_string())
      bad(w, "must be an object with a string role");
    std::string role = ms[i]["role"].get<std::string>();
    if (role == "developer") role = "system";  // OpenAI's newer name for the system role
    if (role != "system" && role != "user" && role != "assistant" && role != "tool")
      bad(w + ".role", "must be system, developer, user, assistant or tool");
    r.messages.push_back(Message{role, content_of(ms[i].value("content", json()), w + ".content"), std::nullopt});
  }
}

// A completion request's prompt: a string, an array of one string, or token ids.
void read_prompt(const json& body, Request& r) {
  if (!body.contains("prompt")) bad("prompt", "is required");
  const json& p = body["prompt"];
  if (p.is_string()) {
    r.prompt = p.get<std::string>();
  } else if (p.is_array() && p.size() == 1 && p[0].is_string()) {
    r.prompt = p[0].get<std::string>();
  } else if (p.is_array() && !p.empty() && p[0].is_number_integer()) {
    for (std::size_t i = 0; i < p.size(); ++i) {
      if (!p[i].is_number_integer()) bad("prompt[" + std::to_string(i) + "]", "must be a token id");
      const auto id = p[i].get<std::int64_t>();
      if (id < 0 || id > std::numeric_limits<token_id>::max())
        bad("prompt[" + std::to_string(i) + "]", "is not a token id");
      r.prompt_tokens.push_back(static_cast<token_id>(id));
    }
  } else {
    bad("prompt", "must be a string, an array of one string, or an array of token ids");
  }
}

// "stop": a string or an array of up to limits::openai_stop_max strings.
void read_stop(const json& s, Request& r) {
  const std::string shape =
      "must be a string or an array of up to " + std::to_string(limits::openai_stop_max) + " strings";
  if (s.is_string()) {
    r.params.stop.push_back(s.get<std::string>());
  } else if (s.is_array() && s.size() <= static_cast<std::size_t>(limits::openai_stop_max)) {
    for (const auto& e : s) {
      if (!e.is_string()) bad("stop", shape);
      r.params.stop.push_back(e.get<std::string>());
    }
  } else {
    bad("stop", shape);
  }
}

}  // namespace

Request parse_request(const std::string& text, bool chat, bool model_required) {
  json body = json::parse(text, nullptr, false);
  if (body.is_discarded()) throw invalid_argument("request body is not valid JSON");
  if (!body.is_object()) throw invalid_argument("request body must be a JSON object");
  Request r;
  r.chat = chat;
  if (body.contains("model")) {
    if (!body["model"].is_string()) bad("model", "must be a string");
    r.model = body["model"].get<std::string>();
  } else if (model_required) {
    bad("model", "is required (a training session name or a checkpoint ARN; see GET /v1/models)");
  }
  if (chat)
    read_messages(body, r);
  else
    read_prompt(body, r);
  // Types here; the bounds are rlloop/limits.hpp's (validate_settings below, and the prompt against the model's
  // context once it is rendered, at submission).
  constexpr std::int64_t int32_min = std::numeric_limits<std::int32_t>::min();
  constexpr std::int64_t int32_max = std::numeric_limits<std::int32_t>::max();
  r.n = static_cast<int>(integer_in(body, "n", int32_min, int32_max, 1));
  r.params.temperature = number_or(body, "temperature", 1.0);
  r.params.top_p = number_or(body, "top_p", 1.0);
  const std::int64_t max_tokens = integer_in(body, "max_tokens", int32_min, int32_max, 16);
  r.params.max_tokens = static_cast<int>(integer_in(body, "max_completion_tokens", int32_min, int32_max, max_tokens));
  if (body.contains("seed") && !body["seed"].is_null())
    r.params.seed = integer_in(body, "seed", INT64_MIN, INT64_MAX, 0);
  if (body.contains("stop") && !body["stop"].is_null()) read_stop(body["stop"], r);
  if (body.contains("logprobs") && !body["logprobs"].is_null()) {
    const json& l = body["logprobs"];
    if (chat) {
      if (!l.is_boolean()) bad("logprobs", "must be a boolean");
      r.logprobs = l.get<bool>();
    } else {
      r.logprobs = integer_in(body, "logprobs", 0, limits::openai_logprobs_max, 0) > 0;
    }
  }
  if (integer_in(body, "top_logprobs", 0, limits::openai_top_logprobs_max, 0) > 0)
    bad("top_logprobs", "is not supported (alternatives are not computed); use 0");
  if (body.contains("stream") && !body["stream"].is_null()) {
    if (!body["stream"].is_boolean()) bad("stream", "must be a boolean");
    r.stream = body["stream"].get<bool>();
  }
  if (body.contains("stream_options") && body["stream_options"].is_object()) {
    const json& so = body["stream_options"];
    if (so.contains("include_usage") && !so["include_usage"].is_boolean())
      bad("stream_options.include_usage", "must be a boolean");
    r.include_usage = so.value("include_usage", false);
  }
  validate_settings(SampleRequest{.num_samples = r.n, .params = r.params}, Naming::openai_api());
  return r;
}

json usage_to_json(const TokenUsage& u) {
  return {{"prompt_tokens", u.prefill}, {"completion_tokens", u.sample}, {"total_tokens", u.prefill + u.sample}};
}

}  // namespace rlloop::wire::openai
