// Batched, KV-cached sampling of num_samples continuations of one prompt, alone or stepped together with
// other requests (DecodeRun, decode_step).
#pragma once
#include <functional>
#include <memory>
#include <optional>
#include <span>

#include <torch/torch.h>

#include <rlloop/types.hpp>

#include "model/cpu_decoder.hpp"
#include "runtime/sample_stream.hpp"
#include "model/transformer.hpp"

namespace rlloop::engine {

// Called after each new token of a sequence with all tokens generated so far; true = a stop string
// has appeared (the sequence ends with reason "stop", keeping every token generated).
using StopStringCheck = std::function<bool(std::span<const token_id> generated)>;

// Prefills the prompt once, then decodes req.num_samples sequences in lockstep with one cache.
// Per token: logits -> temperature (0 = greedy) -> top-k -> top-p -> draw with `stream`'s uniform of the sample
// and token (sample_stream.hpp).
// Returned logprobs are of the model's own distribution (temperature 1, unfiltered), i.e. what
// compute_logprobs gives for the same tokens (at fp32 precision). Stops per sequence on a stop token id (kept in the
// output), a stop string, or max_tokens ("length"). Prompt logprobs / top-k prompt logprobs on request. `precision` is
// that of the CPU decoding steps (cpu_decoder.hpp): with bf16 the logprobs are those of the rounded model, not exactly
// compute_logprobs'. The prompt's prefill (and so the first token) is always computed at the model's own precision;
// CUDA models are bf16 throughout and ignore it. `rounded`, when given, carries the bf16 weight snapshot across
// calls: reused while it is current for the model, replaced by the one this call used.
SampleResponse sample(Transformer& model, const SampleRequest& req, const StopStringCheck& stop_check,
                      SampleStream stream, DecodePrecision precision = DecodePrecision::fp32,
                      std::shared_ptr<const RoundedWeights>* rounded = nullptr);

// How a run prefills its prompt: all at once when it is made (alone, with the model's own forward), or in the
// decoding steps, a chunk at a time beside the other runs' rows (chunked prefill: decode_step's prefill_tokens).
// A request that asks for what only the whole prompt's forward gives (prompt logprobs, top-k prompt logprobs, routes)
// or for no tokens prefills at once whatever it is given.
enum class Prefill { at_start, in_steps };

// Whether a run of `req` prefills its whole prompt as it is made, whatever its Prefill (see above).
bool prefills_at_once(const SampleRequest& req);

// Tokens of prompts that one decode_step prefills at most (DecodeRun's Prefill::in_steps): a long prompt takes
// several steps instead of holding every other request's next token back for its whole length.
inline constexpr std::int64_t kPrefillChunkTokens = 512;

// One sample request in progress: the prompt prefilled (at construction, or in decode_step's chunks) and the first
// token of every sample drawn from it, then one token per sample per decode_step until every sample has stopped.
// Rows that stop leave its batch. It holds the model, the cache and the random streams of its samples only, so its
// tokens do not depend on which other runs share its steps, and its logprobs only in the last digits
// (CpuDecoder::step(groups), Transformer::decode_step). `rounded` as for sample(); the model and *rounded must
// outlive the run and not change while it decodes (a session's operations run in order).
class DecodeRun {
 public:
  DecodeRun(Transformer& model, const SampleRequest& req, StopStringCheck stop_check, SampleStream stream,
            DecodePrecision precision, std::shared_ptr<const RoundedWeights>* rounded,
            Prefill prefill = Prefill::at_start);
  DecodeRun(const DecodeRun&) = delete;
  DecodeRun& operator=(const DecodeRun&) = delete;

  bool done() const { return !prefilling() && active_.empty(); }
  // Whether part of its prompt is still to be prefilled (Prefill::in_steps): no token has been drawn yet.
  bool prefilling() const { return prompt_ids_.defined(); }
  // Rows the run decodes: its samples not yet stopped (all of them while its prompt prefills).
  std::int64_t rows() const { return prefilling() ? num_samples_ : static_cast<std::int64_t>(active_.size()); }
  // The finished response (call once done()), with each sequence's routes when the request asked for them.
  SampleResponse take();
  // The response so far: every sample's tokens and logprobs up to the last step.
  const SampleResponse& progress() const { return response_; }
  // Called after every step with the tokens each sample has so far (streaming); optional.
  std::function<void(const SampleResponse&)> on_step;

 private:
  friend void decode_step(std::span<DecodeRun* const> runs, std::int64_t prefill_tokens);
  // Draws every active row's next token from `logits` [rows, V] and retires the rows that stopped.
  void absorb(const torch::Tensor& logits);
  // The prompt is in the cache and `last` [V] are its last position's logits: every sample's first token.
  void start_decoding(const torch::Tensor& last);
  // The dispatch-free decoder of this run's model (built at the first step), or null where it does not apply.
  CpuDecoder* cpu_decoder();
  // Appends a step's routes (on the host, [rows, sparse layers, k]) to the routes of the sequences its rows fed.
  void record_routes(const torch::Tensor& routes);
  // runs[lead] and every later run not yet `stepped` that decodes over the same base weights with the same kind of
  // step (the CPU decoder's, or the ATen one: CUDA, bf16, RLLOOP_DECODER=aten), marked stepped: one step's members.
  static std::vector<std::size_t> step_members(std::span<DecodeRun* const> runs, std::size_t lead,
                                               std::vector<bool>& stepped);

  Transformer& model_;
  SamplingParams params_;
  StopStringCheck stop_check_;
  SampleStream stream_;
  DecodePrecision precision_;
  std::shared_ptr<const RoundedWeights>* rounded_;
  torch::Device device_;
  bool use_cpu_decoder_ = false;
  std::optional<CpuDecoder> decoder_;
  KVCache cache_;
  int num_samples_;
  torch::Tensor prompt_ids_;  // [P] int64 on the model's device while the prompt prefills in steps, else undefined
  std::int64_t prefilled_ = 0;  // its positions in the cache so far
  torch::Tensor next_;       // [rows]: the tokens the next step feeds
  std::vector<int> active_;  // row -> sequence index
  SampleResponse response_;
  // SampleRequest::include_routed_experts: the prompt's routes [P, sparse layers, k] on the host (undefined when
  // not asked for) and, per sequence, those of the generated tokens fed back so far (flat, in feeding order).
  torch::Tensor prompt_routes_;
  std::vector<std::vector<std::int64_t>> fed_routes_;
};

// The KV cache a sample request can take at most from its model's pool, in bytes: its prompt's full blocks once,
// and each sample's own blocks from the prompt's last, partly filled one to its max_tokens (kv_cache.hpp), at the
// dtype its run keeps the cache in. What the engine loop admits requests by (EngineLoopOptions::kv_cache_bytes).
std::int64_t kv_bytes_needed(Transformer& model, const SampleRequest& req, DecodePrecision precision);

// Advances every run by one token, and the runs whose prompts prefill in steps by a chunk of their prompt: up to
// `prefill_tokens` prompt tokens in all, oldest run first (the runs' order; one whose turn has not come sits the step
// out), a run whose prompt is done drawing its samples' first tokens. Runs over the same base weights (sessions with
// their own LoRA adapters over one base model, or one session's several requests) decode in one batched step, their
// chunks as rows beside the others': CpuDecoder::step(groups) where the CPU decoder applies
// (CpuDecoder::shares_base), Transformer::decode_step(groups) elsewhere (CUDA, bf16, RLLOOP_DECODER=aten). Every
// run must have rows left.
void decode_step(std::span<DecodeRun* const> runs, std::int64_t prefill_tokens = kPrefillChunkTokens);

// One token per row of `probs` [A, V] (rows sum to 1) by inverting the CDF at the row's entry of `uniforms`
// ([A] float64 on the CPU, in [0, 1)): the first token whose cumulative probability exceeds it. sample() uses it
// wherever the one-pass CPU kernel (token_draw.hpp) does not apply: top-k / top-p, CUDA, bf16 logits.
torch::Tensor draw_inverse_cdf(const torch::Tensor& probs, const torch::Tensor& uniforms);

// Logprob of each token given the previous ones; entry 0 is 0.0 (no context).
std::vector<double> compute_logprobs(Transformer& model, std::span<const token_id> tokens);

}  // namespace rlloop::engine
