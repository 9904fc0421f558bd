#include "model/experts.hpp"

#include <cstring>

#include "kernels/device.hpp"
#include "kernels/few_rows_linear.hpp"
#include "kernels/fused_ops.hpp"
#include "kernels/small_gemm.hpp"

namespace rlloop::engine {

namespace {

// Expert e's share of a stacked adapter applied to x: scale * (x A_e^T) B_e^T in x's dtype.
torch::Tensor expert_delta(const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& b, std::int64_t e,
                           std::int64_t E, double scale) {
  const auto [a_e, b_e] = ExpertAdapters::factors(a, b, e, E);
  return low_rank_product(x, a_e, b_e, x.scalar_type()) * scale;
}

// gpt-oss's activation (ExpertActivation), as transformers' GptOssExperts._apply_gate computes it.
torch::Tensor clamped_swiglu(const torch::Tensor& gate, const torch::Tensor& up, const ExpertActivation& a) {
  const torch::Tensor g = gate.clamp_max(a.limit);
  return (up.clamp(-a.limit, a.limit) + 1) * (g * torch::sigmoid(g * a.alpha));
}

// Whether a decoding step's experts take the CPU kernels below: fp32 on the CPU, no graph, at most kFewRows tokens,
// dense contiguous expert weights.
bool step_kernels_apply(const torch::Tensor& x, const std::vector<Expert>& experts) {
  if (torch::GradMode::is_enabled() || !x.device().is_cpu() || x.scalar_type() != torch::kFloat32 ||
      x.size(0) > kFewRows)
    return false;
  for (const Expert& e : experts)
    for (const Linear* l : {&e.gate, &e.up, &e.down})
      if (!l->weight.defined() || l->bias.defined() || l->weight.scalar_type() != torch::kFloat32 ||
          !l->weight.is_contiguous() || !l->weight.device().is_cpu())
        return false;
  return true;
}

// run_experts for a decoding step on the CPU: the routes grouped by expert on the host, every routed row's gate and
// up products in one parallel region and its down products in another (few-row kernels reading the weights in place,
// small_gemm.hpp), then each token's outputs added in expert order. Per expert, the ATen path would pay a parallel
// region per product and a dozen operators; one step of an 8-expert top-2 model spent 1.5x a dense one's time there.
torch::Tensor step_experts(const torch::Tensor& x_in, const Routes& routes, const std::vector<Expert>& experts) {
  const torch::Tensor x = x_in.contiguous();
  const torch::Tensor ids = routes.experts.contiguous(), weights = routes.weights.to(torch::kFloat32).contiguous();
  const std::int64_t N = x.size(0), H = x.size(1), k = ids.size(1), R = N * k;
  const auto E = static_cast<std::int64_t>(experts.size());
  const std::int64_t I = experts.front().gate.weight.size(0);
  const std::int64_t* expert_of = ids.data_ptr<std::int64_t>();  // route r = token * k + j
  // Routes sorted by expert, stably (a counting sort): expert e's are order[start[e] .. start[e + 1]).
  std::vector<std::int64_t> start(E + 1, 0), order(R);
  for (std::int64_t r = 0; r < R; ++r) ++start[expert_of[r] + 1];
  for (std::int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  std::vector<std::int64_t> next(start.begin(), start.end() - 1);
  for (std::int64_t r = 0; r < R; ++r) order[next[expert_of[r]]++] = r;

  const auto f32 = x.options();
  torch::Tensor rows = torch::empty({R, H}, f32), gate = torch::empty({R, I}, f32), up = torch::empty({R, I}, f32),
                outs = torch::empty({R, H}, f32);
  float *row = rows.data_ptr<float>(), *g = gate.data_ptr<float>(), *u = up.data_ptr<float>(),
        *o = outs.data_ptr<float>();
  const float* xs = x.data_ptr<float>();
  for (std::int64_t i = 0; i < R; ++i)
    std::memcpy(row + i * H, xs + (order[i] / k) * H, static_cast<std::size_t>(H) * sizeof(float));
  std::vector<OwnRowsProduct> gate_up, down;
  for (std::int64_t e = 0; e < E; ++e) {
    const std::int64_t first = start[e], n = start[e + 1] - first;
    if (n == 0) continue;
    const Expert& expert = experts[static_cast<std::size_t>(e)];
    gate_up.push_back({row + first * H, n, expert.gate.weight.data_ptr<float>(), I, g + first * I, false});
    gate_up.push_back({row + first * H, n, expert.up.weight.data_ptr<float>(), I, u + first * I, false});
    down.push_back({g + first * I, n, expert.down.weight.data_ptr<float>(), H, o + first * H, false});
  }
  linear_rows_each(H, gate_up);
  swiglu_in_place(g, u, R * I);
  linear_rows_each(I, down);

  torch::Tensor out = torch::zeros({N, H}, f32);
  float* y = out.data_ptr<float>();
  const float* weight = weights.data_ptr<float>();
  for (std::int64_t i = 0; i < R; ++i) {  // expert order: each token's outputs add up as run_experts adds them
    const std::int64_t r = order[i];
    float* to = y + (r / k) * H;
    const float* from = o + i * H;
    for (std::int64_t h = 0; h < H; ++h) to[h] += from[h] * weight[r];
  }
  return out;
}

}  // namespace

std::pair<torch::Tensor, torch::Tensor> ExpertAdapters::factors(const torch::Tensor& a, const torch::Tensor& b,
                                                                std::int64_t e, std::int64_t E) {
  const std::int64_t r = a.size(0) / E;
  return {a.narrow(0, e * r, r), b.view({b.size(0), r, E}).select(2, e)};
}

ExpertAdapters ExpertAdapters::slice(std::int64_t first, std::int64_t count, std::int64_t E) const {
  // A's rows are expert-major (expert e's r rows together); B's columns expert-minor (factors: [out, r, E]).
  auto take = [&](const torch::Tensor& a, const torch::Tensor& b) -> std::pair<torch::Tensor, torch::Tensor> {
    if (!a.defined()) return {};
    const std::int64_t r = a.size(0) / E;
    const torch::Tensor b_own = b.view({b.size(0), r, E}).narrow(2, first, count);
    return {a.narrow(0, first * r, count * r), b_own.reshape({b.size(0), r * count})};
  };
  ExpertAdapters out;
  std::tie(out.gate_up_a, out.gate_up_b) = take(gate_up_a, gate_up_b);
  std::tie(out.down_a, out.down_b) = take(down_a, down_b);
  out.scale = scale;
  return out;
}

Routes route_top_k(const torch::Tensor& logits, std::int64_t k, bool normalize, torch::ScalarType dtype,
                   bool softmax_after_top_k) {
  if (softmax_after_top_k) {
    auto [values, experts] = torch::topk(logits, k, -1);
    return {experts, torch::softmax(values, -1).to(dtype)};
  }
  const torch::Tensor probabilities = torch::softmax(logits, -1, torch::kFloat32);
  auto [weights, experts] = torch::topk(probabilities, k, -1);
  if (normalize) weights = weights / weights.sum(-1, /*keepdim=*/true);
  return {experts, weights.to(dtype)};
}

Routes route_given(const torch::Tensor& logits, const torch::Tensor& experts, bool normalize, torch::ScalarType dtype,
                   bool softmax_after_top_k) {
  if (softmax_after_top_k) return {experts, torch::softmax(logits.gather(1, experts), -1).to(dtype)};
  torch::Tensor weights = torch::softmax(logits, -1, torch::kFloat32).gather(1, experts);
  if (normalize) weights = weights / weights.sum(-1, /*keepdim=*/true);
  return {experts, weights.to(dtype)};
}

void add_router_totals(RouterTotals& totals, const torch::Tensor& logits, const Routes& routes,
                       const torch::Tensor& mask, bool replayed) {
  torch::NoGradGuard no_grad;
  const torch::Tensor z = logits.detach().to(torch::kFloat64);  // [N, E]
  const std::int64_t N = z.size(0), E = z.size(1), k = routes.experts.size(1);
  // (The mask is on the logits' device: hidden_states moves it there. repeat_interleave would ask the host for its
  // output size on CUDA; an expanded view does not.)
  const torch::Tensor real = mask.defined() ? mask.to(torch::kFloat64) : torch::ones({N}, z.options());
  const torch::Tensor probabilities = torch::softmax(z, -1);
  const torch::Tensor routed = torch::zeros({E}, z.options())
                                   .index_add_(0, routes.experts.reshape({N * k}),
                                               real.unsqueeze(1).expand({N, k}).reshape({N * k}));
  const torch::Tensor probability = (probabilities * real.unsqueeze(1)).sum(0);
  const torch::Tensor squared = (torch::logsumexp(z, -1).square() * real).sum();
  if (!totals.rows.defined()) {
    totals.routed = routed;
    totals.probability = probability;
    totals.z = squared;
    totals.rows = real.sum();
  } else {
    totals.routed += routed;
    totals.probability += probability;
    totals.z += squared;
    totals.rows += real.sum();
  }
  if (!replayed) return;
  // Sets, not orders: the router's own top k and the replayed experts, both sorted, differ somewhere.
  const torch::Tensor own = std::get<0>(std::get<1>(torch::topk(z, k, -1)).sort(-1));
  const torch::Tensor given = std::get<0>(routes.experts.sort(-1));
  const torch::Tensor differ = ((own != given).any(-1).to(torch::kFloat64) * real).sum();
  totals.mismatched = totals.mismatched.defined() ? totals.mismatched + differ : differ;
  totals.replayed = true;
}

std::map<std::string, double> router_metrics(const RouterTotals& totals) {
  std::map<std::string, double> out;
  if (!totals.rows.defined()) return out;
  // transformers' tokens_per_expert is [k, E] (the share of tokens whose i-th choice is e); summed over i it is
  // the routes an expert took over the tokens counted, as here. One copy to the host for every figure, once per
  // forward (not per sparse layer), through to_host so that the operator-count test sees it.
  const auto E = static_cast<double>(totals.routed.size(0));
  const torch::Tensor sums =
      to_host(torch::stack({totals.rows, E * (totals.routed * totals.probability).sum(), totals.z,
                            totals.replayed ? totals.mismatched : torch::zeros_like(totals.z)}));
  const double* v = sums.data_ptr<double>();
  const double rows = v[0];
  if (rows == 0) return out;
  out["router/aux_loss"] = v[1] / (rows * rows);
  out["router/z_loss"] = v[2] / rows;
  if (totals.replayed) out["router/replay_mismatch"] = v[3] / rows;
  return out;
}

namespace {

// Expert e of E (adapted by `adapters` when given) over its rows `in` [n, H].
torch::Tensor expert_forward(const Expert& expert, const torch::Tensor& in, std::int64_t e, std::int64_t E,
                             const ExpertAdapters* adapters, bool few_rows, const ExpertActivation& activation) {
  torch::Tensor gate = expert.gate.apply(in, few_rows), up = expert.up.apply(in, few_rows);
  if (adapters && adapters->gate_up_a.defined()) {
    const torch::Tensor delta = expert_delta(in, adapters->gate_up_a, adapters->gate_up_b, e, E, adapters->scale);
    const std::int64_t I = gate.size(1);
    gate = gate + delta.narrow(1, 0, I);
    up = up + delta.narrow(1, I, I);
  }
  const torch::Tensor hidden = activation.clamped ? clamped_swiglu(gate, up, activation) : swiglu(gate, up);
  torch::Tensor out = expert.down.apply(hidden, few_rows);
  if (adapters && adapters->down_a.defined())
    out = out + expert_delta(hidden, adapters->down_a, adapters->down_b, e, E, adapters->scale);
  return out;
}

}  // namespace

SortedRoutes sort_routes(const torch::Tensor& experts, std::int64_t E) {
  const std::int64_t R = experts.numel();
  const torch::Tensor flat = experts.reshape({R});
  auto [sorted, order] = torch::sort(flat, /*stable=*/true, /*dim=*/0, /*descending=*/false);
  // The first sorted route of each expert (and R after the last): a binary search of the sorted ids, where bincount
  // would make a CUDA host wait for its output's size.
  const torch::Tensor bounds = torch::searchsorted(sorted, torch::arange(E + 1, flat.options()));
  return {order, sorted, bounds.narrow(0, 0, E), bounds.narrow(0, 1, E) - bounds.narrow(0, 0, E)};
}

torch::Tensor expert_products(const torch::Tensor& rows, const torch::Tensor& counts,
                              const std::vector<Expert>& experts, const ExpertAdapters* adapters, bool few_rows,
                              const ExpertActivation& activation) {
  const auto E = static_cast<std::int64_t>(experts.size());
  std::vector<torch::Tensor> outputs;
  const std::int64_t* count = counts.data_ptr<std::int64_t>();
  for (std::int64_t e = 0, start = 0; e < E; start += count[e], ++e) {
    if (count[e] == 0) continue;
    outputs.push_back(expert_forward(experts[static_cast<std::size_t>(e)], rows.narrow(0, start, count[e]), e, E,
                                     adapters, few_rows, activation));
  }
  if (outputs.empty()) return torch::empty({0, rows.size(1)}, rows.options());  // no rows at all
  return torch::cat(outputs);
}

torch::Tensor expert_products_padded(const torch::Tensor& rows, const SortedRoutes& sorted,
                                     const std::vector<Expert>& experts, const ExpertAdapters* adapters, bool few_rows,
                                     const ExpertActivation& activation, std::int64_t capacity) {
  const auto E = static_cast<std::int64_t>(experts.size());
  const std::int64_t R = rows.size(0), H = rows.size(1), C = capacity;
  // Sorted route i of expert e = expert[i] is that expert's (i - first[e])-th: its slot e * C + (i - first[e]).
  const torch::Tensor rank = torch::arange(R, sorted.expert.options()) - sorted.first.index_select(0, sorted.expert);
  const torch::Tensor slot = sorted.expert * C + rank;
  // [E * C, H]: expert e's rows at [e * C, e * C + count[e]), zeros after them (whose outputs are never read, so
  // nothing flows back through them either).
  const torch::Tensor padded = torch::zeros({E * C, H}, rows.options()).index_copy(0, slot, rows);
  std::vector<torch::Tensor> outputs;
  for (std::int64_t e = 0; e < E; ++e)
    outputs.push_back(expert_forward(experts[static_cast<std::size_t>(e)], padded.narrow(0, e * C, C), e, E, adapters,
                                     few_rows, activation));
  return torch::cat(outputs).index_select(0, slot);
}

torch::Tensor run_experts(const torch::Tensor& x, const Routes& routes, const std::vector<Expert>& experts,
                          const ExpertAdapters* adapters, bool few_rows, const ExpertActivation& activation,
                          ExpertRows layout) {
  if (few_rows && !adapters && !activation.clamped && layout == ExpertRows::automatic &&
      step_kernels_apply(x, experts))
    return step_experts(x, routes, experts);
  const std::int64_t N = x.size(0), k = routes.experts.size(1);
  const auto E = static_cast<std::int64_t>(experts.size());
  // The N * k routes sorted by expert (stable: an expert's rows keep token order) and each one's token, on x's
  // device: nothing here waits for it.
  const SortedRoutes sorted = sort_routes(routes.experts, E);
  const torch::Tensor token = torch::div(sorted.order, k, "floor");
  const torch::Tensor rows = x.index_select(0, token);  // [N * k, H], expert by expert
  // Training and prefill on the CPU read the counts where they lie (the device is the host: no copy, no wait) and
  // run each expert over exactly its rows. Elsewhere, and in a decoding step (a few rows: the padding costs little
  // there, and the CPU's ATen step then runs what CUDA runs, a fixed set of operators), each expert runs over a
  // capacity of N rows (a token routes to an expert at most once): E / k times the products' rows, the price of not
  // waiting for the counts on the host at every sparse layer (a grouped product taking device-side offsets,
  // torch._grouped_mm from PyTorch 2.8, would not pay it).
  if (layout == ExpertRows::automatic)
    layout = x.device().is_cpu() && !few_rows ? ExpertRows::exact : ExpertRows::padded;
  const torch::Tensor outputs =
      layout == ExpertRows::exact
          ? expert_products(rows, x.device().is_cpu() ? sorted.counts : to_host(sorted.counts), experts, adapters,
                            few_rows, activation)
          : expert_products_padded(rows, sorted, experts, adapters, few_rows, activation, std::max<std::int64_t>(N, 1));
  const torch::Tensor weights = routes.weights.reshape({N * k}).index_select(0, sorted.order).unsqueeze(1);
  // Added token by token in expert order: a token's outputs sum as transformers' per-expert index_add_ sums them.
  return torch::zeros_like(x).index_add(0, token, outputs * weights);
}

}  // namespace rlloop::engine
