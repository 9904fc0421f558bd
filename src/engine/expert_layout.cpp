#include "expert_layout.hpp"

#include <string>
#include <vector>

#include <rlloop/error.hpp>

namespace rlloop::engine {
namespace {

// The stacked tensors of layer `layer`: "model.layers.3.mlp.experts.gate_up_proj" and the others.
std::string stacked(const ModelFamily& f, std::int64_t layer, const std::string& name) {
  return f.layer_tensor(layer, f.names.experts) + "." + name;
}

std::string shape_of(const torch::Tensor& t) {
  std::string s = "[";
  for (std::int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]";
}

// Takes `name` out of `tensors`, checking its shape; an absent tensor is left for the loader to report.
torch::Tensor take(TensorMap& tensors, const std::string& name, const std::vector<std::int64_t>& shape) {
  auto it = tensors.find(name);
  if (it == tensors.end()) return {};
  torch::Tensor t = it->second;
  if (t.sizes() != shape) {
    std::string want = "[";
    for (std::size_t i = 0; i < shape.size(); ++i) want += (i ? ", " : "") + std::to_string(shape[i]);
    throw invalid_argument("load_model: tensor '" + name + "' has shape " + shape_of(t) + ", the model expects " +
                           want + "]");
  }
  tensors.erase(it);
  return t;
}

bool applies(const ModelConfig& cfg) { return cfg.num_experts > 0 && cfg.family().expert_style.stacked_interleaved; }

}  // namespace

void experts_to_model_layout(const ModelConfig& cfg, TensorMap& tensors) {
  if (!applies(cfg)) return;
  const ModelFamily& f = cfg.family();
  const std::int64_t E = cfg.num_experts, H = cfg.hidden_size, I = cfg.moe_intermediate_size;
  using torch::indexing::None;
  using torch::indexing::Slice;
  for (std::int64_t layer = 0; layer < cfg.num_hidden_layers; ++layer) {
    if (!cfg.sparse_layer(layer)) continue;
    const torch::Tensor gate_up = take(tensors, stacked(f, layer, "gate_up_proj"), {E, H, 2 * I});
    const torch::Tensor gate_up_bias = take(tensors, stacked(f, layer, "gate_up_proj_bias"), {E, 2 * I});
    const torch::Tensor down = take(tensors, stacked(f, layer, "down_proj"), {E, I, H});
    const torch::Tensor down_bias = take(tensors, stacked(f, layer, "down_proj_bias"), {E, H});
    for (std::int64_t e = 0; e < E; ++e) {
      const std::string gate = f.expert_module(layer, e, Projection::gate);
      const std::string up = f.expert_module(layer, e, Projection::up);
      const std::string down_name = f.expert_module(layer, e, Projection::down);
      // x @ W[e] with W [H, 2I]: gate is W's even columns, up its odd ones; rlloop's Linear holds [out, in].
      if (gate_up.defined()) {
        tensors[gate + ".weight"] = gate_up[e].index({Slice(), Slice(0, None, 2)}).t().contiguous();
        tensors[up + ".weight"] = gate_up[e].index({Slice(), Slice(1, None, 2)}).t().contiguous();
      }
      if (gate_up_bias.defined()) {
        tensors[gate + ".bias"] = gate_up_bias[e].index({Slice(0, None, 2)}).contiguous();
        tensors[up + ".bias"] = gate_up_bias[e].index({Slice(1, None, 2)}).contiguous();
      }
      if (down.defined()) tensors[down_name + ".weight"] = down[e].t().contiguous();
      if (down_bias.defined()) tensors[down_name + ".bias"] = down_bias[e].contiguous();
    }
  }
}

void experts_to_file_layout(const ModelConfig& cfg, TensorMap& tensors) {
  if (!applies(cfg)) return;
  const ModelFamily& f = cfg.family();
  const std::int64_t E = cfg.num_experts;
  // Takes expert e's tensor; every one must be there (the model wrote them).
  auto own = [&](std::int64_t layer, std::int64_t e, Projection p, const char* suffix) {
    const std::string name = f.expert_module(layer, e, p) + suffix;
    auto it = tensors.find(name);
    if (it == tensors.end()) throw std::logic_error("experts_to_file_layout: no tensor '" + name + "'");
    torch::Tensor t = it->second;
    tensors.erase(it);
    return t;
  };
  for (std::int64_t layer = 0; layer < cfg.num_hidden_layers; ++layer) {
    if (!cfg.sparse_layer(layer)) continue;
    std::vector<torch::Tensor> gate_up, gate_up_bias, down, down_bias;
    for (std::int64_t e = 0; e < E; ++e) {
      const torch::Tensor gate = own(layer, e, Projection::gate, ".weight");
      const torch::Tensor up = own(layer, e, Projection::up, ".weight");
      // [I, H] twice -> [H, I, 2] -> [H, 2I]: gate at the even columns, up at the odd ones.
      gate_up.push_back(torch::stack({gate.t(), up.t()}, -1).reshape({gate.size(1), 2 * gate.size(0)}));
      const torch::Tensor gb = own(layer, e, Projection::gate, ".bias"), ub = own(layer, e, Projection::up, ".bias");
      gate_up_bias.push_back(torch::stack({gb, ub}, -1).reshape({2 * gb.size(0)}));
      down.push_back(own(layer, e, Projection::down, ".weight").t());
      down_bias.push_back(own(layer, e, Projection::down, ".bias"));
    }
    tensors[stacked(f, layer, "gate_up_proj")] = torch::stack(gate_up);
    tensors[stacked(f, layer, "gate_up_proj_bias")] = torch::stack(gate_up_bias);
    tensors[stacked(f, layer, "down_proj")] = torch::stack(down).contiguous();
    tensors[stacked(f, layer, "down_proj_bias")] = torch::stack(down_bias);
  }
}

}  // namespace rlloop::engine
