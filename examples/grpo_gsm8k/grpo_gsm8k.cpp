// GRPO on GSM8K with the math-answer reward: the loop one would run on a real model on a GPU. On the CPU with a
// tiny built-in model it runs a few steps end to end (sampling, grading, training) but cannot learn GSM8K.
#include <chrono>
#include <cstdio>
#include <string>

#include <CLI/CLI.hpp>

#include <rlloop/algorithms/grpo.hpp>
#include <rlloop/envs/gsm8k.hpp>
#include <rlloop/local.hpp>
#include <rlloop/rewards/math.hpp>
#include <rlloop/rlloop.hpp>

using namespace rlloop;

namespace {
// A random byte-level model writes arbitrary bytes: show printable ASCII, '?' for the rest.
std::string printable(const std::string& s) {
  std::string out;
  for (unsigned char c : s) out += c >= 32 && c < 127 ? static_cast<char>(c) : c == '\n' ? ' ' : '?';
  return out;
}
}  // namespace

int main(int argc, char** argv) {
  std::string data = "../shared/data/gsm8k/train.jsonl", model = "rlloop-small", device = "auto";
  int steps = 3, problems = 4, group_size = 4, max_tokens = 64, lora_rank = 0;
  double lr = 1e-5;
  std::int64_t seed = 1;
  CLI::App app{"GRPO on GSM8K with the math-answer reward."};
  app.add_option("--data", data, "GSM8K train.jsonl (official format)");
  app.add_option("--model", model, "base model: a built-in name or an HF model directory");
  app.add_option("--steps", steps, "GRPO steps");
  app.add_option("--problems", problems, "problems per step");
  app.add_option("--group-size", group_size, "completions per problem");
  app.add_option("--max-tokens", max_tokens, "tokens per completion");
  app.add_option("--lr", lr, "learning rate");
  app.add_option("--lora-rank", lora_rank, "LoRA rank (0 = full fine-tuning)");
  app.add_option("--device", device, "auto, cpu, cuda");
  app.add_option("--seed", seed, "seed for sampling and problem order");
  CLI11_PARSE(app, argc, argv);
  const auto t0 = std::chrono::steady_clock::now();

  const auto loaded = envs::load_gsm8k(data);
  configure_engine_process();  // this process: every core, the caching CPU allocator
  LocalServiceOptions svc;
  svc.checkpoint_dir = "runs/grpo_gsm8k/checkpoints";
  svc.device = device;
  ServiceClient<LocalService> service{LocalService(svc)};
  auto client = lora_rank > 0 ? service.create_lora_training_client(
                                    model, {.rank = lora_rank, .alpha = 2 * lora_rank, .seed = seed})
                              : service.create_full_training_client(model, seed);
  auto tok = load_tokenizer(client);
  // Keep the problems whose prompt and completion fit the model's context (512 positions for rlloop-small).
  std::vector<envs::MathProblem> all;
  for (const auto& p : loaded)
    if (static_cast<std::int64_t>(tok->encode(p.prompt).size()) + max_tokens <=
        client.get_info().max_position_embeddings)
      all.push_back(p);
  if (all.empty()) throw invalid_argument("no GSM8K problem fits the model's context with --max-tokens");
  std::printf("rlloop grpo_gsm8k: %zu problems from %s; model %s (%lld parameters) on %s\n", all.size(), data.c_str(),
              model.c_str(), static_cast<long long>(client.get_info().num_parameters),
              client.get_info().device.c_str());

  SamplingParams sampling{.max_tokens = max_tokens, .temperature = 1.0, .seed = seed};
  if (auto eos = tok->eos_token_id()) sampling.stop_token_ids = {*eos};
  algorithms::GRPO<LocalSession> grpo(client, tok,
                                      {.group_size = group_size, .sampling = sampling, .adam = {.learning_rate = lr}});
  const rewards::MathAnswerReward reward;
  std::size_t next = 0;
  for (int s = 1; s <= steps; ++s) {
    std::vector<envs::MathProblem> batch;
    for (int i = 0; i < problems; ++i) batch.push_back(all[next++ % all.size()]);
    const auto st = grpo.step(batch, reward);
    std::printf(
        "step %d  reward %.3f  accuracy %.3f  groups used %d dropped %d  sampled %lld tokens  "
        "sampling %.1f s  training %.1f s\n",
        s, st.reward_mean, st.accuracy, st.groups_used, st.groups_dropped, static_cast<long long>(st.sampled_tokens),
        st.seconds_sampling, st.seconds_training);
  }
  // One graded completion, to see what the reward sees.
  const auto& p = all.front();
  const auto seq = client.live_sampling_client()
                       .sample(ModelInput::from_tokens(tok->encode(p.prompt)), 1, sampling)
                       .get()
                       .sequences[0];
  const auto text = tok->decode(seq.tokens, true);
  const auto score = score_one(reward, p, text);
  std::printf("sample completion (%zu tokens): %s -> %s (%s)\ntime: %.0f s\n", seq.tokens.size(),
              printable(text.substr(0, 80)).c_str(), std::string(to_string(score.status)).c_str(),
              score.details.c_str(), std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return 0;
}
