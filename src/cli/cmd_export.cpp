// `rlloop export --checkpoint DIR ...`: a saved session (save_state or save_weights_for_sampler, local or from
// `rlloop serve`'s data directory) written out in another format: a GGUF LoRA adapter for llama.cpp, a merged GGUF
// model (for a GGUF base), a PEFT adapter directory or a merged Hugging Face directory. `rlloop export
// --hf-tokenizer DIR --model FILE.gguf`: a GGUF file's tokenizer as Hugging Face tokenizer files.
#include <cstdio>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include <rlloop/hf_tokenizer.hpp>
#include <rlloop/local.hpp>

#include "base_models.hpp"
#include "command.hpp"

namespace {

int run(int argc, char** argv) {
  CLI::App app{"Write a saved session's weights as a GGUF LoRA adapter, a GGUF model, a PEFT adapter or an HF "
               "directory."};
  std::string checkpoint, gguf_adapter, gguf_model, type = "F16", peft, merged, hf_tokenizer, model;
  std::vector<std::string> base_models;
  app.add_option("--checkpoint", checkpoint, "the save_state or save_weights_for_sampler directory");
  app.add_option("--base-model", base_models,
                 "NAME=MODEL: where the checkpoint's base model is, when it names a catalogue entry (repeatable)");
  app.add_option("--gguf-adapter", gguf_adapter, "write the LoRA adapters as a GGUF LoRA adapter (llama.cpp --lora)");
  app.add_option("--gguf-model", gguf_model, "write the merged model as a GGUF model (the base must be a .gguf)");
  app.add_option("--type", type, "the GGUF model's matrices: F32, F16, BF16 or Q8_0")
      ->check(CLI::IsMember({"F32", "F16", "BF16", "Q8_0"}, CLI::ignore_case));
  app.add_option("--peft", peft, "write the LoRA adapters as a PEFT adapter directory");
  app.add_option("--merged", merged, "write the merged model as a Hugging Face directory");
  app.add_option("--hf-tokenizer", hf_tokenizer,
                 "write --model's tokenizer as Hugging Face tokenizer files (tokenizer.json, tokenizer_config.json) "
                 "into this directory");
  app.add_option("--model", model, "with --hf-tokenizer: the .gguf file whose tokenizer to write");
  CLI11_PARSE(app, argc, argv);
  const bool from_checkpoint = !gguf_adapter.empty() || !gguf_model.empty() || !peft.empty() || !merged.empty();
  if (!from_checkpoint && hf_tokenizer.empty()) {
    std::fprintf(stderr, "rlloop export: nothing to write (--gguf-adapter, --gguf-model, --peft, --merged or "
                         "--hf-tokenizer)\n");
    return 2;
  }
  if (from_checkpoint && checkpoint.empty()) {
    std::fprintf(stderr, "rlloop export: --gguf-adapter, --gguf-model, --peft and --merged need --checkpoint\n");
    return 2;
  }
  if (!from_checkpoint && !checkpoint.empty()) {
    std::fprintf(stderr, "rlloop export: --checkpoint without --gguf-adapter, --gguf-model, --peft or --merged\n");
    return 2;
  }
  if (!hf_tokenizer.empty()) {
    if (model.empty()) {
      std::fprintf(stderr, "rlloop export: --hf-tokenizer needs --model FILE.gguf\n");
      return 2;
    }
    rlloop::write_hf_tokenizer(model, hf_tokenizer);
    std::printf("%-13s %s\n", "hf tokenizer:", hf_tokenizer.c_str());
    if (!from_checkpoint) return 0;
  }

  rlloop::configure_engine_process();
  rlloop::LocalServiceOptions options;
  options.device = "cpu";
  options.base_models = rlloop::cli::parse_base_models(base_models);
  rlloop::LocalService service(options);
  // The checkpoint names its base model and its LoRA configuration; the sampler view loads the weights only.
  const auto session = service.open_sampler(checkpoint);
  auto report = [](const char* what, const rlloop::CheckpointRef& ref) {
    std::printf("%-13s %s\n", what, ref.path.c_str());
  };
  if (!gguf_adapter.empty()) report("gguf adapter:", session->export_gguf_adapter(gguf_adapter).get());
  if (!gguf_model.empty()) report("gguf model:", session->export_gguf_model(gguf_model, type).get());
  if (!peft.empty()) report("peft adapter:", session->export_peft_adapter(peft).get());
  if (!merged.empty()) report("merged model:", session->export_merged_model(merged).get());
  return 0;
}

const rlloop::cli::RegisterCommand reg{
    {"export", "write a saved session as a GGUF LoRA adapter or model (llama.cpp), a PEFT adapter or an HF directory",
     run}};

}  // namespace
