#include "model/experts_layer.hpp"

#include <vector>

#include <rlloop/error.hpp>

namespace rlloop::engine {

torch::Tensor ExpertsLayer::forward(const ModelWeights& w, std::size_t li, const torch::Tensor& h,
                                    const StepContext& in) const {
  const torch::Tensor rows = h.reshape({-1, h.size(2)});
  const bool step = !in.groups.empty();  // a decoding step: few rows
  std::int64_t sparse_index = 0;
  for (std::size_t i = 0; i < li; ++i) sparse_index += w.layers[i].sparse() ? 1 : 0;
  if (!shard_.group && static_cast<std::int64_t>(w.layers[li].experts.size()) != w.cfg.num_experts)
    throw invalid_argument("Transformer: this model holds a slice of the experts; set_expert_parallel names the group "
                           "that holds the others");
  bool adapted = false;
  for (const RowGroup& g : in.groups) {
    const Layer& own = g.weights->layers[li];
    adapted = adapted || own.expert_lora.any() || own.router.lora_a.defined();
  }
  // Without adapters anywhere: any group's layer is the base's (this model's own may have adapters of its own).
  if (!adapted) {
    const Layer& layer = in.groups.empty() ? w.layers[li] : in.groups.front().weights->layers[li];
    return through(w, layer, sparse_index, rows, 0, step, in.routing);
  }
  // Consecutive groups over the same weights (one session's requests: their rows are consecutive too) go through them
  // at once: one pass of the experts per model in the step and, under expert parallelism, one exchange, as every
  // rank's step makes (an expert-parallel step's groups are all of one model: sample_lockstep_share).
  std::vector<torch::Tensor> out;
  for (std::size_t i = 0, j = 0; i < in.groups.size(); i = j) {
    std::int64_t n = 0;
    for (j = i; j < in.groups.size() && in.groups[j].weights == in.groups[i].weights; ++j) n += in.groups[j].rows;
    out.push_back(through(w, in.groups[i].weights->layers[li], sparse_index, rows.narrow(0, in.groups[i].row0, n),
                          in.groups[i].row0, step, in.routing));
  }
  return out.size() == 1 ? out.front() : torch::cat(out);
}

torch::Tensor ExpertsLayer::through(const ModelWeights& w, const Layer& layer, std::int64_t sparse_index,
                                    const torch::Tensor& x, std::int64_t row0, bool step,
                                    ExpertRouting* routing) const {
  const ModelConfig& cfg = w.cfg;
  const bool replay = routing && routing->replay.defined();
  const ExpertStyle& style = w.family->expert_style;
  const ExpertActivation activation{style.clamped_swiglu, cfg.swiglu_limit, cfg.swiglu_alpha};
  const torch::Tensor logits = layer.router.apply(x, step);
  const Routes routes = replay ? route_given(logits, routing->replay.select(1, sparse_index), cfg.norm_topk_prob,
                                             x.scalar_type(), style.softmax_after_top_k)
                               : route_top_k(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob, x.scalar_type(),
                                             style.softmax_after_top_k);
  if (routing) {
    routing->recorded.select(1, sparse_index).narrow(0, row0, x.size(0)).copy_(routes.experts);
    if (routing->totals) add_router_totals(*routing->totals, logits, routes, routing->mask, replay);
  }
  if (shard_.group) {
    // Every rank holds every expert's adapters (they are small: replicated, summed and stepped like the dense
    // weights) and applies those of its own experts.
    const ExpertAdapters& all = layer.expert_lora;
    const ExpertAdapters own =
        all.any() ? all.slice(shard_.first, shard_.per_rank, cfg.num_experts) : ExpertAdapters{};
    return run_experts_parallel(x, routes, layer.experts, own.any() ? &own : nullptr, shard_, activation);
  }
  return run_experts(x, routes, layer.experts, layer.expert_lora.any() ? &layer.expert_lora : nullptr, step,
                     activation);
}

void ExpertsLayer::check_routing(const ModelWeights& w, const ExpertRouting& routing, std::int64_t tokens) {
  const ModelConfig& cfg = w.cfg;
  const std::string what = "Transformer::hidden_states: routing replay: ";
  if (cfg.num_experts == 0) throw invalid_argument(what + "this " + cfg.model_type + " model has no experts");
  const torch::Tensor& m = routing.mask;
  if (m.defined() && (m.dim() != 1 || m.size(0) != tokens))
    throw invalid_argument(what + "the token mask must be [" + std::to_string(tokens) + "], got " +
                           shape_string(m.sizes()));
  const torch::Tensor& r = routing.replay;
  if (!r.defined()) return;
  const std::int64_t sparse = w.sparse_layers();
  const std::vector<std::int64_t> want = {tokens, sparse, cfg.num_experts_per_tok};
  if (r.scalar_type() != torch::kLong || r.sizes() != want)
    throw invalid_argument(what + "the routes must be an int64 [tokens, sparse layers, experts per token] = " +
                           shape_string(want) + " tensor, got " + std::string(c10::toString(r.scalar_type())) + " " +
                           shape_string(r.sizes()));
  // Checked where the routes lie on the host (before they are uploaded): on a device, reading them back would make
  // the host wait at every forward; routes there come from a forward's own recording or from a session, which
  // checked them on the host (loss inputs, rlloop/loss.hpp).
  if (!r.device().is_cpu()) return;
  const torch::Tensor ids = r.contiguous();
  const std::int64_t* id = ids.data_ptr<std::int64_t>();
  const std::int64_t k = cfg.num_experts_per_tok;
  for (std::int64_t i = 0; i < ids.numel(); ++i) {
    if (id[i] < 0 || id[i] >= cfg.num_experts)
      throw invalid_argument(what + "expert id " + std::to_string(id[i]) + " is outside [0, " +
                             std::to_string(cfg.num_experts) + ")");
    // run_experts lays out one row per token per expert at most.
    for (std::int64_t j = i - i % k; j < i; ++j)
      if (id[j] == id[i])
        throw invalid_argument(what + "expert " + std::to_string(id[i]) + " is given twice at token " +
                               std::to_string(i / (k * sparse)) + ", sparse layer " +
                               std::to_string(i / k % sparse));
  }
}

void ExpertsLayer::set_parallel(const ModelWeights& w, dist::Group& group) {
  const ModelConfig& cfg = w.cfg;
  if (cfg.num_experts == 0)
    throw invalid_argument("expert parallelism: this " + cfg.model_type + " model has no experts");
  const ExpertShard shard = ExpertShard::of(group, cfg.num_experts);
  for (std::size_t i = 0; i < w.layers.size(); ++i) {
    const Layer& l = w.layers[i];
    if (!l.sparse()) continue;
    const std::string first = w.family->expert_module(static_cast<std::int64_t>(i), shard.first, Projection::gate);
    if (static_cast<std::int64_t>(l.experts.size()) != shard.per_rank || l.experts.front().gate.name != first)
      throw invalid_argument("expert parallelism: rank " + std::to_string(shard.first / shard.per_rank) + " of " +
                             std::to_string(cfg.num_experts / shard.per_rank) + " holds experts [" +
                             std::to_string(shard.first) + ", " + std::to_string(shard.first + shard.per_rank) +
                             "); build its model with that ExpertRange");
  }
  shard_ = shard;
}

bool ExpertsLayer::is_expert_tensor(const ModelWeights& w, const std::string& name) {
  const ModelFamily& f = *w.family;
  // Most names are not an expert's: one search rejects them before the layers' prefixes are built.
  if (name.find("." + f.names.experts + ".") == std::string::npos) return false;
  for (std::size_t i = 0; i < w.layers.size(); ++i) {
    if (!w.layers[i].sparse()) continue;
    if (name.starts_with(f.layer_tensor(static_cast<std::int64_t>(i), f.names.experts) + ".")) return true;
  }
  return false;
}

int ExpertsLayer::rank_of(const ModelWeights& w, const std::string& name) const {
  if (!shard_.group || !is_expert_tensor(w, name)) return -1;
  // The expert's index follows the experts' name (stacked adapters of every expert have none).
  const std::string experts = "." + w.family->names.experts + ".";
  std::size_t at = name.find(experts) + experts.size();
  std::int64_t e = 0;
  const std::size_t first = at;
  for (; at < name.size() && name[at] >= '0' && name[at] <= '9'; ++at) e = e * 10 + (name[at] - '0');
  if (at == first || at == name.size() || name[at] != '.') return -1;
  return static_cast<int>(e / shard_.per_rank);
}

}  // namespace rlloop::engine
