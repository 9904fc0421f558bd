#include "experts.hpp"

#include "fused_ops.hpp"

namespace rlloop::engine {

namespace {

// (x A^T) B^T * scale in x's dtype (the adapters may be kept wider than the base, as PEFT keeps them fp32).
torch::Tensor low_rank(const torch::Tensor& x, const std::pair<torch::Tensor, torch::Tensor>& ab, double scale) {
  const auto& [a, b] = ab;
  const torch::Tensor xa = x.scalar_type() == a.scalar_type() ? x : x.to(a.scalar_type());
  const torch::Tensor delta = torch::linear(torch::linear(xa, a), b) * scale;
  return delta.scalar_type() == x.scalar_type() ? delta : delta.to(x.scalar_type());
}

}  // namespace

std::pair<torch::Tensor, torch::Tensor> ExpertAdapters::factors(const torch::Tensor& a, const torch::Tensor& b,
                                                                std::int64_t e, std::int64_t E) {
  const std::int64_t r = a.size(0) / E;
  return {a.narrow(0, e * r, r), b.view({b.size(0), r, E}).select(2, e)};
}

Routes route_top_k(const torch::Tensor& logits, std::int64_t k, bool normalize, torch::ScalarType dtype) {
  const torch::Tensor probabilities = torch::softmax(logits, -1, torch::kFloat32);
  auto [weights, experts] = torch::topk(probabilities, k, -1);
  if (normalize) weights = weights / weights.sum(-1, /*keepdim=*/true);
  return {experts, weights.to(dtype)};
}

torch::Tensor run_experts(const torch::Tensor& x, const Routes& routes, const std::vector<Expert>& experts,
                          const ExpertAdapters* adapters) {
  const std::int64_t N = x.size(0), k = routes.experts.size(1);
  const auto E = static_cast<std::int64_t>(experts.size());
  // The N * k routes sorted by expert (stable: an expert's rows keep token order), each route's token, and how
  // many routes each expert has: the sizes of the grouped products, the one value the host must know.
  const torch::Tensor flat = routes.experts.reshape({N * k});
  const torch::Tensor order = std::get<1>(torch::sort(flat, /*stable=*/true, /*dim=*/0, /*descending=*/false));
  const torch::Tensor token = torch::div(order, k, "floor");
  const torch::Tensor counts = torch::bincount(flat, {}, E).cpu();
  const torch::Tensor rows = x.index_select(0, token);  // [N * k, H], expert by expert

  std::vector<torch::Tensor> outputs;
  const std::int64_t* count = counts.data_ptr<std::int64_t>();
  for (std::int64_t e = 0, start = 0; e < E; start += count[e], ++e) {
    if (count[e] == 0) continue;
    const Expert& expert = experts[static_cast<std::size_t>(e)];
    const torch::Tensor in = rows.narrow(0, start, count[e]);
    torch::Tensor gate = expert.gate.apply(in), up = expert.up.apply(in);
    if (adapters && adapters->gate_up_a.defined()) {
      const torch::Tensor delta =
          low_rank(in, ExpertAdapters::factors(adapters->gate_up_a, adapters->gate_up_b, e, E), adapters->scale);
      const std::int64_t I = gate.size(1);
      gate = gate + delta.narrow(1, 0, I);
      up = up + delta.narrow(1, I, I);
    }
    const torch::Tensor hidden = swiglu(gate, up);
    torch::Tensor out = expert.down.apply(hidden);
    if (adapters && adapters->down_a.defined())
      out = out + low_rank(hidden, ExpertAdapters::factors(adapters->down_a, adapters->down_b, e, E), adapters->scale);
    outputs.push_back(out);
  }
  const torch::Tensor weights = routes.weights.reshape({N * k}).index_select(0, order).unsqueeze(1);
  // Added token by token in expert order: a token's outputs sum as transformers' per-expert index_add_ sums them.
  return torch::zeros_like(x).index_add(0, token, torch::cat(outputs) * weights);
}

}  // namespace rlloop::engine
