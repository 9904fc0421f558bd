// GRPO on competitive-programming problems (data/problems/problems.jsonl), each completion run against the
// problem's tests in the sandbox by the code reward. A short SFT warm start on the reference solutions gives the
// tiny CPU model something to sample; the point is the plumbing end to end (sampling -> sandboxed grading with
// statuses -> GRPO update), not a model that learns to program.
#include <chrono>
#include <cstdio>
#include <map>
#include <string>

#include <CLI/CLI.hpp>

#include <rlloop/algorithms/grpo.hpp>
#include <rlloop/algorithms/sft.hpp>
#include <rlloop/envs/competitive_programming.hpp>
#include <rlloop/local.hpp>
#include <rlloop/rewards/code.hpp>
#include <rlloop/rlloop.hpp>

using namespace rlloop;

int main(int argc, char** argv) {
  std::string data = std::string(RLLOOP_EXAMPLE_SOURCE_DIR) + "/data/problems/problems.jsonl", model = "rlloop-small";
  int sft_steps = 150, steps = 3, problems = 4, group_size = 4, max_tokens = 96;
  double sft_lr = 2e-3, lr = 1e-4;
  std::int64_t seed = 1;
  CLI::App app{"GRPO with the sandboxed code reward on the shipped competitive-programming problems."};
  app.add_option("--data", data, "problems JSONL (stdin/stdout tests or HumanEval style)");
  app.add_option("--model", model, "base model");
  app.add_option("--sft-steps", sft_steps, "warm-start steps on the reference solutions (0 = none)");
  app.add_option("--steps", steps, "GRPO steps");
  app.add_option("--problems", problems, "problems per GRPO step");
  app.add_option("--group-size", group_size, "completions per problem");
  app.add_option("--max-tokens", max_tokens, "tokens per completion");
  app.add_option("--seed", seed, "seed");
  CLI11_PARSE(app, argc, argv);
  const auto t0 = std::chrono::steady_clock::now();

  auto all = envs::load_code_problems(data);
  // The prompt the model completes: the statement, then the start of a Python program.
  for (auto& p : all) p.prompt = "# " + p.prompt + "\n";
  configure_engine_process();  // this process: every core, the caching CPU allocator
  LocalServiceOptions svc;
  svc.checkpoint_dir = "runs/code_rl/checkpoints";
  ServiceClient<LocalService> service{LocalService(svc)};
  auto client = service.create_full_training_client(model, seed);
  auto tok = load_tokenizer(client);
  const token_id eos = *tok->eos_token_id();
  std::printf("rlloop code_rl: %zu problems from %s; model %s\n", all.size(), data.c_str(), model.c_str());

  algorithms::Sft<LocalSession> sft(client, {.adam = {.learning_rate = sft_lr, .beta2 = 0.99}});
  for (int s = 1; s <= sft_steps; ++s) {
    std::vector<Datum> batch;
    for (std::size_t i = 0; i < 8; ++i) {
      const auto& p = all[(static_cast<std::size_t>(s) * 8 + i) % all.size()];
      if (p.reference_solution.empty()) continue;
      auto completion = tok->encode(p.reference_solution);
      completion.push_back(eos);
      batch.push_back(algorithms::completion_datum(tok->encode(p.prompt), completion));
    }
    const auto st = sft.step(batch);
    if (s == 1 || s % 50 == 0) std::printf("sft  step %4d  loss %.3f\n", s, st.loss_per_token);
  }

  const rewards::CodeReward reward;  // pass rate over the tests, in the sandbox
  algorithms::GRPO<LocalSession> grpo(
      client, tok,
      {.group_size = group_size,
       .sampling = {.max_tokens = max_tokens, .temperature = 1.0, .seed = seed, .stop_token_ids = {eos}},
       .adam = {.learning_rate = lr}});
  std::size_t next = 0;
  for (int s = 1; s <= steps; ++s) {
    std::vector<rewards::CodeProblem> batch;
    for (int i = 0; i < problems; ++i) batch.push_back(all[next++ % all.size()]);
    const auto st = grpo.step(batch, reward);
    std::printf(
        "grpo step %d  reward %.3f  all tests passed %.3f  groups used %d dropped %d  sampling+grading %.1f s\n", s,
        st.reward_mean, st.accuracy, st.groups_used, st.groups_dropped, st.seconds_sampling);
  }
  // What the sandbox said about a few fresh completions of the first problem.
  std::map<std::string, int> statuses;
  const auto& p = all.front();
  const auto resp = client.live_sampling_client()
                        .sample(ModelInput::from_tokens(tok->encode(p.prompt)), 8,
                                {.max_tokens = max_tokens, .temperature = 1.0, .seed = seed, .stop_token_ids = {eos}})
                        .get();
  for (const auto& seq : resp.sequences)
    ++statuses[std::string(to_string(reward(p, tok->decode(seq.tokens, true)).status))];
  std::printf("statuses of 8 samples for %s:", p.task_id.c_str());
  for (const auto& [k, n] : statuses) std::printf(" %s=%d", k.c_str(), n);
  std::printf("\ntime: %.0f s\n", std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return 0;
}
