// KTO on unpaired feedback, CPU, well under a minute: a byte-level model initialised from a seed sees single
// completions of arithmetic prompts ("37+48="), each with a thumbs up or down, never two completions of one prompt:
//   desirable    "#### 85!"      undesirable  "#### 85."      (the same answer, a preferred ending)
// Each problem gets one of the two at random. The implicit rewards beta * (pi - ref) of desirable and
// undesirable completions, and their margin, are reported on the training batch and on held-out problems.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <random>
#include <string>

#include <CLI/CLI.hpp>

#include <rlloop/algorithms/callbacks.hpp>
#include <rlloop/algorithms/kto.hpp>
#include <rlloop/envs/arithmetic.hpp>
#include <rlloop/local.hpp>
#include <rlloop/metrics.hpp>
#include <rlloop/rlloop.hpp>

#include "../common/plot.hpp"
#include "../common/preference_setup.hpp"

using namespace rlloop;
namespace fs = std::filesystem;

namespace {

struct Options {
  std::string model = "rlloop-small";
  int steps = 100;
  int batch = 16;
  int eval_examples = 128;
  int report_every = 20;
  double beta = 0.1;
  double desirable_weight = 1.0;
  double undesirable_weight = 1.0;
  double lr = 5e-4;
  std::int64_t seed = 1;
  std::string out_dir = "runs/kto";
};

// One labelled completion (EOS-terminated) of a problem.
algorithms::KtoExample make_example(const Tokenizer& tok, const envs::ArithmeticProblem& p, bool desirable) {
  auto completion = tok.encode(p.target + (desirable ? "!" : "."));
  completion.push_back(*tok.eos_token_id());
  return {tok.encode(p.prompt), completion, desirable};
}

// Held-out statistics every `every` steps (and after the first and the last), printed beside the training batch's
// and logged as one JSONL record each.
struct HeldOutReport {
  algorithms::KTO<LocalSession>* kto;
  const std::vector<algorithms::KtoExample>* held_out;
  MetricsLog* log;
  int every, total;

  void on_step(const algorithms::KtoStats& train) {
    const int step = static_cast<int>(train.step) + 1;
    if (step != 1 && step % every != 0 && step != total) return;
    const auto ev = kto->evaluate(*held_out);
    log->write({{"step", step},
                {"loss", train.loss},
                {"kl", train.kl},
                {"margin", train.margin},
                {"held_out_loss", ev.loss},
                {"held_out_reward_desirable", ev.reward_desirable},
                {"held_out_reward_undesirable", ev.reward_undesirable},
                {"held_out_margin", ev.margin}});
    std::printf(
        "step %4d  train loss %.4f kl %.3f margin %+.3f | held-out loss %.4f desirable %+.3f undesirable %+.3f"
        " margin %+.3f\n",
        step, train.loss, train.kl, train.margin, ev.loss, ev.reward_desirable, ev.reward_undesirable, ev.margin);
    std::fflush(stdout);
  }
};

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"KTO on unpaired thumbs-up / thumbs-down feedback for arithmetic completions (CPU)."};
  app.add_option("--model", o.model, "base model: rlloop-tiny, rlloop-small or a model directory");
  app.add_option("--steps", o.steps, "optimizer steps");
  app.add_option("--batch", o.batch, "labelled examples per step");
  app.add_option("--eval-examples", o.eval_examples, "held-out examples (half of each label)");
  app.add_option("--report-every", o.report_every, "held-out evaluation every N steps");
  app.add_option("--beta", o.beta, "KTO beta");
  app.add_option("--desirable-weight", o.desirable_weight, "lambda_D");
  app.add_option("--undesirable-weight", o.undesirable_weight, "lambda_U");
  app.add_option("--lr", o.lr, "learning rate");
  app.add_option("--seed", o.seed, "seed for the model and the data");
  app.add_option("--out", o.out_dir, "where metrics.jsonl and plot.svg go");
  CLI11_PARSE(app, argc, argv);
  const auto t0 = std::chrono::steady_clock::now();
  auto [service, client, tok, reference] = examples::preference_setup(o.model, o.seed, o.out_dir);
  std::printf("rlloop kto: %s (%lld parameters), beta %.3g, lambda_D %.3g, lambda_U %.3g\n", o.model.c_str(),
              static_cast<long long>(client.get_info().num_parameters), o.beta, o.desirable_weight,
              o.undesirable_weight);
  algorithms::KTO<LocalSession> kto(client, reference,
                                    {.beta = o.beta,
                                     .desirable_weight = o.desirable_weight,
                                     .undesirable_weight = o.undesirable_weight,
                                     .adam = {.learning_rate = o.lr, .beta2 = 0.99}});

  envs::ArithmeticTask train_task(envs::ArithmeticOptions::for_difficulty(2), o.seed);
  envs::ArithmeticTask eval_task(envs::ArithmeticOptions::for_difficulty(2), o.seed + 1000);
  std::mt19937_64 rng(static_cast<std::uint64_t>(o.seed));
  std::vector<algorithms::KtoExample> held_out;
  const auto eval_problems = eval_task.sample(static_cast<std::size_t>(o.eval_examples), envs::Split::held_out);
  for (std::size_t i = 0; i < eval_problems.size(); ++i)
    held_out.push_back(make_example(*tok, eval_problems[i], i % 2 == 0));
  const auto before = kto.evaluate(held_out);
  std::printf("before training: held-out loss %.4f, margin %+.3f (policy = reference: 0.5 and 0 up to float noise)\n",
              before.loss, before.margin);

  auto next_batch = [&] {
    std::vector<algorithms::KtoExample> batch;
    for (const auto& p : train_task.sample(static_cast<std::size_t>(o.batch), envs::Split::train))
      batch.push_back(make_example(*tok, p, rng() % 2 == 0));
    return batch;
  };
  MetricsLog log((fs::path(o.out_dir) / "metrics.jsonl").string());
  algorithms::train(kto, o.steps, next_batch, HeldOutReport{&kto, &held_out, &log, o.report_every, o.steps});

  std::vector<nlohmann::json> records(log.records().begin(), log.records().end());
  const auto plot = (fs::path(o.out_dir) / "plot.svg").string();
  examples::write_svg_plot(plot, records,
                           {"held_out_reward_desirable", "held_out_reward_undesirable", "held_out_margin"}, "step",
                           "kto: held-out implicit rewards and margin");
  std::printf("reference logprobs cached for %zu completions; optimizer steps %lld\nmetrics: %s\nplot:    %s\n",
              kto.state().reference_logprobs.size(), static_cast<long long>(client.get_info().step), log.path().c_str(),
              plot.c_str());
  std::printf("time:    %.0f s\n", std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return 0;
}
