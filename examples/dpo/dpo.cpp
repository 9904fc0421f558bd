// DPO (or IPO) on a tiny preference task, CPU, about a minute: a byte-level model initialised from a seed
// learns which of two completions of "37+48=" is preferred.
//   --task style   chosen "#### 85!" over rejected "#### 85."  (same answer, preferred punctuation)
//   --task answer  chosen "#### 85"  over rejected "#### 86"   (the right sum over a near miss)
// Preference accuracy (chosen implicit reward > rejected) and the reward margin are reported on the training
// pairs and on held-out pairs (problems never trained on) before and during training.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <random>
#include <string>

#include <CLI/CLI.hpp>

#include <rlloop/algorithms/dpo.hpp>
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
  std::string task = "style";
  int steps = 120;
  int batch = 16;
  int eval_pairs = 128;
  double beta = 0.1;
  double lr = 5e-4;
  bool ipo = false;
  std::int64_t seed = 1;
  std::string out_dir = "runs/dpo";
};

// One preference pair per problem, tokenized: prompt, chosen, rejected (EOS closes both completions).
algorithms::PreferencePair make_pair(const Tokenizer& tok, const envs::ArithmeticProblem& p, const std::string& task,
                                     std::mt19937_64& rng) {
  const token_id eos = *tok.eos_token_id();
  std::string chosen = p.target, rejected;
  if (task == "style") {
    chosen += "!";
    rejected = p.target + ".";
  } else {
    const long answer = std::stol(p.answer);
    const long off = std::uniform_int_distribution<long>(1, 3)(rng) * (rng() % 2 ? 1 : -1);
    rejected = "#### " + std::to_string(answer + off);
  }
  auto c = tok.encode(chosen), r = tok.encode(rejected);
  c.push_back(eos);
  r.push_back(eos);
  return {tok.encode(p.prompt), c, r};
}

template <class Algo>
int run(Algo& algo, const Options& o, TrainingClient<LocalSession>& client, const Tokenizer& tok) {
  envs::ArithmeticTask train_task(envs::ArithmeticOptions::for_difficulty(2), o.seed);
  envs::ArithmeticTask eval_task(envs::ArithmeticOptions::for_difficulty(2), o.seed + 1000);
  std::mt19937_64 rng(static_cast<std::uint64_t>(o.seed));
  std::vector<algorithms::PreferencePair> held_out;
  for (const auto& p : eval_task.sample(static_cast<std::size_t>(o.eval_pairs), envs::Split::held_out))
    held_out.push_back(make_pair(tok, p, o.task, rng));
  MetricsLog log((fs::path(o.out_dir) / "metrics.jsonl").string());

  auto report = [&](int step, const algorithms::DpoStats& train) {
    const auto ev = algo.evaluate(held_out);
    log.write({{"step", step},
               {"loss", train.loss},
               {"accuracy", train.accuracy},
               {"margin", train.margin},
               {"held_out_accuracy", ev.accuracy},
               {"held_out_margin", ev.margin},
               {"held_out_loss", ev.loss}});
    std::printf("step %4d  train loss %.4f acc %.2f margin %+.3f | held-out loss %.4f acc %.2f margin %+.3f\n", step,
                train.loss, train.accuracy, train.margin, ev.loss, ev.accuracy, ev.margin);
    std::fflush(stdout);
  };
  const auto before = algo.evaluate(held_out);
  std::printf(
      "before training: held-out loss %.4f, accuracy %.2f (policy = reference: margins are 0 up to float noise)\n",
      before.loss, before.accuracy);
  for (int s = 1; s <= o.steps; ++s) {
    std::vector<algorithms::PreferencePair> batch;
    for (const auto& p : train_task.sample(static_cast<std::size_t>(o.batch), envs::Split::train))
      batch.push_back(make_pair(tok, p, o.task, rng));
    const auto st = algo.step(batch);
    if (s == 1 || s % 20 == 0 || s == o.steps) report(s, st);
  }
  std::vector<nlohmann::json> records(log.records().begin(), log.records().end());
  const auto plot = (fs::path(o.out_dir) / "plot.svg").string();
  examples::write_svg_plot(plot, records, {"accuracy", "held_out_accuracy", "held_out_margin"}, "step",
                           "dpo: preference accuracy and margin");
  std::printf("reference logprobs cached for %zu sequences; optimizer steps %lld\nmetrics: %s\nplot:    %s\n",
              algo.state().reference_logprobs.size(), static_cast<long long>(client.get_info().step),
              log.path().c_str(), plot.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"DPO / IPO on a tiny arithmetic preference task (CPU)."};
  app.add_option("--model", o.model, "base model: rlloop-tiny, rlloop-small or a model directory");
  app.add_option("--task", o.task, "style (prefer '!' over '.') or answer (prefer the right sum)")
      ->check(CLI::IsMember({"style", "answer"}));
  app.add_option("--steps", o.steps, "optimizer steps");
  app.add_option("--batch", o.batch, "preference pairs per step");
  app.add_option("--eval-pairs", o.eval_pairs, "held-out pairs");
  app.add_option("--beta", o.beta, "DPO beta");
  app.add_option("--lr", o.lr, "learning rate");
  app.add_flag("--ipo", o.ipo, "IPO loss instead of DPO's sigmoid");
  app.add_option("--seed", o.seed, "seed for the model and the data");
  app.add_option("--out", o.out_dir, "where metrics.jsonl and plot.svg go");
  CLI11_PARSE(app, argc, argv);
  const auto t0 = std::chrono::steady_clock::now();
  auto [service, client, tok, reference] = examples::preference_setup(o.model, o.seed, o.out_dir);
  std::printf("rlloop dpo: %s (%lld parameters), task %s, %s, beta %.3g\n", o.model.c_str(),
              static_cast<long long>(client.get_info().num_parameters), o.task.c_str(), o.ipo ? "IPO" : "DPO", o.beta);
  const algorithms::DpoOptions opts{.beta = o.beta, .adam = {.learning_rate = o.lr, .beta2 = 0.99}};
  int rc = 0;
  if (o.ipo) {
    algorithms::IPO<LocalSession> algo(client, reference, opts);
    rc = run(algo, o, client, *tok);
  } else {
    algorithms::DPO<LocalSession> algo(client, reference, opts);
    rc = run(algo, o, client, *tok);
  }
  std::printf("time:    %.0f s\n", std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return rc;
}
