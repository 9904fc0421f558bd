#include "experts.hpp"

#include "fused_ops.hpp"

namespace rlloop::engine {

Routes route_top_k(const torch::Tensor& logits, std::int64_t k, bool normalize, torch::ScalarType dtype) {
  const torch::Tensor probabilities = torch::softmax(logits, -1, torch::kFloat32);
  auto [weights, experts] = torch::topk(probabilities, k, -1);
  if (normalize) weights = weights / weights.sum(-1, /*keepdim=*/true);
  return {experts, weights.to(dtype)};
}

torch::Tensor run_experts(const torch::Tensor& x, const Routes& routes, const std::vector<Expert>& experts) {
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
    outputs.push_back(expert.down.apply(swiglu(expert.gate.apply(in), expert.up.apply(in))));
  }
  const torch::Tensor weights = routes.weights.reshape({N * k}).index_select(0, order).unsqueeze(1);
  // Added token by token in expert order: a token's outputs sum as transformers' per-expert index_add_ sums them.
  return torch::zeros_like(x).index_add(0, token, torch::cat(outputs) * weights);
}

}  // namespace rlloop::engine
