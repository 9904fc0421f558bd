// Tensor parallelism for decoding (Megatron-LM's layout, as vLLM and SGLang decode): each rank of a group holds a
// slice of every layer, so a model too large for one device samples over several. Transformer::tensor_parallel
// builds a rank's model from a whole or fully sharded one; the one layer definition (decoder_layer.hpp) runs on
// it unchanged, with the model's config cut to the rank's heads and widths:
//   - column-parallel: q, k, v, gate, up (each expert's too) keep rows [r n/W, (r + 1) n/W) of their outputs (and
//     biases), so each rank attends over its own heads (its KV cache holds those heads only) and activates its own
//     part of the MLP's width; the attention sinks are cut by head;
//   - row-parallel: o and down keep the matching columns of their inputs, and their outputs (and the experts') are
//     this rank's part of a sum: one all-reduce each per layer, their biases added by rank 0 alone;
//   - the vocabulary: the embedding and the unembedding keep rows [r V/W, (r + 1) V/W): an id's embedding comes from
//     the rank holding it (one all-reduce), and the logits are gathered whole on every rank, so every rank draws the
//     same tokens from the same streams;
//   - norms, the router and q/k norms are whole on every rank.
// LoRA adapters follow their linear: a column-parallel linear's B is cut by rows, a row-parallel one's A by
// columns (the sum over the ranks of x_r A_r^T is x A^T).
#pragma once
#include <cstdint>

#include <torch/types.h>

namespace rlloop::engine {

namespace dist {
class Group;
}

class TensorParallel {
 public:
  TensorParallel(dist::Group& group, std::int64_t vocab_size);

  int rank() const;
  int size() const;
  // The sum over the ranks of every rank's `part` (a row-parallel output): a new tensor (c10d writes it outside
  // the caller's InferenceMode). bf16 and fp16 are summed in fp32 on the CPU (Gloo has neither).
  torch::Tensor sum(const torch::Tensor& part) const;
  // The embeddings of `ids` (whole-vocabulary ids) from this rank's rows `embed` [V / W, H]: the owner's row, summed.
  torch::Tensor embed(const torch::Tensor& embed, const torch::Tensor& ids) const;
  // Logits over the whole vocabulary, [..., V], from every rank's columns `part` [..., V / W] (one all-gather).
  torch::Tensor gather_vocabulary(const torch::Tensor& part) const;
  // The vocabulary rows this rank holds: [first, first + rows).
  std::int64_t vocab_first() const { return vocab_rows_ * rank(); }
  std::int64_t vocab_rows() const { return vocab_rows_; }

 private:
  dist::Group* group_;
  std::int64_t vocab_rows_;
};

// This rank's slice of `whole` for a tensor of the rank's model of shape `local` (built from the cut config): rows
// [r n, (r + 1) n) where dim 0 is cut, columns where dim 1 is, the tensor whole where neither. `rank_zero_only`: a
// row-parallel linear's bias, whole on rank 0 and zero elsewhere (added once to the sum).
torch::Tensor tensor_parallel_slice(const torch::Tensor& whole, at::IntArrayRef local, int rank, bool rank_zero_only);

}  // namespace rlloop::engine
