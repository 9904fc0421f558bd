// One batch through the model: padding, per-token logprobs of the targets, the loss, and the backward pass.
#pragma once
#include <string>
#include <vector>

#include <rlloop/session.hpp>
#include <rlloop/tokenizer.hpp>

#include "sampler.hpp"
#include "transformer.hpp"

namespace rlloop::engine {

// forward (backward = false) or forward_backward with a built-in loss. Gradients accumulate in the model.
ForwardBackwardOutput run_builtin_loss(Transformer& model, const std::vector<Datum>& data, const LossSpec& loss,
                                       bool backward);
// forward_backward_custom: the user's function gets the logprobs and returns d loss / d logprob.
ForwardBackwardOutput run_custom_loss(Transformer& model, const std::vector<Datum>& data, const CustomLossFn& fn);

// Checks a sampling request against the model before it runs; throws invalid_argument naming the field.
void validate_sample_request(const SampleRequest& req, const ModelConfig& cfg, bool has_tokenizer);

// True once any of `stops` appears in the decoded text of the generated tokens. Only the tail that could
// hold a new occurrence is decoded per token, so the check is O(longest stop string) per step.
StopStringCheck make_stop_string_check(const Tokenizer& tokenizer, std::vector<std::string> stops);

}  // namespace rlloop::engine
