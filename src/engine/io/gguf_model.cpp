#include "io/gguf_model.hpp"

#include <cstring>
#include <filesystem>
#include <span>

#include <nlohmann/json.hpp>
#include <rlloop/error.hpp>
#include <rlloop/gguf.hpp>

namespace rlloop::engine {
namespace {

// llama.cpp's names of a block's tensors ("blk.N.<name>") and of the others, each with the family's Hugging Face name
// of the same tensor (model_family.hpp; for a block's, the name within layer N). llama.cpp names tensors by role, the
// same in every architecture it shares with rlloop.
using NamePairs = std::vector<std::pair<std::string, std::string>>;

NamePairs block_tensors(const ModelFamily& family) {
  const WeightNames& n = family.names;
  NamePairs out = {{"attn_norm.weight", n.input_norm + ".weight"},
                   {"attn_q_norm.weight", n.q_norm + ".weight"},
                   {"attn_k_norm.weight", n.k_norm + ".weight"},
                   {family.gguf_post_norm + ".weight", n.post_norm + ".weight"}};
  const char* const gguf_projections[kNumProjections] = {"attn_q",   "attn_k", "attn_v",  "attn_output",
                                                         "ffn_gate", "ffn_up", "ffn_down"};
  for (Projection p : kProjections) {
    const auto j = static_cast<std::size_t>(p);
    for (const char* kind : {".weight", ".bias"})
      out.emplace_back(std::string(gguf_projections[j]) + kind, n.projections[j] + kind);
  }
  if (family.experts) out.emplace_back("ffn_gate_inp.weight", n.router + ".weight");
  if (family.experts && family.expert_style.router_bias) out.emplace_back("ffn_gate_inp.bias", n.router + ".bias");
  if (family.attention_sinks) out.emplace_back("attn_sinks.weight", n.sinks);
  if (family.sandwich_norms) {  // llama.cpp's gemma2: the norms of attention's and the MLP's outputs
    out.emplace_back("post_attention_norm.weight", n.attn_out_norm + ".weight");
    out.emplace_back("post_ffw_norm.weight", n.mlp_out_norm + ".weight");
  }
  return out;
}

// A sparse block's experts, stacked in one tensor per projection: "blk.N.ffn_gate_exps.weight" [E, out, in], and
// with biases (gpt-oss) "blk.N.ffn_gate_exps.bias" [E, out].
struct ExpertStack {
  std::int64_t layer;
  Projection projection;
  std::string suffix;  // ".weight" or ".bias"
};
constexpr std::pair<const char*, Projection> kExpertStacks[] = {
    {"ffn_gate_exps", Projection::gate}, {"ffn_up_exps", Projection::up}, {"ffn_down_exps", Projection::down}};

// The block index of "blk.N.<rest>" and its rest, or nullopt.
std::optional<std::pair<std::int64_t, std::string>> block_of(const std::string& name) {
  if (name.rfind("blk.", 0) != 0) return std::nullopt;
  const auto dot = name.find('.', 4);
  if (dot == std::string::npos || dot == 4 || dot >= 4 + 9 || name.find_first_not_of("0123456789", 4) != dot)
    return std::nullopt;
  return std::pair{std::stoll(name.substr(4, dot - 4)), name.substr(dot + 1)};
}

std::optional<ExpertStack> expert_stack(const ModelFamily& family, const std::string& name) {
  if (!family.experts) return std::nullopt;
  const auto block = block_of(name);
  if (!block) return std::nullopt;
  for (const auto& [g, p] : kExpertStacks)
    for (const char* suffix : {".weight", ".bias"})
      if (block->second == std::string(g) + suffix) return ExpertStack{block->first, p, suffix};
  return std::nullopt;
}

NamePairs model_tensors(const ModelFamily& family) {
  const WeightNames& n = family.names;
  return {{"token_embd.weight", n.embed + ".weight"},
          {"output_norm.weight", n.final_norm + ".weight"},
          {"output.weight", n.lm_head + ".weight"}};
}

std::string hf_name(const gguf::File& file, const ModelFamily& family, const std::string& name) {
  for (const auto& [g, hf] : model_tensors(family))
    if (name == g) return hf;
  if (const auto block = block_of(name))
    for (const auto& [g, hf] : block_tensors(family))
      if (block->second == g) return family.layer_tensor(block->first, hf);
  throw unsupported("GGUF file '" + file.path() + "': tensor '" + name + "' has no counterpart in rlloop's " +
                    family.model_type + " models");
}

// llama.cpp's converter stores each head's q or k rows (and bias entries) interleaved ([d/2, 2] where Hugging Face
// has [2, d/2]); `to_gguf` does that, the other way puts them back.
torch::Tensor reorder_head_rows(const torch::Tensor& w, std::int64_t heads, bool to_gguf) {
  const auto rows = w.size(0);
  auto sizes = w.sizes().vec();
  std::vector<std::int64_t> split = to_gguf ? std::vector<std::int64_t>{heads, 2, rows / heads / 2}
                                            : std::vector<std::int64_t>{heads, rows / heads / 2, 2};
  split.insert(split.end(), sizes.begin() + 1, sizes.end());
  return w.reshape(split).transpose(1, 2).reshape(sizes).contiguous();
}

// The heads whose rows llama.cpp's converter reorders in the tensor named `gguf_name`: the llama family's q and k
// (weights and biases alike); 0 for every other tensor.
std::int64_t reordered_heads(const ModelConfig& config, const std::string& gguf_name) {
  if (!config.family().gguf_reorders_qk) return 0;
  if (gguf_name.ends_with(".attn_q.weight") || gguf_name.ends_with(".attn_q.bias")) return config.num_attention_heads;
  if (gguf_name.ends_with(".attn_k.weight") || gguf_name.ends_with(".attn_k.bias")) return config.num_key_value_heads;
  return 0;
}

// What llama.cpp's converter adds to the tensor named `gguf_name`: 1 to every norm of a family whose RMSNorm scales
// by (1 + w) (its Gemma converters: llama.cpp's norm multiplies by the stored weight), 0 to anything else.
double gguf_value_shift(const ModelConfig& config, const std::string& gguf_name) {
  return config.family().norm_adds_one && gguf_name.ends_with("norm.weight") ? 1.0 : 0.0;
}

}  // namespace

std::string gguf_expert_stack_name(std::int64_t layer, Projection p, const std::string& suffix) {
  for (const auto& [g, projection] : kExpertStacks)
    if (projection == p) return "blk." + std::to_string(layer) + "." + g + suffix;
  throw std::logic_error("gguf_expert_stack_name: not an expert projection");
}

std::optional<std::string> gguf_tensor_name(const ModelFamily& family, const std::string& name) {
  for (const auto& [g, hf] : model_tensors(family))
    if (name == hf) return g;
  const std::string& prefix = family.names.layer_prefix;
  if (name.rfind(prefix, 0) != 0) return std::nullopt;
  const auto dot = name.find('.', prefix.size());
  if (dot == std::string::npos || dot == prefix.size() ||
      name.find_first_not_of("0123456789", prefix.size()) != dot)
    return std::nullopt;
  const std::string rest = name.substr(dot + 1);
  for (const auto& [g, hf] : block_tensors(family))
    if (rest == hf) return "blk." + name.substr(prefix.size(), dot - prefix.size()) + "." + g;
  return std::nullopt;
}

torch::Tensor to_gguf_layout(const ModelConfig& config, const std::string& gguf_name, const torch::Tensor& t) {
  if (const double shift = gguf_value_shift(config, gguf_name)) return t + shift;
  const std::int64_t heads = reordered_heads(config, gguf_name);
  return heads ? reorder_head_rows(t, heads, /*to_gguf=*/true) : t;
}

bool is_gguf_path(const std::string& path) {
  const std::filesystem::path p(path);
  std::error_code ec;
  return p.extension() == ".gguf" && std::filesystem::is_regular_file(p, ec);
}

ModelConfig gguf_model_config(const gguf::File& file) {
  const std::string arch = file.string("general.architecture");
  const ModelFamily* family = find_gguf_family(arch);
  if (!family) {
    std::string known;
    for (const ModelFamily* f : model_families())
      if (!f->gguf_architecture.empty()) known += (known.empty() ? "" : ", ") + f->gguf_architecture;
    throw unsupported("GGUF file '" + file.path() + "': architecture '" + arch + "' is not supported (" + known +
                      ")");
  }
  auto key = [&](const char* k) { return arch + "." + k; };
  if (family->experts && !file.find(key("expert_count")))
    throw invalid_argument("GGUF file '" + file.path() + "': " + key("expert_count") + " is missing");
  nlohmann::json j;
  if (const auto* scaling = file.find(key("rope.scaling.type"))) {
    const auto* type = std::get_if<std::string>(&scaling->v);
    if (type && *type == "yarn") {
      // As llama.cpp reads it; beta_fast and beta_slow take its defaults when the converter did not write them.
      j["rope_parameters"] = {
          {"rope_type", "yarn"},
          {"rope_theta", file.find(key("rope.freq_base")) ? file.number(key("rope.freq_base")) : 10000.0},
          {"factor", file.number(key("rope.scaling.factor"))},
          {"original_max_position_embeddings", file.integer(key("rope.scaling.original_context_length"))},
          {"beta_fast", file.find(key("rope.scaling.yarn_beta_fast")) ? file.number(key("rope.scaling.yarn_beta_fast"))
                                                                      : 32.0},
          {"beta_slow", file.find(key("rope.scaling.yarn_beta_slow")) ? file.number(key("rope.scaling.yarn_beta_slow"))
                                                                      : 1.0}};
    } else if (!type || *type != "none") {
      throw unsupported("GGUF file '" + file.path() + "': scaled RoPE (" + key("rope.scaling.type") +
                        ") other than yarn is not supported");
    }
  }
  j["model_type"] = family->model_type;
  j["hidden_size"] = file.integer(key("embedding_length"));
  j["intermediate_size"] = file.integer(key("feed_forward_length"));
  j["num_hidden_layers"] = file.integer(key("block_count"));
  j["num_attention_heads"] = file.integer(key("attention.head_count"));
  if (file.find(key("attention.head_count_kv")))
    j["num_key_value_heads"] = file.integer(key("attention.head_count_kv"));
  if (file.find(key("attention.key_length"))) j["head_dim"] = file.integer(key("attention.key_length"));
  j["rms_norm_eps"] = file.number(key("attention.layer_norm_rms_epsilon"));
  if (file.find(key("rope.freq_base"))) j["rope_theta"] = file.number(key("rope.freq_base"));
  if (file.find(key("context_length"))) j["max_position_embeddings"] = file.integer(key("context_length"));
  const auto& embedding = file.tensor("token_embd.weight");
  j["vocab_size"] = file.find(key("vocab_size")) ? file.integer(key("vocab_size")) : embedding.shape.back();
  j["tie_word_embeddings"] = file.find_tensor("output.weight") == nullptr;
  j["attention_bias"] = file.find_tensor("blk.0.attn_q.bias") != nullptr;
  if (file.find("tokenizer.ggml.bos_token_id")) j["bos_token_id"] = file.integer("tokenizer.ggml.bos_token_id");
  if (file.find("tokenizer.ggml.eos_token_id")) j["eos_token_id"] = file.integer("tokenizer.ggml.eos_token_id");
  if (family->experts) {
    // llama.cpp's qwen3moe: its router weights renormalised over the chosen experts (norm_topk_prob), a block
    // without a router a dense one (transformers' mlp_only_layers).
    j["num_experts"] = file.integer(key("expert_count"));
    j["num_experts_per_tok"] = file.integer(key("expert_used_count"));
    j["moe_intermediate_size"] = file.integer(key("expert_feed_forward_length"));
    j["norm_topk_prob"] = true;
    j["mlp_only_layers"] = nlohmann::json::array();
    for (std::int64_t i = 0; i < j["num_hidden_layers"].get<std::int64_t>(); ++i)
      if (!file.find_tensor("blk." + std::to_string(i) + ".ffn_gate_inp.weight")) j["mlp_only_layers"].push_back(i);
  }
  try {
    if (family->read_gguf_config) family->read_gguf_config(file, j);
    return ModelConfig::from_json(j);
  } catch (const error& e) {
    throw invalid_argument("GGUF file '" + file.path() + "': " + e.what());
  }
}

namespace {

// A tensor's values as fp32 in Hugging Face's layout.
torch::Tensor dequantized_tensor(const gguf::File& file, const ModelConfig& config, const gguf::TensorInfo& t) {
  std::vector<std::int64_t> shape(t.shape.rbegin(), t.shape.rend());  // ggml lists the fastest dimension first
  auto values = torch::empty(shape, torch::kFloat32);
  gguf::dequantize(t.type, file.bytes(t), std::span<float>(values.data_ptr<float>(), values.numel()));
  if (const double shift = gguf_value_shift(config, t.name)) values -= shift;
  if (const std::int64_t heads = reordered_heads(config, t.name))
    values = reorder_head_rows(values, heads, /*to_gguf=*/false);
  return values;
}

// A matrix's blocks copied out of the file (which may then close), its rows in Hugging Face's order: the row
// reordering of the converter moves whole rows, so it applies to the blocks as to the values.
std::shared_ptr<const QuantizedMatrix> quantized_tensor(const gguf::File& file, const ModelConfig& config,
                                                        const gguf::TensorInfo& t) {
  const auto rows = static_cast<std::int64_t>(t.shape[1]), cols = static_cast<std::int64_t>(t.shape[0]);
  const auto bytes = file.bytes(t);
  auto blocks = torch::empty({rows, static_cast<std::int64_t>(bytes.size()) / rows}, torch::kUInt8);
  if (blocks.numel() != static_cast<std::int64_t>(bytes.size()))
    throw invalid_argument("GGUF file '" + file.path() + "': tensor '" + t.name + "' is not rows of whole blocks");
  std::memcpy(blocks.data_ptr(), bytes.data(), bytes.size());
  if (const std::int64_t heads = reordered_heads(config, t.name))
    blocks = reorder_head_rows(blocks, heads, /*to_gguf=*/false);
  return std::make_shared<const QuantizedMatrix>(t.type, rows, cols, std::move(blocks));
}

}  // namespace

namespace {
// Adds tensor `t` to `out` under Hugging Face's names: an expert stack as each expert's projection.
void add_dense(const gguf::File& file, const ModelConfig& config, const gguf::TensorInfo& t, TensorMap& out) {
  const ModelFamily& family = config.family();
  if (const auto stack = expert_stack(family, t.name)) {
    const torch::Tensor values = dequantized_tensor(file, config, t);  // [E, out, in] or [E, out]
    for (std::int64_t e = 0; e < values.size(0); ++e)
      out.emplace(family.expert_module(stack->layer, e, stack->projection) + stack->suffix, values[e]);
    return;
  }
  out.emplace(hf_name(file, family, t.name), dequantized_tensor(file, config, t));
}
}  // namespace

TensorMap gguf_hf_tensors(const gguf::File& file, const ModelConfig& config) {
  TensorMap out;
  for (const auto& t : file.tensors()) add_dense(file, config, t, out);
  return out;
}

TensorSources gguf_tensor_sources(const gguf::File& file, const ModelConfig& config) {
  TensorSources out;
  for (const auto& t : file.tensors())
    out.emplace(hf_name(file, config.family(), t.name),
                [&file, &config, info = &t] { return dequantized_tensor(file, config, *info); });
  return out;
}

std::shared_ptr<Transformer> load_gguf_model(const std::string& path, torch::Device device, torch::ScalarType dtype,
                                             bool keep_quantized) {
  const auto file = gguf::File::open(path);
  const ModelConfig config = gguf_model_config(file);
  keep_quantized = keep_quantized && device.is_cpu() && dtype == torch::kFloat32;
  QuantizedTensors quantized;
  TensorMap dense;
  try {
    for (const auto& t : file.tensors()) {
      // Expert stacks (and gpt-oss's 2-D stacks of expert biases) are read dense (a quantized base holds the
      // decoder's 2-D matrices only).
      if (keep_quantized && t.shape.size() == 2 && t.type != gguf::TensorType::f32 &&
          !expert_stack(config.family(), t.name))
        quantized.emplace(hf_name(file, config.family(), t.name), quantized_tensor(file, config, t));
      else
        add_dense(file, config, t, dense);
    }
    auto model = std::make_shared<Transformer>(config, torch::TensorOptions().device(device).dtype(dtype), quantized);
    model->load_hf_state_dict(dense);
    return model;
  } catch (const invalid_argument& e) {  // a tensor missing, or of another shape than the metadata's config
    throw invalid_argument("GGUF file '" + path + "': " + e.what());
  }
}

}  // namespace rlloop::engine
