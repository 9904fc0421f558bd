// `rlloop sample --model DIR --prompt TEXT`: a quick look at what a model writes, and with --timing how fast.
#include <chrono>
#include <cstdio>

#include <CLI/CLI.hpp>

#include <rlloop/local.hpp>
#include <rlloop/rlloop.hpp>

#include "command.hpp"

namespace {
int run(int argc, char** argv) {
  CLI::App app{"Sample continuations of a prompt from a model directory (HF layout), a .gguf file or a built-in "
               "model."};
  std::string model, prompt, device = "auto", dtype = "auto", checkpoint, precision = "fp32";
  int num_samples = 1;
  rlloop::SamplingParams params{.max_tokens = 64};
  std::int64_t seed = 0;
  int threads = 0;
  bool timing = false, dequantize_base = false;
  int lora_rank = 0;
  app.add_option("--model", model, "model directory (config.json + safetensors) or built-in name")->required();
  app.add_option("--prompt", prompt, "prompt text")->required();
  app.add_option("--checkpoint", checkpoint, "a save_state / save_weights_for_sampler directory to load");
  app.add_option("-n,--num-samples", num_samples, "number of samples");
  app.add_option("--max-tokens", params.max_tokens, "tokens to generate per sample");
  app.add_option("--temperature", params.temperature, "0 = greedy");
  app.add_option("--top-k", params.top_k, "-1 = off");
  app.add_option("--top-p", params.top_p, "1 = off");
  app.add_option("--stop", params.stop, "stop strings");
  app.add_option("--seed", seed, "sampling seed");
  app.add_option("--device", device, "auto, cpu, cuda or cuda:N");
  app.add_option("--dtype", dtype, "auto (bf16 on CUDA, fp32 on the CPU), fp32 or bf16");
  app.add_option("--threads", threads, "LibTorch threads (0 = all cores)")->check(CLI::Range(0, 1024));
  app.add_option("--sampling-precision", precision,
                 "fp32, bf16 or int8 (CPU decoding; bf16 is faster with AVX512_BF16; int8 with --lora-rank on a "
                 "quantized .gguf base)")
      ->check(CLI::IsMember({"fp32", "bf16", "int8"}));
  app.add_option("--lora-rank", lora_rank,
                 "sample through a LoRA session of this rank (its adapter untrained unless --checkpoint loads one), "
                 "over the shared base training sessions use; 0 = a full model")
      ->check(CLI::Range(0, 4096));
  app.add_flag("--dequantize-base", dequantize_base,
               "with --lora-rank on a .gguf model: dequantize the base to fp32 at load instead of reading its "
               "quantized blocks in each product");
  app.add_flag("--timing", timing,
               "print the tokens sampled per second (after a warm-up request; the model load is not counted)");
  CLI11_PARSE(app, argc, argv);
  params.seed = seed;

  rlloop::configure_engine_process({.num_threads = threads});
  rlloop::LocalServiceOptions opts;
  opts.device = device;
  opts.dtype = dtype;
  opts.sampling_precision = rlloop::sampling_precision_from(precision);
  opts.quantized_base = !dequantize_base;
  rlloop::ServiceClient<rlloop::LocalService> service{rlloop::LocalService(opts)};
  rlloop::SessionOptions session{.base_model = model};
  if (lora_rank > 0) session.lora = rlloop::LoraOptions{.rank = lora_rank, .alpha = 2 * lora_rank};
  auto tc = service.create_training_client(session);
  if (!checkpoint.empty()) tc.load_state(checkpoint, false).get();
  auto tokenizer = rlloop::load_tokenizer(tc);
  auto ids = tokenizer->encode(prompt);
  auto sampler = tc.live_sampling_client();
  const auto input = rlloop::ModelInput::from_tokens(ids);
  // The first request builds the sampler's weights; timing it would measure that, not sampling.
  if (timing) sampler.sample(input, 1, {.max_tokens = 2}).get();
  const auto start = std::chrono::steady_clock::now();
  auto resp = sampler.sample(input, num_samples, params).get();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (std::size_t i = 0; i < resp.sequences.size(); ++i) {
    const auto& s = resp.sequences[i];
    double sum = 0;
    for (double lp : s.logprobs) sum += lp;
    std::printf("--- sample %zu (%zu tokens, stop: %s, logprob %.3f)\n%s%s\n", i, s.tokens.size(),
                rlloop::to_string(s.stop_reason), sum, prompt.c_str(), tokenizer->decode(s.tokens).c_str());
  }
  if (timing) {
    std::size_t tokens = 0;
    for (const auto& s : resp.sequences) tokens += s.tokens.size();
    std::printf("timing: %zu sequences, %zu tokens sampled in %.3f s (prompt of %zu tokens prefilled once): %.1f "
                "tokens/s\n", resp.sequences.size(), tokens, seconds, ids.size(), static_cast<double>(tokens) / seconds);
  }
  return 0;
}
const rlloop::cli::RegisterCommand reg({"sample", "sample continuations of a prompt from a model", &run});
}  // namespace
