// The sparse MLP of a mixture-of-experts layer (families with `experts`, model_family.hpp): a router scores every
// expert for each token, the token goes through the top k, and their outputs are summed with the router's weights.
// The experts run as grouped products: the routed rows sorted by expert, one product per expert over its own rows
// (never a loop over tokens), in ATen operators, so the one definition trains, prefills and decodes on any device.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "model/linear.hpp"

namespace rlloop::engine {

// One expert: a SwiGLU MLP, down(silu(gate x) * up x).
struct Expert {
  Linear gate, up, down;
};

// A sparse layer's LoRA adapters on its experts, in PEFT's layout for stacked expert weights (its ParamWrapper over
// transformers 5's gate_up_proj [E, 2I, H] and down_proj [E, H, I]): A is [E * r, in] with expert e's rows at
// [e * r, (e + 1) * r), B is [out, E * r] read as [out, r, E], expert e's columns strided by E. The gate and up
// projections share one adapter (rank 2 * LoRA's rank, alpha doubled too, as PEFT maps the per-projection targets
// onto the fused weight): its output's first I rows adapt gate, the last I up.
struct ExpertAdapters {
  torch::Tensor gate_up_a, gate_up_b;  // [E * r2, H], [2I, E * r2]; undefined unless gate/up are targets
  torch::Tensor down_a, down_b;        // [E * r, I], [H, E * r]; undefined unless down_proj is a target
  double scale = 0.0;                  // alpha / rank, the same for both (PEFT doubles both for gate_up)

  bool any() const { return gate_up_a.defined() || down_a.defined(); }
  // Expert e of E's factors of a stacked pair: A [r, in], B [out, r] (views).
  static std::pair<torch::Tensor, torch::Tensor> factors(const torch::Tensor& a, const torch::Tensor& b,
                                                         std::int64_t e, std::int64_t E);
  // The adapters of experts [first, first + count) of these E, stacked as adapters of their own (expert
  // parallelism: a rank's experts); differentiable, so their gradients reach these.
  ExpertAdapters slice(std::int64_t first, std::int64_t count, std::int64_t E) const;
};

// Where each of N tokens goes: its k experts and the weight of each one's output.
struct Routes {
  torch::Tensor experts;  // [N, k] int64
  torch::Tensor weights;  // [N, k], in the hidden states' dtype
};

// The routing of router logits [N, E], as transformers computes it. Qwen-MoE's: softmax in fp32, the k most probable
// experts, their probabilities renormalised to sum to one when `normalize` (norm_topk_prob), cast to `dtype`.
// gpt-oss's (`softmax_after_top_k`): the k largest logits, a softmax over them in the logits' dtype.
Routes route_top_k(const torch::Tensor& logits, std::int64_t k, bool normalize, torch::ScalarType dtype,
                   bool softmax_after_top_k = false);

// Routes given from elsewhere (routing replay): the tokens go to `experts` [N, k], weighted as route_top_k weighs its
// own choice (the router's current probabilities there, or the softmax over their logits), so gradients still reach
// the router. With the experts route_top_k would pick, the weights are route_top_k's bit for bit.
Routes route_given(const torch::Tensor& logits, const torch::Tensor& experts, bool normalize, torch::ScalarType dtype,
                   bool softmax_after_top_k = false);

// What an expert computes between its gate / up and down products: SwiGLU, silu(gate) * up, or gpt-oss's clamped
// variant, (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit).
struct ExpertActivation {
  bool clamped = false;
  double limit = 7.0, alpha = 1.702;
};

// What router_metrics reports, summed over the sparse layers of one forward and its real tokens: the routes each
// expert took ([E], each token counts its k) and the router's probabilities summed per expert ([E]), both float64;
// the squared log-sum-exp of the router's logits; with replay, the tokens whose replayed experts are not the ones
// the router itself would pick. `rows`: the (token, sparse layer) pairs counted. Tensors on the model's device.
struct RouterTotals {
  torch::Tensor routed, probability, z, mismatched;
  torch::Tensor rows;
  bool replayed = false;
};

// Routing replay over one forward (Transformer::hidden_states): the experts each token took in each sparse layer,
// [tokens, sparse layers, k] int64 with tokens in the input's row-major [B, T] order. `replay`, when defined, is
// routed by (route_given); `recorded` receives what every sparse layer routed by, in the same layout. A sampler's
// recorded routes given to the trainer's forward make it route as the sampler did: the importance ratio then
// compares two sets of weights, not two routings.
struct ExpertRouting {
  torch::Tensor replay;
  torch::Tensor recorded;
  // Router diagnostics over the forward's real tokens (`mask` [tokens], 1 for a real token, 0 for padding; undefined:
  // all real), summed over its sparse layers by add_router_totals when `totals` is set. No graph.
  torch::Tensor mask;
  RouterTotals* totals = nullptr;
};

// Adds one sparse layer's routing of N tokens (router logits [N, E], the routes taken) to `totals`.
void add_router_totals(RouterTotals& totals, const torch::Tensor& logits, const Routes& routes,
                       const torch::Tensor& mask, bool replayed);

// The router's metrics of a forward, from its totals (none when nothing was counted):
// - "router/aux_loss": the load-balancing loss of Switch / Qwen-MoE as transformers computes it
//   (load_balancing_loss_func over every sparse layer's logits at once, padding excluded): E * sum over experts of
//   (the share of routes it took) * (its mean probability): k when the load is uniform; what a trainer would add
//   with a small coefficient (router_aux_loss_coef); reported, not added to the loss. Under replay the routes
//   counted are the replayed ones (the load the forward carried), where transformers would count the router's own.
// - "router/z_loss": the mean squared log-sum-exp of the router's logits (ST-MoE's router z-loss; large logits).
// - "router/replay_mismatch" (replayed forwards): the share of (token, sparse layer) pairs whose replayed experts
//   differ from the router's own top k: the routing flips replay kept out of the importance ratio.
std::map<std::string, double> router_metrics(const RouterTotals& totals);

// Routes sorted by expert on their own device (no host read): `order` [R] the flat route indices (token * k + j)
// sorted by expert, stably; `expert` [R] the expert of each sorted route; `first` [E] where each expert's run starts
// among them and `counts` [E] how long it is (int64).
struct SortedRoutes {
  torch::Tensor order, expert, first, counts;
};
SortedRoutes sort_routes(const torch::Tensor& experts, std::int64_t E);

// The grouped products of rows sorted by expert ([R, H]; `counts` [E] on the host: how many rows each expert has,
// in order): each expert's rows through it (adapted by `adapters` when given), [R, H] in the same order. Expert
// parallelism (expert_parallel.cpp) calls it with counts it reads on the host anyway: they are its all-to-all's split
// sizes, a wait for the device it cannot avoid (a single rank's run_experts has none).
torch::Tensor expert_products(const torch::Tensor& rows, const torch::Tensor& counts,
                              const std::vector<Expert>& experts, const ExpertAdapters* adapters, bool few_rows,
                              const ExpertActivation& activation);

// The same products with the counts left on the device: each expert's rows copied into a slice of `capacity` rows
// of a zero-padded [E * capacity, H] (capacity at least any expert's count), every expert run over its whole slice,
// and the real rows read back in the order of `rows`. Shapes known on the host alone, so nothing waits for the device.
torch::Tensor expert_products_padded(const torch::Tensor& rows, const SortedRoutes& sorted,
                                     const std::vector<Expert>& experts, const ExpertAdapters* adapters, bool few_rows,
                                     const ExpertActivation& activation, std::int64_t capacity);

// How run_experts lays out the experts' rows: `exact` runs each expert over exactly its rows, reading the counts on
// the host (free on the CPU, a wait for the device elsewhere); `padded` over a capacity of one row per token
// (expert_products_padded: no wait, E / k times the rows); `automatic` picks exact for the CPU's training and
// prefill, padded elsewhere and for decoding steps (few_rows), and the CPU decoding step's own kernels where they apply.
enum class ExpertRows { automatic, exact, padded };

// For each row of x [N, H]: the sum over its routes of weight * expert(row), in expert order (as transformers
// accumulates it), each expert adapted by `adapters` when given; few_rows as Linear::apply's (a decoding step). The
// routes must name k distinct experts per token (route_top_k's do; replayed ones are checked where they come in).
// Nothing is read back from a device (ExpertRows::automatic).
torch::Tensor run_experts(const torch::Tensor& x, const Routes& routes, const std::vector<Expert>& experts,
                          const ExpertAdapters* adapters = nullptr, bool few_rows = false,
                          const ExpertActivation& activation = {}, ExpertRows layout = ExpertRows::automatic);

}  // namespace rlloop::engine
