// RoPE's cos / sin for every position of a model's context, computed once per device and dtype instead of on every
// forward: the rows HF computes for those positions (inv_freq and angles in fp32, then cast), YaRN's scaled
// frequencies where the config has them.
#pragma once
#include <mutex>
#include <utility>

#include <torch/torch.h>

#include "model/model_config.hpp"

namespace rlloop::engine {

class RopeTables {
 public:
  // [max_position_embeddings, head_dim] each, on `device` in `dtype` (recomputed when either changes).
  std::pair<torch::Tensor, torch::Tensor> get(const ModelConfig& cfg, torch::Device device, torch::ScalarType dtype);

 private:
  std::mutex mutex_;
  std::pair<torch::Tensor, torch::Tensor> tables_;
};

}  // namespace rlloop::engine
