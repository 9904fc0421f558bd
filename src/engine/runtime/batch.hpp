// One batch through the model: padding, per-token logprobs of the targets, the loss, and the backward pass.
#pragma once
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <rlloop/session.hpp>
#include <rlloop/tokenizer.hpp>

#include "runtime/loss.hpp"
#include "runtime/sampler.hpp"
#include "model/transformer.hpp"

namespace rlloop::engine {

// Everything run_builtin_loss / the custom loss check about a batch before it runs (the loss settings, the
// inputs each datum needs, token ids, lengths); throws invalid_argument naming the datum and field.
void validate_builtin_batch(const ModelConfig& cfg, const std::vector<Datum>& data, const LossSpec& loss);
void validate_custom_input(const ModelConfig& cfg, const std::vector<Datum>& data);
// What a built-in loss needs of the model beyond the batch: a value head for the value loss (invalid_argument
// naming it). run_builtin_loss checks it; a data-parallel group also before it sends the batch out, so that no
// rank starts a pass another refuses.
void check_loss_fits_model(const Transformer& model, const LossSpec& loss);

// forward (backward = false) or forward_backward with a built-in loss. Gradients accumulate in the model.
// `counts`, if given, receives the clip counts behind clip_fraction (so shards of a batch can be combined).
ForwardBackwardOutput run_builtin_loss(Transformer& model, const std::vector<Datum>& data, const LossSpec& loss,
                                       bool backward, ClipCounts* counts = nullptr);

// forward_backward_custom: the user's function gets the logprobs and returns d loss / d logprob.
ForwardBackwardOutput run_custom_loss(Transformer& model, const std::vector<Datum>& data, const CustomLossFn& fn);

// run_custom_loss in its two halves, for when the loss function runs elsewhere (data parallelism: on rank 0,
// over every rank's logprobs): the forward pass keeps its graph until custom_loss_backward.
struct CustomLossPass {
  struct Graph;
  std::unique_ptr<Graph> graph;
  ForwardBackwardOutput output;               // the logprobs per datum, training_tokens
  std::vector<std::vector<double>> logprobs;  // the same logprobs, as the loss function takes them
  CustomLossPass();
  CustomLossPass(CustomLossPass&&) noexcept;
  CustomLossPass& operator=(CustomLossPass&&) noexcept;
  ~CustomLossPass();
};
CustomLossPass custom_loss_forward(Transformer& model, const std::vector<Datum>& data);
// The loss function's gradients must match the logprobs datum for datum and be finite.
void check_custom_gradients(const CustomLossResult& result, const std::vector<std::vector<double>>& logprobs);
void custom_loss_backward(CustomLossPass& pass, std::span<const std::vector<double>> grad_logprobs);

// Checks a sampling request against the model before it runs; throws invalid_argument naming the field.
void validate_sample_request(const SampleRequest& req, const ModelConfig& cfg, bool has_tokenizer);

// True once any of `stops` appears in the decoded text of the generated tokens. Only the tail that could
// hold a new occurrence is decoded per token, so the check is O(longest stop string) per step.
StopStringCheck make_stop_string_check(const Tokenizer& tokenizer, std::vector<std::string> stops);

}  // namespace rlloop::engine
