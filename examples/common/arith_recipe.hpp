// The arithmetic recipe shared by grpo_arith (local session) and remote_grpo (a training-session URL): one
// template over the Session, so both examples run literally the same loop.
//   1. SFT warm start on worked examples (prompt -> "#### N" + EOS),
//   2. the SFT state is saved and reloaded without optimizer state (GRPO starts with fresh Adam moments),
//   3. GRPO rewarded by the math-answer reward, held-out accuracy every 20 steps,
//   4. metrics JSONL and an SVG plot of reward and accuracy per GRPO step.
#pragma once
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include <rlloop/algorithms/eval.hpp>
#include <rlloop/algorithms/grpo.hpp>
#include <rlloop/algorithms/sft.hpp>
#include <rlloop/envs/arithmetic.hpp>
#include <rlloop/metrics.hpp>
#include <rlloop/rewards/math.hpp>
#include <rlloop/rlloop.hpp>

namespace rlloop::examples {

struct ArithRecipe {
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
  std::string from_sft;  // skip SFT: load this saved state (weights only) instead
  std::string name = "grpo_arith";  // used in the plot title
};

struct ArithResult {
  algorithms::EvalResult before, after;
  std::vector<envs::ArithmeticProblem> held_out;
  std::string metrics_path, plot_path;
};

// A progress line rewritten in place on a terminal, printed every 10 steps otherwise (CI logs).
inline void progress(const char* phase, int step, int total, const std::string& detail) {
  const bool tty = ::isatty(STDERR_FILENO);
  if (!tty && step % 10 != 0 && step != total) return;
  const int width = 24, filled = total ? width * step / total : width;
  std::fprintf(stderr, "%s%-5s [%s%s] %3d/%-3d %s%s", tty ? "\r" : "", phase, std::string(filled, '#').c_str(),
               std::string(width - filled, '.').c_str(), step, total, detail.c_str(), tty ? "   " : "\n");
  if (tty && step == total) std::fprintf(stderr, "\n");
}

inline std::string format(const char* f, double a, double b = 0) {
  char buf[128];
  std::snprintf(buf, sizeof buf, f, a, b);
  return buf;
}

template <Session S>
ArithResult run_arith_recipe(TrainingClient<S>& client, const ArithRecipe& o) {
  namespace fs = std::filesystem;
  fs::create_directories(o.out_dir);
  auto tokenizer = client.get_tokenizer();
  const auto eos = *tokenizer->eos_token_id();
  envs::ArithmeticTask train_task(envs::ArithmeticOptions::for_difficulty(o.difficulty), o.seed);
  envs::ArithmeticTask eval_task(envs::ArithmeticOptions::for_difficulty(o.difficulty), o.seed + 1000);
  ArithResult result;
  result.held_out = eval_task.sample(static_cast<std::size_t>(o.eval_problems), envs::Split::held_out);
  const rewards::MathAnswerReward reward;
  const SamplingParams eval_params{.max_tokens = 12, .temperature = 0.0};
  MetricsLog log((fs::path(o.out_dir) / "metrics.jsonl").string());
  auto evaluate = [&] {
    return algorithms::evaluate_greedy(client.live_sampling_client(), *tokenizer, result.held_out, reward,
                                       eval_params);
  };

  // 1-2. SFT warm start, or a saved one.
  const int sft_steps = o.from_sft.empty() ? o.sft_steps : 0;
  if (!o.from_sft.empty()) client.load_state(o.from_sft, /*with_optimizer=*/false).get();
  algorithms::Sft<S> sft(client, {.adam = {.learning_rate = o.sft_lr, .beta2 = 0.99}});
  for (int s = 1; s <= sft_steps; ++s) {
    std::vector<Datum> batch;
    for (const auto& p : train_task.sample(static_cast<std::size_t>(o.sft_batch), envs::Split::train)) {
      auto completion = tokenizer->encode(p.target);
      completion.push_back(eos);
      batch.push_back(algorithms::completion_datum(tokenizer->encode(p.prompt), completion));
    }
    auto st = sft.step(batch);
    log.write({{"phase", "sft"}, {"step", s}, {"loss", st.loss_per_token}});
    progress("sft", s, sft_steps, format("loss %.3f", st.loss_per_token));
  }
  if (sft_steps > 0) {
    // A local path or, remotely, a model-package ARN. Reloading the weights alone gives GRPO fresh Adam moments
    // (SFT's would damp its first hundred steps).
    const auto saved = client.save_state("sft").get().path;
    std::printf("SFT state saved as %s\n", saved.c_str());
    client.load_state(saved, /*with_optimizer=*/false).get();
  }
  result.before = evaluate();
  log.write({{"phase", "eval"}, {"step", 0}, {"accuracy", result.before.accuracy}});
  std::printf("held-out accuracy after SFT: %.3f\n", result.before.accuracy);
  std::fflush(stdout);

  // 3. GRPO.
  algorithms::GRPO<S> grpo(client, tokenizer,
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
    progress("grpo", s, o.grpo_steps, format("reward %.3f  groups %.0f", st.reward_mean, st.groups_used));
  }
  result.after = evaluate();

  // 4. Plot.
  std::vector<nlohmann::json> grpo_records;
  for (const auto& r : log.records())
    if (r["phase"] == "grpo") grpo_records.push_back(r);
  result.metrics_path = log.path();
  result.plot_path = (fs::path(o.out_dir) / "plot.svg").string();
  write_svg_plot(result.plot_path, grpo_records, {"reward", "train_accuracy", "accuracy"}, "step",
                 o.name + ": reward and held-out accuracy per GRPO step");
  return result;
}

// The closing lines both examples print.
inline void print_arith_summary(const ArithResult& r) {
  std::printf("held-out accuracy after SFT:  %.3f\n", r.before.accuracy);
  std::printf("held-out accuracy after GRPO: %.3f  (%+.3f)\n", r.after.accuracy, r.after.accuracy - r.before.accuracy);
  for (std::size_t i = 0; i < 3 && i < r.held_out.size(); ++i)
    std::printf("  %s%s   (expected %s)\n", r.held_out[i].prompt.c_str(), r.after.completions[i].c_str(),
                r.held_out[i].answer.c_str());
  std::printf("metrics: %s\nplot:    %s\n", r.metrics_path.c_str(), r.plot_path.c_str());
}

}  // namespace rlloop::examples
