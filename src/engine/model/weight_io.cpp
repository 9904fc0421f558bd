#include "model/weight_io.hpp"

#include <set>
#include <vector>

#include <rlloop/error.hpp>

namespace rlloop::engine {

TensorMap WeightIO::hf_state_dict() const {
  TensorMap out;
  w_.for_each_base([&](const std::string& name, const torch::Tensor& t) { out[name] = t.detach(); });
  w_.for_each_quantized([&](const std::string& name, const QuantizedMatrix& q) { out[name] = q.dequantize(); });
  return out;
}

void WeightIO::load_hf_state_dict(const TensorMap& tensors) {
  std::map<std::string, torch::Tensor> expected;
  w_.for_each_base([&](const std::string& name, const torch::Tensor& t) { expected[name] = t; });
  std::vector<std::string> unexpected;
  for (const auto& [name, t] : tensors) {
    if (expected.count(name)) continue;
    // Old HF checkpoints store the RoPE frequencies as a buffer; we recompute them.
    if (name.size() >= 19 && name.compare(name.size() - 19, 19, "rotary_emb.inv_freq") == 0) continue;
    const WeightNames& names = w_.family->names;
    if (name == names.lm_head + ".weight" && w_.cfg.tie_word_embeddings) {
      // Some tied checkpoints store the duplicate; one that differs means the config is wrong.
      auto it = tensors.find(names.embed + ".weight");
      if (it != tensors.end() && !torch::equal(it->second.to(t.scalar_type()).cpu(), t.cpu()))
        throw invalid_argument("load_hf_state_dict: " + name + " differs from " + it->first +
                               " but the config ties them (set tie_word_embeddings to false)");
      continue;
    }
    unexpected.push_back(name);
  }
  if (!unexpected.empty()) {
    std::string list;
    for (std::size_t i = 0; i < unexpected.size() && i < 5; ++i) list += (i ? ", " : "") + unexpected[i];
    if (unexpected.size() > 5) list += ", ...";
    throw invalid_argument("load_hf_state_dict: " + std::to_string(unexpected.size()) +
                           " unexpected tensor(s) for this " + w_.cfg.model_type + " config: " + list);
  }
  for (const auto& [name, param] : expected) {
    auto it = tensors.find(name);
    if (it == tensors.end()) throw invalid_argument("load_hf_state_dict: missing tensor '" + name + "'");
    if (it->second.sizes() != param.sizes())
      throw invalid_argument("load_hf_state_dict: tensor '" + name + "' has shape " + shape_string(it->second.sizes()) +
                             ", the model expects " + shape_string(param.sizes()));
  }
  torch::NoGradGuard no_grad;
  for (auto& [name, param] : expected) param.copy_(tensors.at(name));
}

namespace {
// gpt-oss's checkpoint interleaves each expert's gate and up columns (gate_up_proj [E, H, 2I]: gate at even, up at
// odd), and PEFT's B of the stacked adapter has its rows in that order; rlloop's gate_up B has the gate's I rows,
// then the up's. Nothing else of the layout differs (PEFT reads the transposed stack as [E, in, out]).
torch::Tensor interleave_gate_up_rows(const torch::Tensor& b) {
  const std::int64_t I = b.size(0) / 2;
  return torch::stack({b.narrow(0, 0, I), b.narrow(0, I, I)}, 1).reshape(b.sizes());
}
torch::Tensor deinterleave_gate_up_rows(const torch::Tensor& b) {
  return torch::cat({b.slice(0, 0, b.size(0), 2), b.slice(0, 1, b.size(0), 2)});
}
}  // namespace

TensorMap WeightIO::peft_state_dict() const {
  if (!w_.lora) throw conflict("Transformer::peft_state_dict: the model has no LoRA adapters");
  std::set<const void*> interleaved;  // gpt-oss's gate_up Bs
  if (w_.family->expert_style.stacked_interleaved)
    for (const Layer& l : w_.layers)
      if (l.expert_lora.gate_up_b.defined()) interleaved.insert(l.expert_lora.gate_up_b.unsafeGetTensorImpl());
  TensorMap out;
  w_.for_each_adapter([&](const std::string& name, const torch::Tensor& t, bool) {
    out[name] = interleaved.count(t.unsafeGetTensorImpl()) ? interleave_gate_up_rows(t.detach()) : t.detach();
  });
  return out;
}

void WeightIO::load_peft_state_dict(const TensorMap& tensors) {
  if (!w_.lora)
    throw conflict("Transformer::load_peft_state_dict: the model has no LoRA adapters (enable_lora first)");
  std::map<std::string, torch::Tensor> expected;
  w_.for_each_adapter([&](const std::string& name, const torch::Tensor& t, bool) { expected[name] = t; });
  for (const auto& [name, t] : tensors)
    if (!expected.count(name))
      throw invalid_argument("load_peft_state_dict: unexpected adapter tensor '" + name +
                             "' (not a LoRA target of this model)");
  for (const auto& [name, param] : expected) {
    auto it = tensors.find(name);
    if (it == tensors.end()) throw invalid_argument("load_peft_state_dict: missing adapter tensor '" + name + "'");
    if (it->second.sizes() != param.sizes())
      throw invalid_argument("load_peft_state_dict: adapter tensor '" + name + "' has shape " +
                             shape_string(it->second.sizes()) + ", the model expects " + shape_string(param.sizes()));
  }
  torch::NoGradGuard no_grad;
  for (auto& [name, param] : expected) param.copy_(tensors.at(name));
  if (w_.family->expert_style.stacked_interleaved)
    for (Layer& l : w_.layers)
      if (l.expert_lora.gate_up_b.defined())
        l.expert_lora.gate_up_b.copy_(deinterleave_gate_up_rows(l.expert_lora.gate_up_b));
}

TensorMap WeightIO::merged_hf_state_dict() const {
  TensorMap out = hf_state_dict();
  if (!w_.lora) return out;
  torch::NoGradGuard no_grad;
  w_.for_each_linear([&](const Linear& lin) {
    if (!lin.lora_a.defined()) return;
    // A tied model with an lm_head adapter gets an untied lm_head.weight (save_model unties the config).
    out[lin.name + ".weight"] = lin.merged_weight();
  });
  for (const Layer& l : w_.layers) merge_experts(l, out);
  return out;
}

// Each expert's weights with its share of the stacked adapters, accumulated as merged_weight accumulates.
void WeightIO::merge_experts(const Layer& l, TensorMap& out) const {
  const ExpertAdapters& adapters = l.expert_lora;
  const auto E = static_cast<std::int64_t>(l.experts.size());
  auto merge = [&](const Linear& lin, const torch::Tensor& a, const torch::Tensor& b) {
    const torch::Tensor w = lin.dense_weight();
    const auto acc = a.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
    out[lin.name + ".weight"] = (w.to(acc) + adapters.scale * torch::matmul(b.to(acc), a.to(acc))).to(w.scalar_type());
  };
  for (std::int64_t e = 0; e < E; ++e) {
    const Expert& expert = l.experts[static_cast<std::size_t>(e)];
    if (adapters.gate_up_a.defined()) {
      const auto [a, b] = ExpertAdapters::factors(adapters.gate_up_a, adapters.gate_up_b, e, E);
      const std::int64_t I = b.size(0) / 2;
      merge(expert.gate, a, b.narrow(0, 0, I));
      merge(expert.up, a, b.narrow(0, I, I));
    }
    if (adapters.down_a.defined()) {
      const auto [a, b] = ExpertAdapters::factors(adapters.down_a, adapters.down_b, e, E);
      merge(expert.down, a, b);
    }
  }
}

}  // namespace rlloop::engine
