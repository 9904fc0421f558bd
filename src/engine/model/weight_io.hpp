// A model's weights in and out of their file formats' names: Hugging Face's state dict (the base weights, and the
// base with the adapters folded in) and PEFT's (the adapters).
// In model/, not io/: Transformer's own hf_state_dict / peft_state_dict members (what io/, runtime/, dist/ and
// session/ call) are these, and model/ may not include io/ (tests/engine/check_layers.py). io/ holds the files
// (safetensors, GGUF, checkpoints) that carry these dicts.
#pragma once
#include <map>
#include <string>

#include <torch/torch.h>

#include "model/model_weights.hpp"

namespace rlloop::engine {

using TensorMap = std::map<std::string, torch::Tensor>;

class WeightIO {
 public:
  explicit WeightIO(ModelWeights& weights) : w_(weights) {}

  // The dense and quantized (dequantized to fp32) base weights under their HF names.
  TensorMap hf_state_dict() const;
  // Checks every name and shape, then copies in place (the dense weights only).
  void load_hf_state_dict(const TensorMap& tensors);
  // The adapters under PEFT's names (conflict without adapters).
  TensorMap peft_state_dict() const;
  void load_peft_state_dict(const TensorMap& tensors);
  // hf_state_dict with W + (alpha / rank) * B A folded into every adapted weight (the experts' too).
  TensorMap merged_hf_state_dict() const;

 private:
  // The merged weights of sparse layer `l`'s experts, into `out`.
  void merge_experts(const Layer& l, TensorMap& out) const;

  ModelWeights& w_;
};

}  // namespace rlloop::engine
