#include "runtime/target_logprobs.hpp"

#include <algorithm>
#include <cstdint>

namespace rlloop::engine {
namespace {

// log_softmax + gather rather than gather - logsumexp: LibTorch's log_softmax kernels (forward and backward) are
// vectorised, logsumexp's backward is a generic exp over [rows, V]; on rlloop-100m's 32k vocabulary that was 0.9 s
// of a 32 s step.
torch::Tensor chunk_logprobs(Transformer& model, const torch::Tensor& hidden, const torch::Tensor& targets) {
  const auto logits = model.logits(hidden).to(torch::kFloat32);
  return torch::log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1);
}

// The chunked logprobs as an autograd function. Backward recomputes each chunk's logits with their graph and
// differentiates them at once (a backward pass inside this one, as activation checkpointing does), so that only one
// chunk's logits exist at a time. The lm_head's parameters are not inputs: that inner pass accumulates their
// gradients itself. `anchor` is a 0-element tensor that requires grad, so that the function is part of the graph
// when the lm_head trains but the hidden states do not (LoRA on the lm_head of a frozen base).
class ChunkedLogprobs : public torch::autograd::Function<ChunkedLogprobs> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor hidden, torch::Tensor targets,
                               torch::Tensor anchor, Transformer* model, std::int64_t rows) {
    (void)anchor;
    const std::int64_t n = hidden.size(0);
    torch::Tensor out = torch::empty({n}, hidden.options().dtype(torch::kFloat32));
    for (std::int64_t r0 = 0; r0 < n; r0 += rows) {
      const std::int64_t len = std::min(rows, n - r0);
      out.narrow(0, r0, len).copy_(chunk_logprobs(*model, hidden.narrow(0, r0, len), targets.narrow(0, r0, len)));
    }
    ctx->save_for_backward({hidden, targets});
    // The model outlives the graph (target_logprobs' contract); saved_data holds IValues, so its address.
    ctx->saved_data["model"] = static_cast<std::int64_t>(reinterpret_cast<std::intptr_t>(model));
    ctx->saved_data["rows"] = rows;
    return out;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor &hidden = saved[0], &targets = saved[1];
    auto* model = reinterpret_cast<Transformer*>(static_cast<std::intptr_t>(ctx->saved_data["model"].toInt()));
    const std::int64_t rows = ctx->saved_data["rows"].toInt();
    const bool hidden_needs_grad = ctx->needs_input_grad(0);
    const torch::Tensor& grad = grads[0];
    torch::Tensor grad_hidden;
    if (hidden_needs_grad) grad_hidden = torch::zeros_like(hidden);
    torch::AutoGradMode enable(true);
    const std::int64_t n = hidden.size(0);
    for (std::int64_t r0 = 0; r0 < n; r0 += rows) {
      const std::int64_t len = std::min(rows, n - r0);
      torch::Tensor h = hidden.narrow(0, r0, len).detach().requires_grad_(hidden_needs_grad);
      const torch::Tensor lp = chunk_logprobs(*model, h, targets.narrow(0, r0, len));
      if (!lp.requires_grad()) break;  // nothing trainable behind the logits
      torch::autograd::backward({lp}, {grad.narrow(0, r0, len).contiguous()});
      if (hidden_needs_grad) grad_hidden.narrow(0, r0, len).copy_(h.grad());
    }
    return {grad_hidden, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

// Whether the lm_head has trainable parameters (its weight, the tied embedding or LoRA adapters): asked of the
// model itself with a one-row product, rather than by parameter names.
bool lm_head_trains(Transformer& model, const torch::Tensor& flat_hidden) {
  return model.logits(flat_hidden.narrow(0, 0, 1).detach()).requires_grad();
}

}  // namespace

torch::Tensor target_logprobs(Transformer& model, const torch::Tensor& hidden, const torch::Tensor& targets,
                              std::int64_t chunk_values) {
  const std::int64_t B = hidden.size(0), T = hidden.size(1), H = hidden.size(2);
  const std::int64_t n = B * T, rows = logit_chunk_rows(model.config().vocab_size, chunk_values);
  const torch::Tensor flat = hidden.reshape({n, H});
  const torch::Tensor flat_targets = targets.reshape({n});
  if (n <= rows) return chunk_logprobs(model, flat, flat_targets).view({B, T});
  const bool graph = torch::GradMode::is_enabled() && !flat.requires_grad() && lm_head_trains(model, flat);
  const torch::Tensor anchor = torch::empty({0}, hidden.options()).requires_grad_(graph);
  return ChunkedLogprobs::apply(flat, flat_targets, anchor, &model, rows).view({B, T});
}

}  // namespace rlloop::engine
