// The main demo: teach a small byte-level model (trained from scratch, CPU) to add numbers.
//   1. a short SFT warm start on worked examples,
//   2. GRPO on the same kind of problems, rewarded by the math-answer reward,
//   3. greedy held-out accuracy before and after GRPO, metrics JSONL and an SVG plot.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <unistd.h>

#include <CLI/CLI.hpp>

#include <rlloop/algorithms/eval.hpp>
#include <rlloop/algorithms/grpo.hpp>
#include <rlloop/algorithms/sft.hpp>
#include <rlloop/envs/arithmetic.hpp>
#include <rlloop/local.hpp>
#include <rlloop/metrics.hpp>
#include <rlloop/rewards/math.hpp>
#include <rlloop/rlloop.hpp>

using namespace rlloop;
namespace fs = std::filesystem;

namespace {
struct DemoOptions {
  int sft_steps = 600;
  int grpo_steps = 80;
  int difficulty = 2;
  int sft_batch = 64;
  int grpo_problems = 16;
  int group_size = 8;
  int eval_problems = 200;
  double sft_lr = 1e-3;
  double grpo_lr = 1e-4;
  std::int64_t seed = 1;
  std::string out_dir = "runs/grpo_arith";
  std::string device = "auto";
  std::string sft_checkpoint;  // start GRPO from this saved SFT state instead of running SFT
};

// A progress line rewritten in place on a terminal, printed every `every` steps otherwise (CI logs).
void progress(const char* phase, int step, int total, const std::string& detail) {
  const bool tty = ::isatty(STDERR_FILENO);
  if (!tty && step % 10 != 0 && step != total) return;
  const int width = 24, filled = total ? width * step / total : width;
  std::fprintf(stderr, "%s%-5s [%s%s] %3d/%-3d %s%s", tty ? "\r" : "", phase, std::string(filled, '#').c_str(),
               std::string(width - filled, '.').c_str(), step, total, detail.c_str(), tty ? "   " : "\n");
  if (tty && step == total) std::fprintf(stderr, "\n");
}

char buf[256];
const char* fmt(const char* f, double a, double b = 0, double c = 0) {
  std::snprintf(buf, sizeof buf, f, a, b, c);
  return buf;
}
}  // namespace

int main(int argc, char** argv) {
  DemoOptions o;
  CLI::App app{"GRPO on synthetic arithmetic with the embedded default model (rlloop-small), on CPU."};
  app.add_option("--sft-steps", o.sft_steps, "SFT warm-start steps");
  app.add_option("--grpo-steps", o.grpo_steps, "GRPO steps");
  app.add_option("--difficulty", o.difficulty, "arithmetic difficulty level 1..6");
  app.add_option("--group-size", o.group_size, "completions per prompt");
  app.add_option("--problems", o.grpo_problems, "prompts per GRPO step");
  app.add_option("--eval-problems", o.eval_problems, "held-out problems for evaluation");
  app.add_option("--seed", o.seed, "seed for data and sampling");
  app.add_option("--sft-batch", o.sft_batch, "examples per SFT step");
  app.add_option("--sft-lr", o.sft_lr, "SFT learning rate");
  app.add_option("--grpo-lr", o.grpo_lr, "GRPO learning rate");
  app.add_option("--out", o.out_dir, "where metrics.jsonl and plot.svg go");
  app.add_option("--device", o.device, "auto, cpu, cuda");
  app.add_option("--from-sft", o.sft_checkpoint, "skip SFT: load this saved state (e.g. <out>/checkpoints/sft)");
  CLI11_PARSE(app, argc, argv);
  const auto t0 = std::chrono::steady_clock::now();
  fs::create_directories(o.out_dir);

  LocalServiceOptions svc_opts;
  svc_opts.checkpoint_dir = (fs::path(o.out_dir) / "checkpoints").string();
  svc_opts.device = o.device;
  ServiceClient<LocalService> service{LocalService(svc_opts)};
  auto client = service.create_full_training_client("rlloop-small", o.seed);
  auto tokenizer = client.get_tokenizer();
  const auto eos = *tokenizer->eos_token_id();

  envs::ArithmeticTask train_task(envs::ArithmeticOptions::for_difficulty(o.difficulty), o.seed);
  envs::ArithmeticTask eval_task(envs::ArithmeticOptions::for_difficulty(o.difficulty), o.seed + 1000);
  const auto held_out = eval_task.sample(static_cast<std::size_t>(o.eval_problems), envs::Split::held_out);
  const rewards::MathAnswerReward reward;
  const SamplingParams eval_params{.max_tokens = 12, .temperature = 0.0};
  MetricsLog log((fs::path(o.out_dir) / "metrics.jsonl").string());
  auto evaluate = [&] {
    return algorithms::evaluate_greedy(client.live_sampling_client(), *tokenizer, held_out, reward, eval_params);
  };

  std::printf("rlloop grpo_arith: model rlloop-small (%lld parameters) on %s, difficulty %d\n",
              static_cast<long long>(client.get_info().num_parameters), client.get_info().device.c_str(), o.difficulty);

  // 1. SFT warm start: prompt -> "#### N" + EOS.
  algorithms::Sft<LocalSession> sft(client, {.adam = {.learning_rate = o.sft_lr, .beta2 = 0.99}});
  if (!o.sft_checkpoint.empty()) {
    client.load_state(o.sft_checkpoint, /*with_optimizer=*/false).get();
    o.sft_steps = 0;
  }
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
    const auto saved = client.save_state("sft").get().path;
    std::printf("SFT state saved to %s\n", saved.c_str());
    // Reload the weights alone: GRPO starts with fresh Adam moments (SFT's would damp its first hundred steps).
    client.load_state(saved, /*with_optimizer=*/false).get();
  }
  const auto before = evaluate();
  log.write({{"phase", "eval"}, {"step", 0}, {"accuracy", before.accuracy}});
  std::printf("SFT done, held-out accuracy %.3f; starting GRPO\n", before.accuracy);

  // 2. GRPO.
  algorithms::GRPO<LocalSession> grpo(client, tokenizer,
                                      {.group_size = o.group_size,
                                       .sampling = {.max_tokens = 10, .temperature = 1.0, .seed = o.seed},
                                       .loss = LossFn::ppo,
                                       .adam = {.learning_rate = o.grpo_lr, .beta2 = 0.99}});
  for (int s = 1; s <= o.grpo_steps; ++s) {
    auto st = grpo.step(train_task.sample(static_cast<std::size_t>(o.grpo_problems), envs::Split::train), reward);
    nlohmann::json rec{{"phase", "grpo"},         {"step", s},
                       {"reward", st.reward_mean}, {"reward_std", st.reward_std},
                       {"train_accuracy", st.accuracy}, {"groups_used", st.groups_used},
                       {"clip_fraction", st.clip_fraction}, {"entropy", st.entropy},
                       {"sampled_tokens", st.sampled_tokens}, {"seconds_sampling", st.seconds_sampling},
                       {"seconds_training", st.seconds_training}};
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
                 "grpo_arith: reward and held-out accuracy per GRPO step");

  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("held-out accuracy after SFT:  %.3f\n", before.accuracy);
  std::printf("held-out accuracy after GRPO: %.3f  (%+.3f)\n", after.accuracy, after.accuracy - before.accuracy);
  for (std::size_t i = 0; i < 3 && i < held_out.size(); ++i)
    std::printf("  %s%s   (expected %s)\n", held_out[i].prompt.c_str(), after.completions[i].c_str(),
                held_out[i].answer.c_str());
  std::printf("metrics: %s\nplot:    %s\ntime:    %.0f s\n", log.path().c_str(), plot.c_str(), secs);
  return 0;
}
