// The logprob of each target token, the quantity every loss is a function of, without keeping the logits.
//
// The logits of a batch are [tokens, vocabulary]: 16k tokens over Qwen3's 151,936-token vocabulary are 10 GB per
// fp32 copy, and log_softmax with its backward keeps three or four. Here they exist one chunk of rows at a time:
// forward computes each chunk's log-softmax at the targets and drops the chunk; backward computes each chunk's
// logits again from the saved hidden states (one more lm_head product per chunk) and runs their backward at once,
// which gives the hidden states' gradient and accumulates the lm_head's (its weight, or its LoRA adapters). Peak
// memory then grows with tokens x hidden size, not tokens x vocabulary. A batch whose logits fit in one chunk
// runs the plain graph (no second product).
#pragma once
#include <cstdint>

#include <torch/torch.h>

#include "model/transformer.hpp"

namespace rlloop::engine {

// Values of logits a chunk may hold: 16M (64 MB in fp32; about 110 rows of a 151,936-token vocabulary).
inline constexpr std::int64_t kLogitChunkValues = std::int64_t{1} << 24;

// Rows of logits per chunk over a vocabulary of `vocab` entries (at least one).
inline std::int64_t logit_chunk_rows(std::int64_t vocab, std::int64_t chunk_values = kLogitChunkValues) {
  return chunk_values / vocab > 1 ? chunk_values / vocab : 1;
}

// hidden: the model's final hidden states [B, T, H] (Transformer::hidden_states); targets: int64 [B, T] token ids
// inside the vocabulary. Returns log softmax(logits)[target] as fp32 [B, T], differentiable with respect to
// hidden and the lm_head's trainable parameters when grad mode is on. The model must outlive the graph.
torch::Tensor target_logprobs(Transformer& model, const torch::Tensor& hidden, const torch::Tensor& targets,
                              std::int64_t chunk_values = kLogitChunkValues);

}  // namespace rlloop::engine
