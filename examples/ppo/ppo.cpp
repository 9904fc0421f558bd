// PPO with a learned critic on synthetic arithmetic: a short SFT warm start of rlloop-small (with a value head),
// then PPO (GAE advantages, clipped policy and value losses, epochs over minibatches), held-out accuracy before
// and after.
#include <cstdio>
#include <filesystem>

#include <CLI/CLI.hpp>

#include <rlloop/algorithms/eval.hpp>
#include <rlloop/algorithms/ppo.hpp>
#include <rlloop/algorithms/sft.hpp>
#include <rlloop/envs/arithmetic.hpp>
#include <rlloop/local.hpp>
#include <rlloop/rewards/math.hpp>
#include <rlloop/tokenizer.hpp>

using namespace rlloop;

int main(int argc, char** argv) {
  int sft_steps = 400, ppo_steps = 30, eval_problems = 100;
  std::int64_t seed = 1;
  std::string out = "runs/ppo";
  CLI::App app{"PPO with a value head on synthetic arithmetic (rlloop-small, CPU)."};
  app.add_option("--sft-steps", sft_steps, "SFT warm-start steps");
  app.add_option("--ppo-steps", ppo_steps, "PPO steps");
  app.add_option("--eval-problems", eval_problems, "held-out problems");
  app.add_option("--seed", seed, "seed");
  app.add_option("--out", out, "checkpoint folder");
  CLI11_PARSE(app, argc, argv);

  configure_engine_process();  // this process: every core, the caching CPU allocator
  LocalServiceOptions svc;
  svc.checkpoint_dir = (std::filesystem::path(out) / "checkpoints").string();
  ServiceClient<LocalService> service{LocalService(svc)};
  auto client = service.create_training_client({.base_model = "rlloop-small", .seed = seed, .value_head = true});
  auto tokenizer = load_tokenizer(client);
  envs::ArithmeticTask train_task(envs::ArithmeticOptions::for_difficulty(2), seed);
  envs::ArithmeticTask eval_task(envs::ArithmeticOptions::for_difficulty(2), seed + 1000);
  const auto held_out = eval_task.sample(static_cast<std::size_t>(eval_problems), envs::Split::held_out);
  const rewards::MathAnswerReward reward;
  auto accuracy = [&] {
    return algorithms::evaluate_greedy(client.live_sampling_client(), *tokenizer, held_out, reward, {.max_tokens = 12})
        .accuracy;
  };

  algorithms::Sft<LocalSession> sft(client, {.adam = {.learning_rate = 1e-3, .beta2 = 0.99}});
  for (int s = 1; s <= sft_steps; ++s) {
    std::vector<Datum> batch;
    for (const auto& p : train_task.sample(64, envs::Split::train)) {
      auto completion = tokenizer->encode(p.target);
      completion.push_back(*tokenizer->eos_token_id());
      batch.push_back(algorithms::completion_datum(tokenizer->encode(p.prompt), completion));
    }
    const auto st = sft.step(batch);
    if (s % 100 == 0) std::printf("sft %4d  loss/token %.3f\n", s, st.loss_per_token);
  }
  client.load_state(client.save_state("sft").get().path, /*with_optimizer=*/false).get();  // fresh Adam for PPO
  const double before = accuracy();
  std::printf("held-out accuracy after SFT: %.3f\n", before);

  // The policy-gradient loop with a critic: value head + GAE (lambda 0.95), clipped value loss at half weight.
  algorithms::PPO<LocalSession> ppo(client, tokenizer,
                                    {.group_size = 4,
                                     .sampling = {.max_tokens = 10, .temperature = 1.0, .seed = seed},
                                     .epochs = 2,
                                     .substeps = 2,
                                     .adam = {.learning_rate = 5e-5, .beta2 = 0.99}},
                                    {.gae = {.gamma = 1.0, .lambda = 0.95}, .value_clip = 0.2, .value_coef = 0.5});
  for (int s = 1; s <= ppo_steps; ++s) {
    const auto st = ppo.step(train_task.sample(16, envs::Split::train), reward);
    if (s % 5 == 0)
      std::printf("ppo %3d  reward %.3f  value loss %.4f  explained variance %.2f  clip %.3f\n", s, st.reward_mean,
                  st.value_loss, st.explained_variance, st.clip_fraction);
  }
  const double after = accuracy();
  std::printf("held-out accuracy after PPO: %.3f  (%+.3f)\n", after, after - before);
  return 0;
}
