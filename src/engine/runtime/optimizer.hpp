// AdamW with decoupled weight decay, global grad-norm clipping and the LoRA+ learning-rate ratio for B
// matrices. Written out (not torch::optim) so its state saves by parameter name and the per-parameter
// learning rate can change every step.
//
// Mixed precision: a parameter stored in bf16 or fp16 (full fine-tuning of a bf16 model) is the compute copy of an
// fp32 master weight the optimizer keeps. Its gradients are moved after each backward pass into an fp32
// accumulator (absorb_gradients), the step updates the master in fp32 and writes its rounding back into the
// parameter. Without this an update smaller than half a bf16 step of the weight (lr 1e-5 at |w| ~ 0.02, where
// the step is ~1.2e-4) rounds away, the weight-decay factor rounds to 1, and gradients summed over many
// micro-batches lose their low bits. Moments are fp32 for every parameter.
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

  // One step on the accumulated gradient of every parameter, then zeroes them. Returns "grad_norm" (before
  // clipping), "lr" and "step".
  Metrics step(const AdamParams& p);
  // The same with the gradients' norm given: expert parallelism's, over the experts of every rank.
  Metrics step(const AdamParams& p, double grad_norm);
  // The L2 norm of the gradients accumulated so far, over every parameter (0 when none has one).
  double grad_norm();
  void zero_grad();
  // zero_grad for parameter i alone.
  void clear_gradient(std::size_t i);
  // Moves the .grad() of bf16/fp16 parameters into their fp32 accumulators (and clears it): call after every
  // backward pass, so that the next one does not add to a bf16 sum. Readers of gradients below call it too.
  void absorb_gradients();
  // Parameter i's accumulated gradient (fp32 for a bf16/fp16 parameter, else its .grad()), undefined when none.
  torch::Tensor gradient(std::size_t i);
  // Replaces parameter i's accumulated gradient by g (any dtype and device; converted).
  void set_gradient(std::size_t i, const torch::Tensor& g);

  std::int64_t step_count() const { return step_; }
  // Moments as "<name>.exp_avg" / "<name>.exp_avg_sq" and master weights as "<name>.master" (CPU tensors), for
  // checkpoints. Loading sets the parameters to their masters' rounding; a state without a master (saved before
  // masters existed) takes the parameter's value.
  std::vector<std::pair<std::string, torch::Tensor>> state_tensors() const;
  // The parameter a state_tensors() entry belongs to ("<name>.exp_avg" -> "<name>"); invalid_argument for a name
  // that is none of them.
  static std::string parameter_of_state(const std::string& entry);
  void load_state_tensors(const std::map<std::string, torch::Tensor>& tensors, std::int64_t step);
  void set_step(std::int64_t step) { step_ = step; }
  // The state tensors themselves (every exp_avg, every exp_avg_sq, every master), for copying state in place;
  // after writing them, sync_parameters() rounds the masters into the parameters.
  std::vector<torch::Tensor> state() const;
  void sync_parameters();
  // Parameter i's fp32 master weight, undefined for an fp32 parameter (its own master).
  const torch::Tensor& master(std::size_t i) const { return master_[i]; }
  const std::vector<NamedParameter>& parameters() const { return params_; }

 private:
  void absorb(std::size_t i);  // absorb_gradients for parameter i

  std::vector<NamedParameter> params_;
  std::vector<torch::Tensor> exp_avg_;
  std::vector<torch::Tensor> exp_avg_sq_;
  std::vector<torch::Tensor> master_;  // fp32, for bf16/fp16 parameters only
  std::vector<torch::Tensor> grad32_;  // their fp32 gradient accumulators, undefined when empty
  std::int64_t step_ = 0;
};

}  // namespace rlloop::engine
