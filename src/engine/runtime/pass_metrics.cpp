#include "runtime/pass_metrics.hpp"

#include <algorithm>
#include <cmath>

#include "runtime/loss.hpp"

namespace rlloop::engine {

namespace {

std::vector<double> input_or(const Datum& d, const char* name, std::size_t n, double fallback) {
  auto it = d.loss_fn_inputs.find(name);
  return it == d.loss_fn_inputs.end() ? std::vector<double>(n, fallback) : it->second.as_doubles();
}

}  // namespace

double forward_flops(const ModelConfig& cfg, const std::vector<std::int64_t>& lengths) {
  const auto h = static_cast<double>(cfg.hidden_size);
  const auto q_width = static_cast<double>(cfg.num_attention_heads * cfg.head_dim);
  const auto kv_width = static_cast<double>(cfg.num_key_value_heads * cfg.head_dim);
  const auto layers = static_cast<double>(cfg.num_hidden_layers);
  // Multiply-adds per token: q, k, v and o in every layer; gate, up and down of the dense MLP, or in a sparse
  // layer the router's and those of the experts the token is routed to.
  double mlp = 0;
  for (std::int64_t i = 0; i < cfg.num_hidden_layers; ++i)
    mlp += cfg.sparse_layer(i) ? h * static_cast<double>(cfg.num_experts +
                                                           3 * cfg.num_experts_per_tok * cfg.moe_intermediate_size)
                               : 3 * h * static_cast<double>(cfg.intermediate_size);
  const double per_layer = h * (q_width + 2 * kv_width) + q_width * h;
  const double per_token = 2 * (layers * per_layer + mlp + h * static_cast<double>(cfg.vocab_size));
  double tokens = 0, attention_pairs = 0;
  for (auto s : lengths) {
    tokens += static_cast<double>(s);
    attention_pairs += static_cast<double>(s) * static_cast<double>(s + 1) / 2;
  }
  return per_token * tokens + 2 * 2 * q_width * attention_pairs * layers;
}

void add_service_metrics(ForwardBackwardOutput& out, const std::vector<Datum>& data, const LossSpec* loss,
                         const ModelConfig& cfg, bool backward, const PassCost& cost) {
  const double n = static_cast<double>(std::max<std::size_t>(data.size(), 1));
  auto& m = out.metrics;
  if (auto it = m.find("loss:sum"); it != m.end()) m["loss"] = it->second / n;
  std::vector<std::int64_t> lengths;
  for (const auto& d : data) lengths.push_back(static_cast<std::int64_t>(d.model_input.length()));
  m["global_token_num"] = static_cast<double>(out.training_tokens);
  // A backward pass costs two forwards (gradients of the activations and of the weights); with a frozen base
  // only the activations' (the adapters' own products are negligible).
  const double passes = backward ? (cost.base_frozen ? 2.0 : 3.0) : 1.0;
  const double flops = passes * forward_flops(cfg, lengths);
  const double achieved = cost.seconds > 0 ? flops / cost.seconds : 0.0;
  m["estimated_flops"] = achieved / 1e12;
  if (cost.peak_flops > 0) {
    m["promised_flops"] = cost.peak_flops / 1e12;
    m["mfu"] = achieved / cost.peak_flops;
  }
  if (!loss || !loss_info(loss->fn).policy) return;
  const auto clips_token = loss_kernel(loss->fn).clips_token;
  m["actor/pg_loss"] = m["loss"];
  double kl = 0, clip = 0;
  for (std::size_t i = 0; i < data.size(); ++i) {
    const auto lp = out.logprobs(i);
    const auto q = input_or(data[i], "logprobs", lp.size(), 0.0);
    const auto a = input_or(data[i], "advantages", lp.size(), 0.0);
    const auto w = input_or(data[i], "weights", lp.size(), 1.0);
    double bearing = 0, kl_i = 0, clipped_i = 0;
    for (std::size_t j = 0; j < lp.size(); ++j) {
      if (w[j] == 0) continue;
      bearing += 1;
      kl_i += q[j] - lp[j];
    }
    if (bearing == 0) continue;
    // mean(lp - q) over the loss-bearing tokens, or those a sequence_ratio_mask names: gspo's log ratio
    double sequence_log_ratio = -kl_i / bearing;
    if (data[i].loss_fn_inputs.count("sequence_ratio_mask")) {
      const auto r = input_or(data[i], "sequence_ratio_mask", lp.size(), 0.0);
      double in_ratio = 0, sum = 0;
      for (std::size_t j = 0; j < lp.size(); ++j)
        if (r[j] != 0) in_ratio += 1, sum += lp[j] - q[j];
      sequence_log_ratio = in_ratio > 0 ? sum / in_ratio : 0.0;
    }
    for (std::size_t j = 0; j < lp.size(); ++j)
      if (w[j] != 0) clipped_i += clips_token(*loss, lp[j], q[j], a[j], sequence_log_ratio);
    kl += kl_i / bearing, clip += clipped_i / bearing;
  }
  m["actor/ppo_kl"] = kl / n;
  m["actor/pg_clipfrac"] = clip / n;
}

}  // namespace rlloop::engine
