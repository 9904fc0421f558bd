// One decoding step of the whole decoder on CPU fp32 without going through ATen: few-row matrix products for
// the projections (small_gemm.hpp), plain loops for norms, RoPE and the SwiGLU gate, and a row kernel for
// attention over the KV cache (decode_attention.hpp). Decoding a small model is dominated by per-op dispatch
// (about 700 ATen ops per step for rlloop-small, most of its time), not by arithmetic; this does the same
// step in ~30 product calls and a few passes over [rows, hidden] buffers.
//
// The sampler prefills the prompt with Transformer::hidden_states (same cache layout) and uses this for the
// token-by-token steps when supports() holds; elsewhere (CUDA, bf16) it keeps calling the model.
#pragma once
#include <torch/torch.h>

#include "transformer.hpp"

namespace rlloop::engine {

class CpuDecoder {
 public:
  // CPU and fp32 weights (adapters included); the cache must be fp32 too.
  static bool supports(Transformer& model);

  // Holds views of the model's weights (LoRA adapters applied unmerged, so no copy is made); the model must
  // outlive the decoder.
  explicit CpuDecoder(Transformer& model);

  // Feeds tokens[i] to row i of the cache at position cache.length, appends its keys and values and advances
  // cache.length. tokens: [rows] int64 on the CPU, rows == cache.batch(). Returns the logits [rows, vocab].
  torch::Tensor step(const torch::Tensor& tokens, KVCache& cache);

 private:
  // Rows [r0, r1) of one step at position cache.length: writes their keys/values and logits rows.
  void decode_rows(const std::int64_t* ids, std::int64_t r0, std::int64_t r1, KVCache& cache, float* logits) const;

  const ModelConfig& cfg_;
  InferenceWeights w_;
  bool weights_fit_in_cache_ = false;  // <= 16 MiB: threads split the rows of a step, otherwise each operation
};

}  // namespace rlloop::engine
