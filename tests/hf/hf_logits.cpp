// hf_logits MODEL TOKENS [--adapter DIR] [--random-lora SEED] [--logprobs] [--quantized-base] [--export-peft DIR]
//           [--export-merged DIR] [--export-gguf-adapter FILE] [--export-gguf-model FILE] [--gguf-type TYPE]
//           [--export-gguf-adapter-hf-order FILE]
//
// rlloop's side of hf_parity_test.py, gguf_parity_test.py and llama_cpp_agreement.js: loads a Hugging Face model
// directory or a GGUF file (and a PEFT adapter) with the engine, prints the fp32 logits for the comma-separated
// token ids as {"logits": [[...], ...]} (one row per position), and optionally writes the adapter back in PEFT
// layout and the merged model in HF layout, for transformers and peft to read, or both in llama.cpp's GGUF formats.
//   --random-lora SEED  LoRA rank 8, alpha 16 on every linear layer, A as initialised and B drawn from N(0, 0.1²)
//                       with SEED (an adapter whose effect is visible, without training one)
//   --logprobs          instead of logits: TOKENS may hold several sequences separated by ';', and for each
//                       {"logprobs": [...], "argmax": [...], "margin": [...]} per position t < T-1: the log-probability
//                       of token t+1, the most likely next token, and its lead over the second in log-probability
//   --gguf-type TYPE    the merged GGUF model's matrices: F32, F16 (default), BF16 or Q8_0
//   --quantized-base    a GGUF model's matrices kept in their blocks, as LoRA sessions share a base
//                       (quantized_matrix.hpp), instead of dequantized at load
//   --export-gguf-adapter-hf-order FILE
//                       with --export-gguf-adapter: also a copy of that adapter with the rows of B of every q and
//                       k projection in Hugging Face's order, not llama.cpp's: the layout an exporter that forgot
//                       llama.cpp's q/k permutation would write (llama_cpp_agreement.js's negative control)
#include <algorithm>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <ATen/CPUGeneratorImpl.h>
#include <rlloop/gguf.hpp>

#include "io/gguf_export.hpp"
#include "io/gguf_model.hpp"
#include "io/model_io.hpp"

namespace {

using namespace rlloop::engine;

constexpr const char* kUsage =
    "usage: hf_logits MODEL TOKENS [--adapter DIR] [--random-lora SEED] [--logprobs] [--quantized-base]\n"
    "                 [--export-peft DIR]"
    "\n"
    "                 [--export-merged DIR] [--export-gguf-adapter FILE] [--export-gguf-model FILE] [--gguf-type T]\n"
    "                 [--export-gguf-adapter-hf-order FILE]\n"
    "  TOKENS: comma-separated token ids, e.g. 1,5,9 (with --logprobs: sequences separated by ';')\n";

struct Args {
  std::string model_dir;
  std::vector<std::vector<std::int64_t>> sequences;
  std::string adapter_dir, peft_export_dir, merged_export_dir, gguf_adapter_path, gguf_model_path;
  std::string gguf_adapter_hf_order_path;
  std::string gguf_type = "F16";
  std::optional<std::int64_t> random_lora_seed;
  bool logprobs = false, quantized_base = false;
};

// `text` as an integer, or invalid_argument "not <what>: '<text>'".
std::int64_t parse_integer(const std::string& what, const std::string& text) {
  std::size_t used = 0;
  std::int64_t value = 0;
  try {
    value = std::stoll(text, &used);
  } catch (const std::logic_error&) {  // std::stoll's invalid_argument / out_of_range name no input
    used = std::string::npos;
  }
  if (used != text.size()) throw std::invalid_argument("not " + what + ": '" + text + "'");
  return value;
}

std::vector<std::int64_t> parse_tokens(const std::string& text) {
  std::vector<std::int64_t> ids;
  std::size_t start = 0;
  while (start <= text.size()) {
    std::size_t end = text.find(',', start);
    if (end == std::string::npos) end = text.size();
    ids.push_back(parse_integer("a token id", text.substr(start, end - start)));
    start = end + 1;
  }
  return ids;
}

Args parse_args(int argc, char** argv) {
  if (argc < 3) throw std::invalid_argument("expected MODEL and TOKENS");
  Args args;
  args.model_dir = argv[1];
  const std::string tokens = argv[2];
  for (int i = 3; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--logprobs" || flag == "--quantized-base") {
      (flag == "--logprobs" ? args.logprobs : args.quantized_base) = true;
      continue;
    }
    if (i + 1 >= argc) throw std::invalid_argument(flag + " needs a value");
    const std::string value = argv[++i];
    if (flag == "--adapter")
      args.adapter_dir = value;
    else if (flag == "--export-peft")
      args.peft_export_dir = value;
    else if (flag == "--export-merged")
      args.merged_export_dir = value;
    else if (flag == "--export-gguf-adapter")
      args.gguf_adapter_path = value;
    else if (flag == "--export-gguf-adapter-hf-order")
      args.gguf_adapter_hf_order_path = value;
    else if (flag == "--export-gguf-model")
      args.gguf_model_path = value;
    else if (flag == "--gguf-type")
      args.gguf_type = value;
    else if (flag == "--random-lora")
      args.random_lora_seed = parse_integer("a --random-lora seed", value);
    else
      throw std::invalid_argument("unknown option " + flag);
  }
  std::size_t start = 0;
  while (start <= tokens.size()) {
    std::size_t end = tokens.find(';', start);
    if (end == std::string::npos) end = tokens.size();
    args.sequences.push_back(parse_tokens(tokens.substr(start, end - start)));
    start = end + 1;
  }
  if (!args.gguf_adapter_hf_order_path.empty() && args.gguf_adapter_path.empty())
    throw std::invalid_argument("--export-gguf-adapter-hf-order needs --export-gguf-adapter");
  if (args.sequences.size() > 1 && !args.logprobs)
    throw std::invalid_argument("several sequences (';') need --logprobs");
  return args;
}

// An adapter with a visible effect and no training: B, zero at initialisation, drawn from N(0, 0.1²).
void add_random_lora(Transformer& model, std::int64_t seed) {
  model.enable_lora({.rank = 8, .alpha = 16, .target_modules = {"all-linear"}}, seed);
  auto adapters = model.peft_state_dict();
  auto gen = at::detail::createCPUGenerator(static_cast<std::uint64_t>(seed));
  for (auto& [name, t] : adapters)
    if (name.ends_with(".lora_B.weight")) t = torch::randn(t.sizes(), gen, torch::kFloat32) * 0.1;
  model.load_peft_state_dict(adapters);
}

// A copy of the GGUF LoRA adapter `from` with the rows of B of every q and k projection ("blk.N.attn_q.weight.lora_b",
// shape [rank, out] in ggml's order: out rows of rank values) moved back to Hugging Face's order. llama.cpp's
// converter (LlamaModel.permute) stores q and k with the two halves of each head interleaved, so that its RoPE pairs
// adjacent values: row h*d + 2i + j of the file is row h*d + j*d/2 + i of Hugging Face's weight (d = head_dim,
// i < d/2, j = 0 or 1). An adapter in Hugging Face's order is thus a plausible bug that keeps every shape.
void write_adapter_in_hf_order(const std::string& from, const std::string& to, std::int64_t heads,
                               std::int64_t kv_heads) {
  namespace gguf = rlloop::gguf;
  const auto file = gguf::File::open(from);
  std::vector<gguf::TensorData> tensors;
  int moved = 0;
  for (const auto& t : file.tensors()) {
    const auto bytes = file.bytes(t);
    gguf::TensorData out{t.name, t.shape, t.type, {bytes.begin(), bytes.end()}};
    const bool q = t.name.ends_with(".attn_q.weight.lora_b"), k = t.name.ends_with(".attn_k.weight.lora_b");
    if (q || k) {
      const std::int64_t rows = t.shape.at(1), d = rows / (q ? heads : kv_heads);
      const std::size_t row_bytes = bytes.size() / static_cast<std::size_t>(rows);
      for (std::int64_t h = 0; h < rows / d; ++h)
        for (std::int64_t i = 0; i < d / 2; ++i)
          for (std::int64_t j = 0; j < 2; ++j)
            std::copy_n(bytes.begin() + static_cast<std::ptrdiff_t>((h * d + 2 * i + j) * row_bytes), row_bytes,
                        out.bytes.begin() + static_cast<std::ptrdiff_t>((h * d + j * d / 2 + i) * row_bytes));
      ++moved;
    }
    tensors.push_back(std::move(out));
  }
  if (moved == 0) throw std::runtime_error(from + ": no q or k adapter to put in Hugging Face's order");
  gguf::write(to, file.metadata(), tensors, static_cast<std::uint32_t>(file.alignment()));
}

// Per position t < T-1: log p(token t+1), the argmax, and its lead over the runner-up (log-probabilities).
nlohmann::json logprob_summary(const torch::Tensor& logits, const std::vector<std::int64_t>& tokens) {
  const auto logp = torch::log_softmax(logits.to(torch::kFloat64), -1);
  const auto top = logp.topk(2, -1);
  const auto values = std::get<0>(top), indices = std::get<1>(top);
  nlohmann::json out{{"logprobs", nlohmann::json::array()}, {"argmax", nlohmann::json::array()},
                     {"margin", nlohmann::json::array()}};
  for (std::size_t t = 0; t + 1 < tokens.size(); ++t) {
    const auto row = static_cast<std::int64_t>(t);
    out["logprobs"].push_back(logp[row][tokens[t + 1]].item<double>());
    out["argmax"].push_back(indices[row][0].item<std::int64_t>());
    out["margin"].push_back((values[row][0] - values[row][1]).item<double>());
  }
  return out;
}

// peft's adapter directory (save_pretrained of make_models.py: plain LoRA, one rank and alpha for every module)
// onto `model`. The library only writes this layout (save_peft_adapter); reading it is this parity check's need.
void load_peft_adapter(Transformer& model, const std::string& dir) {
  const std::filesystem::path d(dir);
  std::ifstream in(d / "adapter_config.json");
  if (!in) throw std::runtime_error("cannot read " + (d / "adapter_config.json").string());
  const auto cfg = nlohmann::json::parse(in);
  if (cfg.value("peft_type", "LORA") != "LORA" || cfg.value("use_dora", false) || cfg.value("use_rslora", false))
    throw std::runtime_error(dir + ": not a plain LoRA adapter");
  const auto& modules = cfg.at("target_modules");
  const int rank = cfg.at("r").get<int>(), alpha = cfg.at("lora_alpha").get<int>();
  std::vector<std::string> targets = modules.is_string() ? std::vector<std::string>{modules.get<std::string>()}
                                                         : modules.get<std::vector<std::string>>();
  // PEFT may list full module paths ("model.layers.0.self_attn.v_proj"; it does for gpt-oss's all-linear): the
  // module names are their last components.
  std::set<std::string> names;
  for (const auto& t : targets) names.insert(t.substr(t.rfind('.') + 1));
  targets.assign(names.begin(), names.end());
  // A model with experts: PEFT's stacked-expert targets back to the module names rlloop takes (save_peft_adapter
  // writes them so); the fused gate_up must carry PEFT's doubled rank and alpha, the one layout rlloop has.
  for (const auto& p : cfg.value("target_parameters", nlohmann::json::array())) {
    const std::string name = p.get<std::string>();
    if (name == "gate_up_proj") {
      const nlohmann::json ranks = {{".*\\.gate_up_proj", 2 * rank}}, alphas = {{".*\\.gate_up_proj", 2 * alpha}};
      const nlohmann::json none;
      if (cfg.value("rank_pattern", none) != ranks || cfg.value("alpha_pattern", none) != alphas)
        throw std::runtime_error(dir + ": gate_up_proj's rank and alpha are not twice r and lora_alpha");
      targets.insert(targets.end(), {"gate_proj", "up_proj"});
    } else if (name == "down_proj" || name == "gate.weight" || name == "router.weight") {
      targets.push_back(name == "down_proj" ? "down_proj" : name.substr(0, name.find('.')));  // Qwen's / gpt-oss's
    } else {
      throw std::runtime_error(dir + ": target parameter '" + name + "' is not one rlloop adapts");
    }
  }
  model.enable_lora({.rank = rank, .alpha = alpha, .target_modules = targets},
                    /*seed=*/0);  // every adapter tensor is replaced next
  model.load_peft_state_dict(read_safetensors((d / "adapter_model.safetensors").string()));
}

// The logits of `tokens` and, for a model with experts, its router's metrics ("router": router_metrics' without
// the "router/" prefix). %.9g round-trips a float exactly, so the comparison sees the engine's own numbers.
void print_logits(Transformer& model, const std::vector<std::int64_t>& tokens) {
  const torch::Tensor ids = torch::tensor(tokens).unsqueeze(0);
  RouterTotals totals;
  ExpertRouting routing;
  routing.totals = &totals;
  const bool experts = model.config().num_experts > 0;
  const torch::Tensor logits =
      model.logits(model.hidden_states(ids, nullptr, experts ? &routing : nullptr))[0].contiguous();
  const auto rows = logits.accessor<float, 2>();
  std::printf("{\"logits\":[");
  for (std::int64_t t = 0; t < rows.size(0); ++t) {
    std::printf(t ? ",[" : "[");
    for (std::int64_t v = 0; v < rows.size(1); ++v) std::printf(v ? ",%.9g" : "%.9g", rows[t][v]);
    std::printf("]");
  }
  std::printf("]");
  if (experts) {
    std::printf(",\"router\":{");
    const char* sep = "";
    for (const auto& [name, value] : router_metrics(totals)) {
      std::printf("%s\"%s\":%.17g", sep, name.substr(name.find('/') + 1).c_str(), value);
      sep = ",";
    }
    std::printf("}");
  }
  std::printf("}\n");
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  try {
    args = parse_args(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hf_logits: %s\n%s", e.what(), kUsage);
    return 2;
  }
  try {
    torch::NoGradGuard no_grad;
    auto model = load_model(args.model_dir, torch::kCPU, torch::kFloat32, args.quantized_base);
    if (!args.adapter_dir.empty()) load_peft_adapter(*model, args.adapter_dir);
    if (args.random_lora_seed) add_random_lora(*model, *args.random_lora_seed);
    if (args.logprobs) {
      nlohmann::json out = nlohmann::json::array();
      for (const auto& tokens : args.sequences)
        out.push_back(logprob_summary(model->forward(torch::tensor(tokens).unsqueeze(0))[0], tokens));
      std::printf("%s\n", out.dump().c_str());
    } else {
      print_logits(*model, args.sequences[0]);
    }
    if (!args.peft_export_dir.empty()) save_peft_adapter(*model, args.peft_export_dir, args.model_dir);
    if (!args.merged_export_dir.empty()) save_model(*model, args.merged_export_dir);
    if (!args.gguf_adapter_path.empty()) save_gguf_adapter(*model, args.gguf_adapter_path);
    if (!args.gguf_adapter_hf_order_path.empty()) {
      const auto& c = model->config();
      write_adapter_in_hf_order(args.gguf_adapter_path, args.gguf_adapter_hf_order_path, c.num_attention_heads,
                                c.num_key_value_heads > 0 ? c.num_key_value_heads : c.num_attention_heads);
    }
    if (!args.gguf_model_path.empty()) {
      std::map<std::string, rlloop::gguf::Value> carried;
      if (is_gguf_path(args.model_dir)) carried = rlloop::gguf::File::open(args.model_dir).metadata();
      save_gguf_model(*model, args.gguf_model_path, gguf_export_type(args.gguf_type), carried);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hf_logits: %s\n", e.what());
    return 1;
  }
  return 0;
}
