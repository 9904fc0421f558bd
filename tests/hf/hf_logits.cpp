// hf_logits MODEL_DIR TOKENS [--adapter DIR] [--export-peft DIR] [--export-merged DIR]
//
// rlloop's side of hf_parity_test.py: loads a Hugging Face model directory (and a PEFT adapter) with the engine,
// prints the fp32 logits for the comma-separated token ids as {"logits": [[...], ...]} (one row per position),
// and optionally writes the adapter back in PEFT layout and the merged model in HF layout, for transformers and
// peft to read.
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include "model_io.hpp"

namespace {

using namespace rlloop::engine;

constexpr const char* kUsage =
    "usage: hf_logits MODEL_DIR TOKENS [--adapter DIR] [--export-peft DIR] [--export-merged DIR]\n"
    "  TOKENS: comma-separated token ids, e.g. 1,5,9\n";

struct Args {
  std::string model_dir;
  std::vector<std::int64_t> tokens;
  std::string adapter_dir, peft_export_dir, merged_export_dir;
};

std::vector<std::int64_t> parse_tokens(const std::string& text) {
  std::vector<std::int64_t> ids;
  std::size_t start = 0;
  while (start <= text.size()) {
    std::size_t end = text.find(',', start);
    if (end == std::string::npos) end = text.size();
    const std::string id = text.substr(start, end - start);
    std::size_t used = 0;
    try {
      ids.push_back(std::stoll(id, &used));
    } catch (const std::logic_error&) {  // std::stoll's invalid_argument / out_of_range name no input
      used = std::string::npos;
    }
    if (used != id.size()) throw std::invalid_argument("not a token id: '" + id + "'");
    start = end + 1;
  }
  return ids;
}

Args parse_args(int argc, char** argv) {
  if (argc < 3) throw std::invalid_argument("expected MODEL_DIR and TOKENS");
  Args args{argv[1], parse_tokens(argv[2]), "", "", ""};
  for (int i = 3; i < argc; i += 2) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) throw std::invalid_argument(flag + " needs a directory");
    if (flag == "--adapter")
      args.adapter_dir = argv[i + 1];
    else if (flag == "--export-peft")
      args.peft_export_dir = argv[i + 1];
    else if (flag == "--export-merged")
      args.merged_export_dir = argv[i + 1];
    else
      throw std::invalid_argument("unknown option " + flag);
  }
  return args;
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
  model.enable_lora({.rank = cfg.at("r").get<int>(),
                     .alpha = cfg.at("lora_alpha").get<int>(),
                     .target_modules = modules.is_string() ? std::vector<std::string>{modules.get<std::string>()}
                                                           : modules.get<std::vector<std::string>>()},
                    /*seed=*/0);  // every adapter tensor is replaced next
  model.load_peft_state_dict(read_safetensors((d / "adapter_model.safetensors").string()));
}

// %.9g round-trips a float exactly, so the comparison sees the engine's own numbers.
void print_logits(const torch::Tensor& logits) {
  const auto rows = logits.accessor<float, 2>();
  std::printf("{\"logits\":[");
  for (std::int64_t t = 0; t < rows.size(0); ++t) {
    std::printf(t ? ",[" : "[");
    for (std::int64_t v = 0; v < rows.size(1); ++v) std::printf(v ? ",%.9g" : "%.9g", rows[t][v]);
    std::printf("]");
  }
  std::printf("]}\n");
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
    auto model = load_model(args.model_dir, torch::kCPU, torch::kFloat32);
    if (!args.adapter_dir.empty()) load_peft_adapter(*model, args.adapter_dir);
    print_logits(model->forward(torch::tensor(args.tokens).unsqueeze(0))[0].contiguous());
    if (!args.peft_export_dir.empty()) save_peft_adapter(*model, args.peft_export_dir, args.model_dir);
    if (!args.merged_export_dir.empty()) save_model(*model, args.merged_export_dir);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hf_logits: %s\n", e.what());
    return 1;
  }
  return 0;
}
