// The bounds of every request the library and the server accept, in one table, and the validate() functions that
// check a request against them. Every entry point calls these and nothing else re-checks a bound: the SageMaker
// wire readers and the OpenAI request parser (rlloop::wire), the server at submission (where it knows the model's
// context and vocabulary), the remote session before it sends, and the engine (local callers reach it directly).
// A violation throws rlloop::invalid_argument naming the field the way the caller spells it: "SamplingParams.top_p"
// in C++, "operationConfig.sample.samplingParams.topP" on the SageMaker wire, "top_p" on OpenAI's API.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <string_view>

#include <rlloop/error.hpp>
#include <rlloop/batch_checks.hpp>
#include <rlloop/types.hpp>

namespace rlloop {

// ---- the table -------------------------------------------------------------------------------------------------
namespace limits {

// Sampling (SamplingParams, SampleRequest).
inline constexpr int max_tokens_min = 1;               // at least one new token: a request for none is a mistake
inline constexpr int max_tokens_max = 131072;          // the SageMaker model's bound on samplingParams.maxTokens
inline constexpr double temperature_min = 0.0;         // 0 = greedy
inline constexpr double temperature_max = 2.0;         // the SageMaker model's and OpenAI's bound
inline constexpr int top_k_min = -1;                   // -1 (or 0) = off; otherwise the k most likely tokens
inline constexpr double top_p_max = 1.0;               // top_p in (0, top_p_max]: 0 would keep no token; 1 = off
inline constexpr int num_samples_min = 1;              // SampleRequest.num_samples (OpenAI's n)
inline constexpr int num_samples_max = 1000;           // the SageMaker model's bound on numSamples
inline constexpr int topk_prompt_logprobs_max = 1000;  // alternatives per prompt position (0 = none)
// OpenAI's own request rules (its API, not the sampler's): at most 4 stop strings; completions' logprobs 0-5,
// chat's top_logprobs 0-20.
inline constexpr int openai_stop_max = 4;
inline constexpr int openai_logprobs_max = 5;
inline constexpr int openai_top_logprobs_max = 20;

// Sessions (SessionOptions, LoraOptions).
inline constexpr int lora_rank_min = 1;
inline constexpr int lora_rank_max = 256;  // the SageMaker model's LoraConfig.Rank bound (ServerCapabilities too)
inline constexpr int lora_alpha_min = 1;   // the update is scaled by alpha / rank; the model has no upper bound
inline constexpr int lora_alpha_max = std::numeric_limits<std::int32_t>::max();  // the wire's Integer

// Names. A session name: 1 to session_name_max letters, digits and hyphens, starting and ending with a letter or
// digit (the SageMaker model's TrainingSessionName, [a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}); the same rule on the
// control plane, the runtime's URI and the OpenAI routes, so a name that cannot exist is refused everywhere alike.
inline constexpr std::size_t session_name_max = 63;
inline constexpr std::size_t operation_id_max = 64;   // operationId: 1-64 of [a-zA-Z0-9-] (the runtime model)
inline constexpr std::size_t client_token_max = 128;  // clientToken and Idempotency-Key: 1-128 of [a-zA-Z0-9-]
inline constexpr std::size_t hub_model_id_max = 64;   // the model id in a SageMaker Hub ARN
inline constexpr std::size_t description_max = 1024;  // saveWeights / saveState description

}  // namespace limits

// ---- field names -------------------------------------------------------------------------------------------------

// How the caller spells a field: C++ ("SamplingParams.top_p"), the SageMaker wire ("samplingParams.topP", after
// `prefix`, the JSON path of the request) or OpenAI's API ("top_p", after `prefix`).
struct Naming {
  enum Spelling { cpp, sagemaker, openai };
  Spelling spelling = cpp;
  std::string prefix;

  static Naming sagemaker_at(std::string path) { return {sagemaker, std::move(path)}; }
  static Naming openai_api() { return {openai, ""}; }

  // `type` is the C++ struct that holds the field; the other three are its spellings.
  std::string field(const char* type, const char* cpp_name, const char* wire_name, const char* openai_name) const {
    if (spelling == cpp) return std::string(type) + "." + cpp_name;
    const char* name = spelling == sagemaker ? wire_name : openai_name;
    return prefix.empty() ? std::string(name) : prefix + "." + name;
  }
  // The naming of a nested struct (SampleRequest::params is "samplingParams" on the wire, flat on OpenAI's API).
  Naming member(const char* wire_name) const {
    if (spelling != sagemaker) return *this;
    return {spelling, prefix.empty() ? std::string(wire_name) : prefix + "." + wire_name};
  }
};

// What the model a request goes to allows; 0 = not known here (the remote client, the wire parser), not checked.
struct ModelShape {
  std::int64_t context = 0;     // max_position_embeddings: prompt + max_tokens must fit
  std::int64_t vocab_size = 0;  // every prompt and stop token id below it
};

namespace detail {
inline std::string show(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "Infinity" : "-Infinity";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.15g", v);
  return buf;
}
[[noreturn]] inline void invalid(const std::string& field, const std::string& what) {
  throw invalid_argument(field + ": " + what);
}
inline void int_in(std::int64_t v, std::int64_t lo, std::int64_t hi, const std::string& field) {
  if (v < lo || v > hi)
    invalid(field, "must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " + std::to_string(v));
}
inline bool label_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-';
}
}  // namespace detail

// ---- sampling ----------------------------------------------------------------------------------------------------

inline void validate(const SamplingParams& p, const Naming& n = {}) {
  using detail::invalid;
  auto f = [&](const char* c, const char* w, const char* o) { return n.field("SamplingParams", c, w, o); };
  detail::int_in(p.max_tokens, limits::max_tokens_min, limits::max_tokens_max,
                 f("max_tokens", "maxTokens", "max_tokens"));
  if (!(p.temperature >= limits::temperature_min && p.temperature <= limits::temperature_max))
    invalid(f("temperature", "temperature", "temperature"), "must be in [" + detail::show(limits::temperature_min) +
                                                                ", " + detail::show(limits::temperature_max) +
                                                                "], got " + detail::show(p.temperature));
  if (p.top_k < limits::top_k_min)
    invalid(f("top_k", "topK", "top_k"),
            "must be >= " + std::to_string(limits::top_k_min) + " (-1 = off), got " + std::to_string(p.top_k));
  if (!(p.top_p > 0.0 && p.top_p <= limits::top_p_max))
    invalid(f("top_p", "topP", "top_p"),
            "must be in (0, " + detail::show(limits::top_p_max) + "], got " + detail::show(p.top_p));
  for (const auto& s : p.stop)
    if (s.empty()) invalid(f("stop", "stop", "stop"), "a stop string is empty");
  for (token_id t : p.stop_token_ids)
    if (t < 0)
      invalid(f("stop_token_ids", "stopTokenIds", "stop_token_ids"), "token id " + std::to_string(t) + " is negative");
}

// The request's own settings, without its prompt (what a parser knows before the prompt is rendered).
inline void validate_settings(const SampleRequest& r, const Naming& n = {}) {
  auto f = [&](const char* c, const char* w, const char* o) { return n.field("SampleRequest", c, w, o); };
  detail::int_in(r.num_samples, limits::num_samples_min, limits::num_samples_max, f("num_samples", "numSamples", "n"));
  detail::int_in(r.topk_prompt_logprobs, 0, limits::topk_prompt_logprobs_max,
                 f("topk_prompt_logprobs", "topkPromptLogprobs", "top_logprobs"));
  validate(r.params, n.member("samplingParams"));
}

// The whole request; with the model's shape, also its token ids and prompt + max_tokens against the context.
inline void validate(const SampleRequest& r, const Naming& n = {}, const ModelShape& model = {}) {
  validate_settings(r, n);
  const std::string prompt = n.field("SampleRequest", "prompt", "prompt", "prompt");
  if (r.prompt.length() == 0) detail::invalid(prompt, "the prompt is empty");
  if (model.vocab_size > 0) {
    validate_model_input(r.prompt, model.vocab_size, prompt + ": ");
    const Naming pn = n.member("samplingParams");
    for (token_id t : r.params.stop_token_ids)
      if (t >= model.vocab_size)
        detail::invalid(
            pn.field("SamplingParams", "stop_token_ids", "stopTokenIds", "stop_token_ids"),
            "token id " + std::to_string(t) + " is out of range [0, " + std::to_string(model.vocab_size) + ")");
  }
  if (model.context > 0) {
    const auto P = static_cast<std::int64_t>(r.prompt.length());
    if (P + r.params.max_tokens > model.context) {
      const std::string field =
          n.member("samplingParams").field("SamplingParams", "max_tokens", "maxTokens", "max_tokens");
      detail::invalid(field, "the prompt (" + std::to_string(P) + " tokens) + " + std::to_string(r.params.max_tokens) +
                                 " new tokens exceed the model's context of " + std::to_string(model.context) +
                                 " positions (at most " + std::to_string(std::max<std::int64_t>(model.context - P, 0)) +
                                 " new tokens fit)");
    }
  }
}

// ---- sessions ----------------------------------------------------------------------------------------------------

// A session name (SessionOptions::name when set, TrainingSessionName, the runtime's trainingSessionName).
inline void validate_session_name(std::string_view name, const std::string& field) {
  if (name.empty() || name.size() > limits::session_name_max)
    detail::invalid(field, "length must be in [1, " + std::to_string(limits::session_name_max) + "], got " +
                               std::to_string(name.size()));
  bool ok = name.front() != '-' && name.back() != '-';
  for (char c : name) ok = ok && detail::label_char(c);
  if (!ok)
    detail::invalid(
        field, "does not match [a-zA-Z0-9](-*[a-zA-Z0-9]){0," + std::to_string(limits::session_name_max - 1) + "}");
}

// An operation id, a client token or an Idempotency-Key: 1 to max of [a-zA-Z0-9-].
inline bool is_label(std::string_view s, std::size_t max) {
  if (s.empty() || s.size() > max) return false;
  for (char c : s)
    if (!detail::label_char(c)) return false;
  return true;
}
inline void validate_label(std::string_view s, std::size_t max, const std::string& field) {
  if (!is_label(s, max)) detail::invalid(field, "must be 1-" + std::to_string(max) + " characters of [a-zA-Z0-9-]");
}

// The model id of a SageMaker Hub ARN (".../Model/<id>"): [a-zA-Z0-9](-*[a-zA-Z0-9]){0,63}.
inline bool is_hub_model_id(std::string_view id) {
  return is_label(id, limits::hub_model_id_max) && id.front() != '-' && id.back() != '-';
}

// `n` spells LoRA's fields: C++ "LoraOptions.rank", the control plane's "LoraConfig.Rank".
inline void validate(const LoraOptions& l, const Naming& n = {}) {
  auto f = [&](const char* c, const char* w) { return n.field("LoraOptions", c, w, c); };
  detail::int_in(l.rank, limits::lora_rank_min, limits::lora_rank_max, f("rank", "Rank"));
  detail::int_in(l.alpha, limits::lora_alpha_min, limits::lora_alpha_max, f("alpha", "Alpha"));
  if (l.target_modules.empty()) detail::invalid(f("target_modules", "TargetModules"), "names no module");
}

// `n` with sagemaker spelling names the control plane's members (prefix empty: "LoraConfig.Rank").
inline void validate(const SessionOptions& o, const Naming& n = {}) {
  const bool wire = n.spelling == Naming::sagemaker;
  if (o.base_model.empty())
    detail::invalid(wire ? "ModelConfig.BaseModelArn" : "SessionOptions.base_model", "must not be empty");
  if (!o.name.empty()) validate_session_name(o.name, wire ? "TrainingSessionName" : "SessionOptions.name");
  if (o.lora) validate(*o.lora, wire ? n.member("LoraConfig") : n);
}

}  // namespace rlloop
