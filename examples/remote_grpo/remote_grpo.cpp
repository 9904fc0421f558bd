// The grpo_arith loop against a training-session URL instead of an in-process LocalSession:
//   1. a short SFT warm start on worked examples,
//   2. GRPO on the same kind of problems, rewarded by the math-answer reward,
//   3. greedy held-out accuracy before and after GRPO, metrics JSONL and an SVG plot.
// The session is a LoRA adapter on the server's base model (the training-session API is LoRA only); nothing
// here links LibTorch. The algorithm code is the same template as in grpo_arith, instantiated on RemoteSession.
//
//   rlloop serve --port 8080 --tenants tenants.json --data-dir /tmp/rlloop-data --threads 2 &
//   remote_grpo --url http://127.0.0.1:8080 --api-key demo-key
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include <CLI/CLI.hpp>

#include <rlloop/remote.hpp>

#include "../common/arith_recipe.hpp"

using namespace rlloop;

namespace {
struct Options {
  std::string url = "http://127.0.0.1:8080";
  std::string api_key;  // bearer key; empty: $RLLOOP_API_KEY, else SigV4 from the AWS environment / ~/.aws
  std::string base_model = "rlloop-small";
  int lora_rank = 32;
  int lora_alpha = 64;
  std::string session_name;
  // The API caps learningRate at 0.01; LoRA wants a larger GRPO step than grpo_arith's full fine-tuning (5e-5).
  examples::ArithRecipe recipe{.sft_steps = 300,
                               .sft_target_loss = 0,  // exactly sft_steps (LoRA at 5e-3 learns fast)
                               .grpo_steps = 40,
                               .group_size = 8,
                               .sft_lr = 5e-3,
                               .grpo_lr = 1e-3,
                               .out_dir = "runs/remote_grpo",
                               .name = "remote_grpo"};
};

}  // namespace

int run(const Options& o);

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"GRPO on synthetic arithmetic against a remote training session (rlloop serve), LoRA on rlloop-small."};
  app.add_option("--url", o.url, "service endpoint, http://host:port");
  app.add_option("--api-key", o.api_key,
                 "bearer key of a tenant (default: $RLLOOP_API_KEY; none: SigV4 from the AWS environment)");
  app.add_option("--base-model", o.base_model, "base model of the service's catalogue");
  app.add_option("--lora-rank", o.lora_rank, "LoRA rank");
  app.add_option("--lora-alpha", o.lora_alpha, "LoRA alpha");
  app.add_option("--sft-steps", o.recipe.sft_steps, "SFT warm-start steps (0: none)");
  app.add_option("--steps,--grpo-steps", o.recipe.grpo_steps, "GRPO steps");
  app.add_option("--difficulty", o.recipe.difficulty, "arithmetic difficulty level 1..6");
  app.add_option("--group-size", o.recipe.group_size, "completions per prompt");
  app.add_option("--problems", o.recipe.grpo_problems, "prompts per GRPO step");
  app.add_option("--eval-problems", o.recipe.eval_problems, "held-out problems for evaluation");
  app.add_option("--seed", o.recipe.seed, "seed for data and sampling");
  app.add_option("--sft-batch", o.recipe.sft_batch, "examples per SFT step");
  app.add_option("--sft-examples", o.recipe.sft_examples,
                 "distinct worked examples SFT cycles through (0: a fresh problem for every example)");
  app.add_option("--sft-carry-slips", o.recipe.sft_carry_slips,
                 "share of SFT worked examples that forget every carry (0: all correct)");
  app.add_option("--sft-lr", o.recipe.sft_lr, "SFT learning rate (at most 0.01)");
  app.add_option("--grpo-lr", o.recipe.grpo_lr, "GRPO learning rate (at most 0.01)");
  app.add_option("--out", o.recipe.out_dir, "where metrics.jsonl and plot.svg go");
  app.add_option("--name", o.session_name, "training-session name (default: a random one)");
  CLI11_PARSE(app, argc, argv);
  if (o.api_key.empty())
    if (const char* k = std::getenv("RLLOOP_API_KEY")) o.api_key = k;
  try {
    return run(o);
  } catch (const std::exception& e) {  // a refused key, an unreachable URL, a failed session: one line, exit 1
    std::fprintf(stderr, "remote_grpo: %s\n", e.what());
    return 1;
  }
}

int run(const Options& o) {
  const auto t0 = std::chrono::steady_clock::now();

  RemoteOptions remote;
  remote.endpoint = o.url;
  if (!o.api_key.empty()) remote.bearer_key = o.api_key;
  ServiceClient<RemoteService> service{RemoteService(remote)};
  SessionOptions session_opts;
  session_opts.base_model = o.base_model;
  session_opts.lora = LoraOptions{o.lora_rank, o.lora_alpha, {"all-linear"}};
  session_opts.name = o.session_name;
  auto client = service.create_training_client(session_opts);
  const auto info = client.get_info();

  std::printf("rlloop remote_grpo: session %s at %s, %s + LoRA rank %d (%lld trainable of %lld parameters) on %s\n",
              info.name.c_str(), o.url.c_str(), info.base_model.c_str(), o.lora_rank,
              static_cast<long long>(info.num_trainable_parameters), static_cast<long long>(info.num_parameters),
              info.device.c_str());
  std::fflush(stdout);
  const auto result = examples::run_arith_recipe(client, o.recipe);

  const auto usage = client.usage();
  const auto adapter = client.save_weights_for_sampler("final").get().path;
  client.session().stop();  // StopTrainingSession: frees the tenant's session slot on the server

  examples::print_arith_summary(result);
  std::printf("adapter: %s\nbilled tokens: %lld training, %lld prefill, %lld sampled\n", adapter.c_str(),
              static_cast<long long>(usage.training), static_cast<long long>(usage.prefill),
              static_cast<long long>(usage.sample));
  std::printf("time:    %.0f s\n", std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return 0;
}
