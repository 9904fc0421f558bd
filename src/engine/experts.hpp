// The sparse MLP of a mixture-of-experts layer (families with `experts`, model_family.hpp): a router scores every
// expert for each token, the token goes through the top k, and their outputs are summed with the router's weights.
// The experts run as grouped products: the routed rows sorted by expert, one product per expert over its own rows
// (never a loop over tokens), in ATen operators, so the one definition trains, prefills and decodes on any device.
#pragma once
#include <cstdint>
#include <vector>

#include <torch/torch.h>

#include "linear.hpp"

namespace rlloop::engine {

// One expert: a SwiGLU MLP, down(silu(gate x) * up x).
struct Expert {
  Linear gate, up, down;
};

// Where each of N tokens goes: its k experts and the weight of each one's output.
struct Routes {
  torch::Tensor experts;  // [N, k] int64
  torch::Tensor weights;  // [N, k], in the hidden states' dtype
};

// Qwen-MoE's routing of router logits [N, E]: softmax in fp32, the k most probable experts, their probabilities
// renormalised to sum to one when `normalize` (norm_topk_prob), cast to `dtype`, as transformers computes it.
Routes route_top_k(const torch::Tensor& logits, std::int64_t k, bool normalize, torch::ScalarType dtype);

// For each row of x [N, H]: the sum over its routes of weight * expert(row), in expert order (as transformers
// accumulates it). One host read per call: how many rows each expert got.
torch::Tensor run_experts(const torch::Tensor& x, const Routes& routes, const std::vector<Expert>& experts);

}  // namespace rlloop::engine
