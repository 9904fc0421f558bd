// Batched, KV-cached sampling of num_samples continuations of one prompt.
#pragma once
#include <functional>
#include <span>

#include <torch/torch.h>

#include <rlloop/types.hpp>

#include "cpu_decoder.hpp"
#include "transformer.hpp"

namespace rlloop::engine {

// Called after each new token of a sequence with all tokens generated so far; true = a stop string
// has appeared (the sequence ends with reason "stop", keeping every token generated).
using StopStringCheck = std::function<bool(std::span<const token_id> generated)>;

// Prefills the prompt once, then decodes req.num_samples sequences in lockstep with one cache.
// Per token: logits -> temperature (0 = greedy) -> top-k -> top-p -> draw with `generator`.
// Returned logprobs are of the model's own distribution (temperature 1, unfiltered), i.e. what
// compute_logprobs gives for the same tokens (at fp32 precision). Stops per sequence on a stop token id (kept in the
// output), a stop string, or max_tokens ("length"). Prompt logprobs / top-k prompt logprobs on request. `precision` is
// that of the CPU decoding steps (cpu_decoder.hpp): with bf16 the logprobs are those of the rounded model, not exactly
// compute_logprobs'. The prompt's prefill (and so the first token) is always computed at the model's own precision;
// CUDA models are bf16 throughout and ignore it. `rounded`, when given, carries the bf16 weight snapshot across
// calls: reused while it is current for the model, replaced by the one this call used.
SampleResponse sample(Transformer& model, const SampleRequest& req, const StopStringCheck& stop_check,
                      at::Generator& generator, DecodePrecision precision = DecodePrecision::fp32,
                      std::shared_ptr<const RoundedWeights>* rounded = nullptr);

// One token per row of `probs` [A, V] (rows sum to 1) by inverting the CDF with a uniform from `generator`.
// sample() uses it when the generator lives on another device than the model (a CPU generator with a CUDA
// model), where torch::multinomial would refuse the generator.
torch::Tensor draw_inverse_cdf(const torch::Tensor& probs, at::Generator& generator);

// Logprob of each token given the previous ones; entry 0 is 0.0 (no context).
std::vector<double> compute_logprobs(Transformer& model, std::span<const token_id> tokens);

}  // namespace rlloop::engine
