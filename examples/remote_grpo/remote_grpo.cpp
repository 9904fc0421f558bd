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
#include <unistd.h>

#include <CLI/CLI.hpp>

#include <rlloop/algorithms/eval.hpp>
#include <rlloop/algorithms/grpo.hpp>
#include <rlloop/algorithms/sft.hpp>
#include <rlloop/envs/arithmetic.hpp>
#include <rlloop/metrics.hpp>
#include <rlloop/remote.hpp>
#include <rlloop/rewards/math.hpp>
#include <rlloop/rlloop.hpp>

using namespace rlloop;
namespace fs = std::filesystem;

namespace {
struct Options {
  std::string url = "http://127.0.0.1:8080";
  std::string api_key;  // bearer key; empty: $RLLOOP_API_KEY, else SigV4 from the AWS environment / ~/.aws
  std::string base_model = "rlloop-small";
  int lora_rank = 32;
  int lora_alpha = 64;
  int sft_steps = 300;
  int grpo_steps = 40;
  int difficulty = 2;
  int sft_batch = 64;
  int grpo_problems = 16;
  int group_size = 8;
  int eval_problems = 200;
  double sft_lr = 5e-3;   // the API caps learningRate at 0.01
  double grpo_lr = 1e-3;  // LoRA wants a larger step than grpo_arith's full fine-tuning (1e-4)
  std::int64_t seed = 1;
  std::string out_dir = "runs/remote_grpo";
  std::string session_name;
};

// A progress line rewritten in place on a terminal, printed every 10 steps otherwise (CI logs).
void progress(const char* phase, int step, int total, const std::string& detail) {
  const bool tty = ::isatty(STDERR_FILENO);
  if (!tty && step % 10 != 0 && step != total) return;
  const int width = 24, filled = total ? width * step / total : width;
  std::fprintf(stderr, "%s%-5s [%s%s] %3d/%-3d %s%s", tty ? "\r" : "", phase, std::string(filled, '#').c_str(),
               std::string(width - filled, '.').c_str(), step, total, detail.c_str(), tty ? "   " : "\n");
  if (tty && step == total) std::fprintf(stderr, "\n");
}

std::string fmt(const char* f, double a, double b = 0) {
  char buf[128];
  std::snprintf(buf, sizeof buf, f, a, b);
  return buf;
}
}  // namespace

int run(const Options& o);

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"GRPO on synthetic arithmetic against a remote training session (rlloop serve), LoRA on rlloop-small."};
  app.add_option("--url", o.url, "service endpoint, http://host:port");
  app.add_option("--api-key", o.api_key, "bearer key of a tenant (default: $RLLOOP_API_KEY; none: SigV4 from the AWS environment)");
  app.add_option("--base-model", o.base_model, "base model of the service's catalogue");
  app.add_option("--lora-rank", o.lora_rank, "LoRA rank");
  app.add_option("--lora-alpha", o.lora_alpha, "LoRA alpha");
  app.add_option("--sft-steps", o.sft_steps, "SFT warm-start steps (0: none)");
  app.add_option("--steps,--grpo-steps", o.grpo_steps, "GRPO steps");
  app.add_option("--difficulty", o.difficulty, "arithmetic difficulty level 1..6");
  app.add_option("--group-size", o.group_size, "completions per prompt");
  app.add_option("--problems", o.grpo_problems, "prompts per GRPO step");
  app.add_option("--eval-problems", o.eval_problems, "held-out problems for evaluation");
  app.add_option("--seed", o.seed, "seed for data and sampling");
  app.add_option("--sft-batch", o.sft_batch, "examples per SFT step");
  app.add_option("--sft-lr", o.sft_lr, "SFT learning rate (at most 0.01)");
  app.add_option("--grpo-lr", o.grpo_lr, "GRPO learning rate (at most 0.01)");
  app.add_option("--out", o.out_dir, "where metrics.jsonl and plot.svg go");
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
  fs::create_directories(o.out_dir);

  RemoteOptions remote;
  remote.endpoint = o.url;
  if (!o.api_key.empty()) remote.bearer_key = o.api_key;
  ServiceClient<RemoteService> service{RemoteService(remote)};
  SessionOptions session_opts;
  session_opts.base_model = o.base_model;
  session_opts.lora = LoraOptions{o.lora_rank, o.lora_alpha, {"all-linear"}};
  session_opts.name = o.session_name;
  auto client = service.create_training_client(session_opts);
  auto tokenizer = client.get_tokenizer();  // the session reports which tokenizer its model uses
  const auto eos = *tokenizer->eos_token_id();
  const auto info = client.get_info();

  envs::ArithmeticTask train_task(envs::ArithmeticOptions::for_difficulty(o.difficulty), o.seed);
  envs::ArithmeticTask eval_task(envs::ArithmeticOptions::for_difficulty(o.difficulty), o.seed + 1000);
  const auto held_out = eval_task.sample(static_cast<std::size_t>(o.eval_problems), envs::Split::held_out);
  const rewards::MathAnswerReward reward;
  const SamplingParams eval_params{.max_tokens = 12, .temperature = 0.0};
  MetricsLog log((fs::path(o.out_dir) / "metrics.jsonl").string());
  auto evaluate = [&] {
    return algorithms::evaluate_greedy(client.live_sampling_client(), *tokenizer, held_out, reward, eval_params);
  };

  std::printf("rlloop remote_grpo: session %s at %s, %s + LoRA rank %d (%lld trainable of %lld parameters) on %s\n",
              info.name.c_str(), o.url.c_str(), info.base_model.c_str(), o.lora_rank,
              static_cast<long long>(info.num_trainable_parameters), static_cast<long long>(info.num_parameters),
              info.device.c_str());
  std::fflush(stdout);

  // 1. SFT warm start: prompt -> "#### N" + EOS.
  algorithms::Sft<RemoteSession> sft(client, {.adam = {.learning_rate = o.sft_lr, .beta2 = 0.99}});
  for (int s = 1; s <= o.sft_steps; ++s) {
    std::vector<Datum> batch;
    for (const auto& p : train_task.sample(static_cast<std::size_t>(o.sft_batch), envs::Split::train)) {
      auto completion = tokenizer->encode(p.target);
      completion.push_back(eos);
      batch.push_back(algorithms::completion_datum(tokenizer->encode(p.prompt), completion));
    }
    auto st = sft.step(batch);
    log.write({{"phase", "sft"}, {"step", s}, {"loss", st.loss_per_token}});
    progress("sft", s, o.sft_steps, fmt("loss %.3f", st.loss_per_token));
  }
  if (o.sft_steps > 0) {
    // Saved on the server; the path is the model-package ARN. Reloading the weights alone gives GRPO fresh Adam
    // moments, as in grpo_arith.
    const auto saved = client.save_state("sft").get().path;
    std::printf("SFT state saved as %s\n", saved.c_str());
    client.load_state(saved, /*with_optimizer=*/false).get();
  }
  const auto before = evaluate();
  log.write({{"phase", "eval"}, {"step", 0}, {"accuracy", before.accuracy}});
  std::printf("held-out accuracy after SFT: %.3f\n", before.accuracy);
  std::fflush(stdout);

  // 2. GRPO: sampling, scoring here, ppo updates on the server.
  algorithms::GRPO<RemoteSession> grpo(client, tokenizer,
                                       {.group_size = o.group_size,
                                        .sampling = {.max_tokens = 10, .temperature = 1.0, .seed = o.seed},
                                        .loss = LossFn::ppo,
                                        .adam = {.learning_rate = o.grpo_lr, .beta2 = 0.99}});
  for (int s = 1; s <= o.grpo_steps; ++s) {
    auto st = grpo.step(train_task.sample(static_cast<std::size_t>(o.grpo_problems), envs::Split::train), reward);
    nlohmann::json rec{{"phase", "grpo"},         {"step", s},
                       {"reward", st.reward_mean}, {"reward_std", st.reward_std},
                       {"train_accuracy", st.accuracy}, {"groups_used", st.groups_used},
                       {"loss", st.loss},          {"clip_fraction", st.clip_fraction},
                       {"entropy", st.entropy},    {"sampled_tokens", st.sampled_tokens},
                       {"seconds_sampling", st.seconds_sampling}, {"seconds_training", st.seconds_training}};
    if (s % 20 == 0 || s == o.grpo_steps) rec["accuracy"] = evaluate().accuracy;
    log.write(rec);
    progress("grpo", s, o.grpo_steps, fmt("reward %.3f  groups %.0f", st.reward_mean, st.groups_used));
  }
  const auto after = evaluate();
  std::vector<nlohmann::json> grpo_records;
  for (const auto& r : log.records())
    if (r["phase"] == "grpo") grpo_records.push_back(r);
  const auto plot = (fs::path(o.out_dir) / "plot.svg").string();
  write_svg_plot(plot, grpo_records, {"reward", "train_accuracy", "accuracy"}, "step",
                 "remote_grpo: reward and held-out accuracy per GRPO step");

  const auto usage = client.usage();
  const auto adapter = client.save_weights_for_sampler("final").get().path;
  client.session().stop();  // StopTrainingSession: frees the tenant's session slot on the server

  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("held-out accuracy after SFT:  %.3f\n", before.accuracy);
  std::printf("held-out accuracy after GRPO: %.3f  (%+.3f)\n", after.accuracy, after.accuracy - before.accuracy);
  for (std::size_t i = 0; i < 3 && i < held_out.size(); ++i)
    std::printf("  %s%s   (expected %s)\n", held_out[i].prompt.c_str(), after.completions[i].c_str(),
                held_out[i].answer.c_str());
  std::printf("adapter: %s\nbilled tokens: %lld training, %lld prefill, %lld sampled\n", adapter.c_str(),
              static_cast<long long>(usage.training), static_cast<long long>(usage.prefill),
              static_cast<long long>(usage.sample));
  std::printf("metrics: %s\nplot:    %s\ntime:    %.0f s\n", log.path().c_str(), plot.c_str(), secs);
  return 0;
}
