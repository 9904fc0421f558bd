// LoRA adapters on a model's weights (Transformer::enable_lora): which linears PEFT's target_modules name, and the
// adapters as PEFT initialises them.
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cmath>

#include <rlloop/error.hpp>

#include "model/model_weights.hpp"

namespace rlloop::engine {

std::set<std::string> ModelWeights::lora_targets(const LoraOptions& options) const {
  if (options.rank <= 0)
    throw invalid_argument("LoraOptions.rank must be positive, got " + std::to_string(options.rank));
  if (options.alpha <= 0)
    throw invalid_argument("LoraOptions.alpha must be positive, got " + std::to_string(options.alpha));
  const bool has_experts = cfg.num_experts > 0;
  // PEFT's all-linear reaches only attention on a model whose experts are stacked parameters in every layer and
  // whose router is no nn.Linear (gpt-oss); its experts and router are adapted when named (PEFT's
  // target_parameters).
  const bool stacked = has_experts && family->expert_style.stacked_interleaved;
  const std::vector<std::string> known = family->lora_target_modules();
  std::set<std::string> targets;
  for (const auto& m : options.target_modules) {
    if (m == "all-linear") {
      for (Projection p : kProjections)
        if (!stacked || p < Projection::gate) targets.insert(family->target_module(p));
      if (has_experts && !stacked) targets.insert(family->router_target_module());  // PEFT's all-linear: the router
    } else if (std::find(known.begin(), known.end(), m) != known.end()) {
      targets.insert(m);
    } else {
      std::string list;
      for (const std::string& k : known) list += (list.empty() ? "" : ", ") + k;
      throw invalid_argument("LoraOptions.target_modules: unknown module '" + m + "' (" + family->model_type +
                             " models have " + list + ")");
    }
  }
  if (targets.empty()) throw invalid_argument("LoraOptions.target_modules is empty");
  // The experts' gate and up projections are one stacked weight in transformers (gate_up_proj), adapted as one.
  const std::string gate = family->target_module(Projection::gate), up = family->target_module(Projection::up);
  if (has_experts && targets.count(gate) != targets.count(up))
    throw invalid_argument("LoraOptions.target_modules: '" + (targets.count(gate) ? gate : up) + "' needs '" +
                           (targets.count(gate) ? up : gate) + "' too on " + family->model_type +
                           " models: the experts' gate and up projections are one stacked weight, adapted as one");
  return targets;
}

void ModelWeights::add_lora(const LoraOptions& options, const std::set<std::string>& targets, std::int64_t seed,
                            const RegisterParameter& param) {
  const bool gate_up = targets.count(family->target_module(Projection::gate)) &&
                       targets.count(family->target_module(Projection::up));
  const bool down = targets.count(family->target_module(Projection::down)) > 0;
  // A is drawn on the CPU in fp32 from its own generator so the init is the same on every device.
  auto gen = at::detail::createCPUGenerator(static_cast<std::uint64_t>(seed));
  const double scale = static_cast<double>(options.alpha) / options.rank;
  // Adapters stay fp32 unless the base is fp64 (PEFT keeps adapters in fp32 over bf16 weights).
  const auto lora_dtype = dtype() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
  // A [rows, in] as PEFT initialises it (kaiming_uniform_(a=sqrt(5)) => U(-1/sqrt(in), 1/sqrt(in))), B zero.
  auto pair = [&](const std::string& name, std::int64_t rows, std::int64_t in, std::int64_t out) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(in));
    auto a = torch::empty({rows, in}, torch::kFloat32).uniform_(-bound, bound, gen);
    return std::pair{param(module_name(name) + "_lora_A", a.to(device(), lora_dtype)),
                     param(module_name(name) + "_lora_B",
                           torch::zeros({out, rows}, torch::TensorOptions().device(device()).dtype(lora_dtype)))};
  };
  for_each_linear([&](Linear& lin) {
    if (!targets.count(lin.short_name)) return;
    std::tie(lin.lora_a, lin.lora_b) = pair(lin.name, options.rank, lin.in_features(), lin.out_features());
    lin.lora_scale = scale;
  });
  const std::int64_t E = cfg.num_experts, I = cfg.moe_intermediate_size, H = cfg.hidden_size;
  for (std::size_t i = 0; i < layers.size(); ++i) {
    Layer& l = layers[i];
    if (!l.sparse() || !(gate_up || down)) continue;
    const std::string experts = family->layer_tensor(static_cast<std::int64_t>(i), family->names.experts);
    // PEFT doubles the fused gate_up's rank and alpha: the same scale, the capacity of the two adapters it replaces.
    ExpertAdapters& adapters = l.expert_lora;
    const std::int64_t r = options.rank;
    if (gate_up) std::tie(adapters.gate_up_a, adapters.gate_up_b) = pair(experts + ".gate_up", E * 2 * r, H, 2 * I);
    if (down) std::tie(adapters.down_a, adapters.down_b) = pair(experts + ".down", E * r, I, H);
    adapters.scale = scale;
  }
  lora = options;
}

}  // namespace rlloop::engine
