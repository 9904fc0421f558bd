// Plain-data types exchanged with a training session. No LibTorch, no JSON here (the wire protocol is the compiled
// rlloop::wire module, src/wire/), so code that only builds data pays nothing for either.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <rlloop/error.hpp>

namespace rlloop {

using token_id = std::int32_t;

// One run of already-tokenized text ("encoded_text" on the wire).
struct EncodedTextChunk {
  std::vector<token_id> tokens;
  bool operator==(const EncodedTextChunk&) const = default;
};

// A model input: chunks concatenated in order.
struct ModelInput {
  std::vector<EncodedTextChunk> chunks;

  static ModelInput from_tokens(std::vector<token_id> tokens) {
    return ModelInput{{EncodedTextChunk{std::move(tokens)}}};
  }

  std::size_t length() const {
    std::size_t n = 0;
    for (const auto& c : chunks) n += c.tokens.size();
    return n;
  }
  std::vector<token_id> tokens() const {
    std::vector<token_id> out;
    out.reserve(length());
    for (const auto& c : chunks) out.insert(out.end(), c.tokens.begin(), c.tokens.end());
    return out;
  }
  ModelInput& append(std::vector<token_id> tokens) {
    chunks.push_back(EncodedTextChunk{std::move(tokens)});
    return *this;
  }
  bool operator==(const ModelInput&) const = default;
};

enum class DType { float32, int64 };

inline const char* to_string(DType d) { return d == DType::float32 ? "float32" : "int64"; }

// A dense array with a dtype and a shape. Exactly one of float_data / int_data is used, per dtype.
// An empty shape means one dimension of size() elements.
struct TensorData {
  DType dtype = DType::float32;
  std::vector<std::int64_t> shape;
  std::vector<float> float_data;
  std::vector<std::int64_t> int_data;

  static TensorData from_floats(std::vector<float> v) {
    TensorData t;
    t.dtype = DType::float32;
    t.shape = {static_cast<std::int64_t>(v.size())};
    t.float_data = std::move(v);
    return t;
  }
  static TensorData from_ints(std::vector<std::int64_t> v) {
    TensorData t;
    t.dtype = DType::int64;
    t.shape = {static_cast<std::int64_t>(v.size())};
    t.int_data = std::move(v);
    return t;
  }
  template <class Int>
  static TensorData from_tokens(const std::vector<Int>& v) {
    return from_ints(std::vector<std::int64_t>(v.begin(), v.end()));
  }

  std::size_t size() const { return dtype == DType::float32 ? float_data.size() : int_data.size(); }

  // Values as doubles whatever the dtype (loss inputs are small; this is the convenient accessor).
  std::vector<double> as_doubles() const {
    return dtype == DType::float32 ? std::vector<double>(float_data.begin(), float_data.end())
                                   : std::vector<double>(int_data.begin(), int_data.end());
  }
  bool operator==(const TensorData&) const = default;
};

// One training example: the input and the named per-token loss inputs ("target_tokens", "weights",
// "advantages", "logprobs", ...), each as long as the input.
struct Datum {
  ModelInput model_input;
  std::map<std::string, TensorData> loss_fn_inputs;
  bool operator==(const Datum&) const = default;
};

// Sampling settings. max_tokens counts generated tokens; top_k <= 0 disables; top_p = 1 disables;
// temperature 0 is greedy. stop holds strings (matched on decoded text); stop_token_ids holds token ids
// (EOS is one of them when the model has one and the caller asked for it).
struct SamplingParams {
  int max_tokens = 64;
  double temperature = 1.0;
  int top_k = -1;
  double top_p = 1.0;
  std::optional<std::int64_t> seed;
  std::vector<std::string> stop;
  std::vector<token_id> stop_token_ids;
  bool operator==(const SamplingParams&) const = default;
};

// AdamW settings for one optimizer step. weight_decay is decoupled (AdamW); grad_clip_norm rescales the
// global gradient norm; lora_plus_lr_ratio multiplies the learning rate of LoRA B matrices (LoRA+).
struct AdamParams {
  double learning_rate = 1e-4;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.0;
  std::optional<double> grad_clip_norm;
  double lora_plus_lr_ratio = 1.0;
  bool operator==(const AdamParams&) const = default;
};

// Tokens metered for billing.
struct TokenUsage {
  std::int64_t prefill = 0;   // prompt tokens processed by the sampler
  std::int64_t sample = 0;    // generated tokens
  std::int64_t training = 0;  // tokens through forward / forward_backward
  TokenUsage& operator+=(const TokenUsage& o) {
    prefill += o.prefill;
    sample += o.sample;
    training += o.training;
    return *this;
  }
  bool operator==(const TokenUsage&) const = default;
};

using Metrics = std::map<std::string, double>;

// Result of forward / forward_backward / forward_backward_custom: one map per datum (at least "logprobs",
// the per-token logprob of each target token), plus aggregate metrics such as "loss:sum".
struct ForwardBackwardOutput {
  std::vector<std::map<std::string, TensorData>> loss_fn_outputs;
  std::string loss_fn_output_type = "float32";
  Metrics metrics;
  std::int64_t training_tokens = 0;

  // Per-token logprobs of datum i.
  std::vector<double> logprobs(std::size_t i) const {
    if (i >= loss_fn_outputs.size())
      throw invalid_argument("ForwardBackwardOutput::logprobs: datum index out of range");
    auto it = loss_fn_outputs[i].find("logprobs");
    if (it == loss_fn_outputs[i].end()) throw invalid_argument("ForwardBackwardOutput::logprobs: no logprobs output");
    return it->second.as_doubles();
  }
};

struct OptimStepOutput {
  Metrics metrics;  // e.g. "grad_norm", "lr", "step"
};

// A saved checkpoint: a local path (local session) or a model-package ARN (remote session).
struct CheckpointRef {
  std::string path;
};

struct LoadStateOutput {};

enum class StopReason { stop, length };
inline const char* to_string(StopReason r) { return r == StopReason::stop ? "stop" : "length"; }

struct SampledSequence {
  StopReason stop_reason = StopReason::length;
  std::vector<token_id> tokens;
  std::vector<double> logprobs;
  std::int64_t prefill_tokens = 0;
  std::int64_t decode_tokens = 0;
  // With SampleRequest::include_routed_experts (models with experts): the experts each token the model read was
  // routed to, int64 [prompt + tokens - 1, sparse layers, experts per token]: the prompt's, then every generated
  // token's but the last (never fed back). A datum over the same tokens (model_input = prompt + tokens[:-1]) takes
  // it as loss input "routed_experts" to be routed the same way in training (routing replay).
  std::optional<TensorData> routed_experts;
};

struct TokenLogprob {
  token_id token = 0;
  double logprob = 0.0;
  bool operator==(const TokenLogprob&) const = default;
};

struct SampleResponse {
  std::vector<SampledSequence> sequences;
  // One entry per prompt token when requested; the first token has no context and gets 0.0.
  std::optional<std::vector<double>> prompt_logprobs;
  std::optional<std::vector<std::vector<TokenLogprob>>> topk_prompt_logprobs;
};

// A sampling request. model_path selects saved sampler weights; empty = the session's current weights.
struct SampleRequest {
  ModelInput prompt;
  int num_samples = 1;
  SamplingParams params;
  bool include_prompt_logprobs = false;
  int topk_prompt_logprobs = 0;
  std::optional<std::string> model_path;
  bool include_routed_experts = false;  // return each sequence's routes (SampledSequence::routed_experts)
};

struct ComputeLogprobsRequest {
  ModelInput prompt;
  std::optional<std::string> model_path;
};

// User-defined objective for forward_backward_custom: receives the per-token logprobs of every datum and
// returns the loss and d loss / d logprob for each token (same shapes), as plain arrays.
struct CustomLossResult {
  double loss = 0.0;
  std::vector<std::vector<double>> grad_logprobs;
  Metrics metrics;
};

// LoRA settings. target_modules names projections (the model family's names; for llama, qwen2 and qwen3):
// q_proj k_proj v_proj o_proj gate_proj up_proj down_proj
// lm_head; "all-linear" selects every transformer linear (not lm_head).
struct LoraOptions {
  int rank = 16;
  int alpha = 32;
  std::vector<std::string> target_modules = {"all-linear"};
  bool operator==(const LoraOptions&) const = default;
};

// What a session is created with.
struct SessionOptions {
  std::string base_model;           // a catalogue name or a model directory (HF layout)
  std::optional<LoraOptions> lora;  // nullopt = full fine-tuning
  std::int64_t seed = 0;            // LoRA init, dropout-free; also the default sampler seed stream
  std::string name;                 // optional human-readable session name
  bool value_head = false;          // add a trainable scalar head on the final hidden state (PPO critic)
};

// The experts of a model's sparse layers (all zero for a dense model): what routes (the loss input
// "routed_experts", SampledSequence::routed_experts) must fit.
struct ExpertShape {
  std::int64_t num_experts = 0;
  std::int64_t experts_per_token = 0;  // k: the experts each token is routed to
  std::int64_t sparse_layers = 0;      // the layers with experts
  bool any() const { return num_experts > 0; }
  bool operator==(const ExpertShape&) const = default;
};

struct SessionInfo {
  std::string name;
  std::string base_model;
  std::string model_type;     // "llama", "qwen2", "qwen3", ...
  std::string chat_renderer;  // the family's chat format (make_chat_renderer's name; default_chat_renderer)
  std::optional<LoraOptions> lora;
  std::int64_t vocab_size = 0;
  std::int64_t max_position_embeddings = 0;
  std::int64_t num_parameters = 0;
  std::int64_t num_trainable_parameters = 0;
  std::string tokenizer;  // what load_tokenizer() accepts: a tokenizer.json path or "byte"
  std::optional<token_id> eos_token_id;
  std::string device;     // "cpu", "cuda:0"
  std::int64_t step = 0;  // optimizer steps taken
  bool value_head = false;
  ExpertShape experts;  // zero for a dense model
};

struct ServerCapabilities {
  std::vector<std::string> base_models;
  std::vector<std::string> loss_functions;
  bool supports_full_finetune = false;
  std::int64_t max_lora_rank = 0;  // the largest LoRA rank a session may have (limits::lora_rank_max); 0 = not said
};

}  // namespace rlloop
