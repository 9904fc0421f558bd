// AdamW with decoupled weight decay, global grad-norm clipping and the LoRA+ learning-rate ratio for B
// matrices. Written out (not torch::optim) so its state saves by parameter name and the per-parameter
// learning rate can change every step.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <rlloop/types.hpp>

namespace rlloop::engine {

struct NamedParameter {
  std::string name;
  torch::Tensor tensor;
  bool lora_b = false;  // gets learning_rate * lora_plus_lr_ratio
};

// Throws invalid_argument naming the first field out of range (AdamW::step checks the same).
void validate(const AdamParams& p);

class AdamW {
 public:
  explicit AdamW(std::vector<NamedParameter> params);

  // One step on the accumulated .grad() of every parameter, then zeroes them. Returns "grad_norm" (before
  // clipping), "lr" and "step".
  Metrics step(const AdamParams& p);
  // The L2 norm of the gradients accumulated so far, over every parameter (0 when none has one).
  double grad_norm() const;
  void zero_grad();

  std::int64_t step_count() const { return step_; }
  // Moments as "<name>.exp_avg" / "<name>.exp_avg_sq" (CPU tensors), for checkpoints.
  std::vector<std::pair<std::string, torch::Tensor>> state_tensors() const;
  void load_state_tensors(const std::map<std::string, torch::Tensor>& tensors, std::int64_t step);
  void set_step(std::int64_t step) { step_ = step; }
  // The moment tensors themselves (every exp_avg, then every exp_avg_sq), for copying state in place.
  std::vector<torch::Tensor> moments() const;
  const std::vector<NamedParameter>& parameters() const { return params_; }

 private:
  std::vector<NamedParameter> params_;
  std::vector<torch::Tensor> exp_avg_;
  std::vector<torch::Tensor> exp_avg_sq_;
  std::int64_t step_ = 0;
};

}  // namespace rlloop::engine
