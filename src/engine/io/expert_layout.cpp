#include "io/expert_layout.hpp"

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

// The stacked tensor `name` [E, in, out] from its MXFP4 form when the checkpoint holds that instead (OpenAI's gpt-oss
// releases): name_blocks [E, out, in / 32, 16] and name_scales [E, out, in / 32] (dequantize_mxfp4), as transformers'
// convert_moe_packed_tensors reads them. Undefined when neither form is there.
torch::Tensor take_stacked(TensorMap& tensors, const std::string& name, std::int64_t E, std::int64_t in,
                           std::int64_t out) {
  torch::Tensor t = take(tensors, name, {E, in, out});
  if (t.defined() || !tensors.count(name + "_blocks")) return t;
  if (in % 32 != 0)
    throw invalid_argument("load_model: '" + name + "_blocks': MXFP4 needs an input width divisible by 32, got " +
                           std::to_string(in));
  const torch::Tensor blocks = take(tensors, name + "_blocks", {E, out, in / 32, 16});
  const torch::Tensor scales = take(tensors, name + "_scales", {E, out, in / 32});
  if (!scales.defined())
    throw invalid_argument("load_model: '" + name + "_blocks' comes without '" + name + "_scales'");
  return dequantize_mxfp4(blocks, scales).transpose(1, 2);
}

}  // namespace

torch::Tensor dequantize_mxfp4(const torch::Tensor& blocks, const torch::Tensor& scales) {
  if (blocks.scalar_type() != torch::kUInt8 || scales.scalar_type() != torch::kUInt8)
    throw invalid_argument("dequantize_mxfp4: blocks and scales must be uint8");
  if (blocks.dim() < 2 || blocks.size(-1) != 16 || !scales.sizes().equals(blocks.sizes().slice(0, blocks.dim() - 1)))
    throw invalid_argument("dequantize_mxfp4: blocks must be [..., G, 16] and scales [..., G], got " +
                           shape_of(blocks) + " and " + shape_of(scales));
  // FP4 E2M1: sign, two exponent bits, one mantissa bit; code c is the value FP4[c].
  static const std::vector<float> fp4 = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                         -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  // bf16 holds every value exactly (an FP4 value has two significant bits, a scale is a power of two within bf16's
  // exponent range but for the extreme 2^128): half fp32's memory, which matters at gpt-oss-120b's 117B weights.
  const torch::Tensor lut = torch::tensor(fp4).to(torch::kBFloat16);
  const torch::Tensor codes = blocks.to(torch::kInt32).flatten();  // index_select takes int32 indices
  const torch::Tensor low = lut.index_select(0, codes.bitwise_and(15));
  const torch::Tensor high = lut.index_select(0, codes.div(16, "floor"));
  std::vector<std::int64_t> shape(scales.sizes().begin(), scales.sizes().end());
  shape.push_back(32);
  const torch::Tensor values = torch::stack({low, high}, -1).reshape(shape);  // the low nibble first
  // A block's scale is 2^(byte - 127) (denormal at the low end in fp32, as ldexp gives it).
  const torch::Tensor scale = torch::pow(2.0, scales.to(torch::kFloat64) - 127).to(torch::kBFloat16);
  shape.pop_back();
  shape.back() *= 32;
  return (values * scale.unsqueeze(-1)).reshape(shape);
}

void experts_to_model_layout(const ModelConfig& cfg, TensorMap& tensors) {
  if (!applies(cfg)) return;
  const ModelFamily& f = cfg.family();
  const std::int64_t E = cfg.num_experts, H = cfg.hidden_size, I = cfg.moe_intermediate_size;
  using torch::indexing::None;
  using torch::indexing::Slice;
  for (std::int64_t layer = 0; layer < cfg.num_hidden_layers; ++layer) {
    if (!cfg.sparse_layer(layer)) continue;
    const torch::Tensor gate_up = take_stacked(tensors, stacked(f, layer, "gate_up_proj"), E, H, 2 * I);
    const torch::Tensor gate_up_bias = take(tensors, stacked(f, layer, "gate_up_proj_bias"), {E, 2 * I});
    const torch::Tensor down = take_stacked(tensors, stacked(f, layer, "down_proj"), E, I, H);
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

torch::Tensor take_expert_stack(const ModelConfig& cfg, TensorMap& tensors, std::int64_t layer, Projection p,
                                const std::string& suffix) {
  const ModelFamily& f = cfg.family();
  std::vector<torch::Tensor> experts;
  for (std::int64_t e = 0; e < cfg.num_experts; ++e) {
    const std::string name = f.expert_module(layer, e, p) + suffix;
    auto it = tensors.find(name);
    if (it == tensors.end()) throw std::logic_error("take_expert_stack: no tensor '" + name + "'");
    experts.push_back(it->second);
    tensors.erase(it);
  }
  return torch::stack(experts);
}

void experts_to_file_layout(const ModelConfig& cfg, TensorMap& tensors) {
  if (!applies(cfg)) return;
  const ModelFamily& f = cfg.family();
  for (std::int64_t layer = 0; layer < cfg.num_hidden_layers; ++layer) {
    if (!cfg.sparse_layer(layer)) continue;
    auto take = [&](Projection p, const char* suffix) { return take_expert_stack(cfg, tensors, layer, p, suffix); };
    const torch::Tensor gate = take(Projection::gate, ".weight"), up = take(Projection::up, ".weight");  // [E, I, H]
    const torch::Tensor gate_bias = take(Projection::gate, ".bias"), up_bias = take(Projection::up, ".bias");
    const std::int64_t E = gate.size(0), I = gate.size(1), H = gate.size(2);
    // [E, H, I] twice -> [E, H, I, 2] -> [E, H, 2I]: gate at the even columns, up at the odd ones.
    tensors[stacked(f, layer, "gate_up_proj")] =
        torch::stack({gate.transpose(1, 2), up.transpose(1, 2)}, -1).reshape({E, H, 2 * I});
    tensors[stacked(f, layer, "gate_up_proj_bias")] = torch::stack({gate_bias, up_bias}, -1).reshape({E, 2 * I});
    tensors[stacked(f, layer, "down_proj")] = take(Projection::down, ".weight").transpose(1, 2).contiguous();
    tensors[stacked(f, layer, "down_proj_bias")] = take(Projection::down, ".bias");
  }
}

}  // namespace rlloop::engine
