// The CPU backend of the decoding step: the model's one layer definition (decoder_layer.hpp) run over the rows of
// a step in host buffers, with few-row matrix products for the projections (small_gemm.hpp), fused loops for
// norms, RoPE and the SwiGLU gate, and a row kernel for attention over the paged KV cache (decode_attention.hpp).
// Decoding a small model through ATen is dominated by per-op dispatch (about 700 operators per step for
// rlloop-small, most of its time), not by arithmetic; this does the same step in ~30 product calls and a few
// passes over [rows, hidden] buffers.
//
// The sampler takes this backend for the decoding steps (and the prompts' chunks they prefill, DecodeRun's
// Prefill::in_steps; a prompt prefilled at once goes through Transformer::hidden_states, into the same cache layout)
// where the model says its kernels implement every layer (supports(): CPU, fp32, dense layers with plain causal
// attention); elsewhere (CUDA, bf16 models, experts, sinks, windows) Transformer::decode_step runs the same layer over
// ATen tensors.
#pragma once
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "kernels/bf16_gemm.hpp"
#include "model/transformer.hpp"

namespace rlloop::engine {

// Arithmetic of the decoding steps. fp32: the same numbers as Transformer::forward (within summation order
// and a few ulp of SwiGLU's exp), so sampled logprobs equal compute_logprobs. bf16: base weights and inputs of the
// matrix products rounded to bf16, fp32 sums (bf16_gemm.hpp), and the KV cache stored as bf16 (half the bytes for
// attention to read); faster on CPUs with AVX512_BF16, logprobs off by the rounding (~1e-2). int8: bf16, except that
// the matrices a quantized base keeps in Q4_0 / Q4_1 / Q8_0 blocks multiply inputs rounded to 8 bits per block in
// integer dot products (QuantizedMatrix::multiply_group_int8), as llama.cpp does; logprobs off by ~0.05.
enum class DecodePrecision { fp32, bf16, int8 };

// bf16 snapshots of a model's base projection weights, the matrices of the bf16 precision. Rounding takes
// ~1.5% of a 16 x 128 rlloop-100m sampling call and far more of a short one, so a session keeps a snapshot
// across calls while current() holds: every weight still has the storage and the version it was rounded from
// (LibTorch bumps a tensor's version on each in-place update: an optimizer step, a load). The snapshot holds
// those storages, so another model cannot reuse their addresses while it lives. Adapters and biases are not
// part of it: the decoder reads them live.
class RoundedWeights {
 public:
  explicit RoundedWeights(Transformer& model);
  bool current(Transformer& model) const;

  struct Layer {
    Bf16Weight q, k, v, o, gate, up, down;

    const Bf16Weight& projection(Projection p) const { return projection_member(*this, p); }
  };
  const std::vector<Layer>& layers() const { return layers_; }
  const Bf16Weight& lm_head() const { return lm_head_; }

 private:
  std::vector<Layer> layers_;
  Bf16Weight lm_head_;
  struct Source {
    torch::Tensor tensor;  // a view of the weight rounded (shares its storage and version counter)
    std::int64_t version;  // its version when rounded
  };
  std::vector<Source> sources_;
};

class CpuDecoder {
 public:
  // Whether this backend implements every layer of the model as it is (Transformer::cpu_kernels_decode).
  static bool supports(Transformer& model);
  // What the KV cache passed to step() holds: fp32, or bf16 for the bf16 precision (a cache of that dtype from the
  // start, whose prefill stores rounded keys and values; KVCache::convert moves another).
  static torch::ScalarType cache_dtype(DecodePrecision precision);

  // Holds views of the model's weights (LoRA adapters applied unmerged, so no copy is made); the model must
  // outlive the decoder, and a decoder must not outlive a change of the weights (sample() builds one per call,
  // which the session's work queue never interleaves with a training step). With bf16 it uses `rounded` when
  // that is current for the model, and otherwise drops it and rounds the weights afresh.
  explicit CpuDecoder(Transformer& model, DecodePrecision precision = DecodePrecision::fp32,
                      std::shared_ptr<const RoundedWeights> rounded = nullptr);

  // Feeds tokens[i] to row i of the cache at position cache.length, appends its keys and values and advances
  // cache.length. tokens: [rows] int64 on the CPU, rows == cache.batch() (or, with a cache of batch 1, a chunk of its
  // sequence, as for a Group). Returns the logits [rows, vocab] (a chunk's: [1, vocab], its last row's).
  torch::Tensor step(const torch::Tensor& tokens, KVCache& cache);

  // One step of several batches at once, each with its own cache (so its own positions) and its own LoRA
  // adapters over this decoder's base weights (shares_base): the requests of different sessions on one base
  // model decode together. A group is one token per sequence of its cache or a chunk of a prompt, as a
  // DecodeGroup (Transformer::decode_step). The base products run over the rows of every group in one pass;
  // adapters per group, RoPE and attention per row at its own position. Each row's numbers are those of stepping
  // its group alone up to the last digits: the few-row product kernels compute every output row from its own input
  // (small_gemm.hpp, up to its row limit), but reduce a row of a 4-row tile in another order than a tail row.
  // Returns the logits of the rows the groups ask for (Group::logits: every row's, or a chunk's last), [those rows,
  // vocab] in the groups' order.
  struct Group {
    const InferenceWeights* adapters;  // the group's model: only its LoRA adapters are read
    const torch::Tensor* tokens;       // [rows] int64 on the CPU
    KVCache* cache;                    // rows == cache->batch(), or batch 1 for a chunk
    bool logits = true;
  };
  torch::Tensor step(std::span<const Group> groups);

  // True when `other` decodes over the same base weights (the same tensors) at the same precision, so their
  // groups can share a step.
  bool shares_base(const CpuDecoder& other) const;
  // The weights the decoder reads (its model's adapters included): a Group's `adapters`.
  const InferenceWeights& weights() const { return w_; }

  // The bf16 snapshot in use (null for fp32), for the next call to reuse.
  const std::shared_ptr<const RoundedWeights>& rounded() const { return rounded_; }

 private:
  // Where one row of a step comes from: its group, its token and position (its cache row is its place among the
  // group's rows, its slot and block table the step's, DecodeSlots), and its row of the step's logits (-1: none).
  struct Row {
    std::size_t group;
    std::int64_t id;
    std::int64_t pos;
    std::int64_t logits;
  };
  // Rows [r0, r1) of one step through decoder_layer: writes their keys/values into their caches and their rows of
  // `logits`.
  void decode_rows(std::span<const Row> rows, std::span<const Group> groups, const DecodeSlots& step, std::int64_t r0,
                   std::int64_t r1, float* logits) const;

  const Transformer& model_;
  const ModelConfig& cfg_;
  DecodePrecision precision_;
  InferenceWeights w_;
  std::shared_ptr<const RoundedWeights> rounded_;  // bf16 precision only
  bool weights_fit_in_cache_ = false;  // <= 16 MiB: threads split the rows of a step, otherwise each operation
};

}  // namespace rlloop::engine
