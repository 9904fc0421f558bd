// A prompt's greedy decoding over a KV cache, step by step, for tests that hold a parallel model's decoding to a
// whole model's: the logits of the prefill's last position and of each decode_step, and how far ranks' are from them.
#pragma once
#include <algorithm>
#include <limits>
#include <vector>

#include <torch/torch.h>

#include "model/kv_cache.hpp"
#include "model/transformer.hpp"

namespace test_util {

// prompt [B, T]: the prefill (hidden_states over the cache), then `steps` decode_steps feeding each row its argmax.
// Each forward within a ShardedPass (nothing on a model that is not sharded). Each step's logits, [B, V].
inline std::vector<torch::Tensor> greedy_decode_logits(rlloop::engine::Transformer& model, const torch::Tensor& prompt,
                                                       int steps) {
  using namespace rlloop::engine;
  torch::NoGradGuard no_grad;
  const auto dtype = model.parameters().front().scalar_type();
  KVCache cache(model.kv_pools(), dtype, prompt.size(0), prompt.size(1) + steps + 1);
  std::vector<torch::Tensor> out;
  torch::Tensor next;
  {
    ShardedPass gathered(model);
    out.push_back(model.logits(model.hidden_states(prompt, &cache)).select(1, -1));
    next = out.back().argmax(-1);
  }
  for (int step = 0; step < steps; ++step) {
    ShardedPass gathered(model);
    const DecodeGroup group{&model, &next, &cache};
    out.push_back(model.decode_step({&group, 1}));
    next = out.back().argmax(-1);
  }
  return out;
}

// The largest difference between any rank's step logits (`ranks`) and the whole model's (`one`), over every step;
// infinity when a rank decoded another number of steps.
inline double max_logit_difference(const std::vector<std::vector<torch::Tensor>>& ranks,
                                   const std::vector<torch::Tensor>& one) {
  double worst = 0;
  for (const auto& steps : ranks) {
    if (steps.size() != one.size()) return std::numeric_limits<double>::infinity();
    for (std::size_t s = 0; s < one.size(); ++s)
      worst = std::max(worst, (steps[s] - one[s]).abs().max().item<double>());
  }
  return worst;
}

}  // namespace test_util
