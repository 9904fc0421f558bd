// The main demo: teach a small byte-level model (trained from scratch, CPU) to add numbers — SFT warm start,
// GRPO, held-out accuracy before and after, metrics JSONL and an SVG plot. The loop itself is
// examples/common/arith_recipe.hpp, shared with remote_grpo.
#include <chrono>
#include <cstdio>
#include <filesystem>

#include <CLI/CLI.hpp>

#include <rlloop/local.hpp>

#include "../common/arith_recipe.hpp"

using namespace rlloop;

int main(int argc, char** argv) {
  examples::ArithRecipe o;
  std::string device = "auto";
  CLI::App app{"GRPO on synthetic arithmetic with the embedded default model (rlloop-small), on CPU."};
  app.add_option("--sft-steps", o.sft_steps, "SFT warm-start steps at most (all of them with --sft-target-loss 0)");
  app.add_option("--sft-target-loss", o.sft_target_loss,
                 "end SFT once its loss per token, averaged over the last 50 steps, is below this (0: never)");
  app.add_option("--grpo-steps", o.grpo_steps, "GRPO steps");
  app.add_option("--difficulty", o.difficulty, "arithmetic difficulty level 1..6");
  app.add_option("--group-size", o.group_size, "completions per prompt");
  app.add_option("--problems", o.grpo_problems, "prompts per GRPO step");
  app.add_option("--eval-problems", o.eval_problems, "held-out problems for evaluation");
  app.add_option("--seed", o.seed, "seed for data and sampling");
  app.add_option("--sft-batch", o.sft_batch, "examples per SFT step");
  app.add_option("--sft-examples", o.sft_examples,
                 "distinct worked examples SFT cycles through (0: a fresh problem for every example)");
  app.add_option("--sft-carry-slips", o.sft_carry_slips,
                 "share of SFT worked examples that forget every carry (0: all correct)");
  app.add_option("--sft-eval-every", o.sft_eval_every, "held-out evaluation every N SFT steps (0: only after SFT)");
  app.add_option("--sft-lr", o.sft_lr, "SFT learning rate");
  app.add_option("--grpo-lr", o.grpo_lr, "GRPO learning rate");
  app.add_option("--out", o.out_dir, "where metrics.jsonl and plot.svg go");
  app.add_option("--device", device, "auto, cpu, cuda");
  app.add_option("--from-sft", o.from_sft, "skip SFT: load this saved state (e.g. <out>/checkpoints/sft)");
  CLI11_PARSE(app, argc, argv);
  const auto t0 = std::chrono::steady_clock::now();

  configure_engine_process();  // this process: every core, the caching CPU allocator
  LocalServiceOptions svc_opts;
  svc_opts.checkpoint_dir = (std::filesystem::path(o.out_dir) / "checkpoints").string();
  svc_opts.device = device;
  ServiceClient<LocalService> service{LocalService(svc_opts)};
  auto client = service.create_full_training_client("rlloop-small", o.seed);
  std::printf("rlloop grpo_arith: model rlloop-small (%lld parameters) on %s, difficulty %d\n",
              static_cast<long long>(client.get_info().num_parameters), client.get_info().device.c_str(), o.difficulty);

  const auto result = examples::run_arith_recipe(client, o);
  examples::print_arith_summary(result);
  std::printf("time:    %.0f s\n", std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return 0;
}
