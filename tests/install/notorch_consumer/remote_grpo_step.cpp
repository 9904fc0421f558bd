// One GRPO step through RemoteSession against a training-session service (`rlloop serve`), from a program that
// links rlloop without LibTorch: the algorithm (GRPO<RemoteSession>), the environment (synthetic arithmetic), the
// rewards (the math answer plus a user-written one) and the tokenizer run here; sampling, forward_backward and the
// optimizer step run on the server.
//
//   remote_grpo_step URL API_KEY BASE_MODEL
//
// Prints the step's stats as one JSON line. Exits 1, naming what is wrong, unless the step trained: every number
// finite, tokens sampled and trained, at least one group used, the session one optimizer step further, and the
// session's logprobs of a fixed text moved by that step.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <string>
#include <string_view>
#include <vector>

#include <rlloop/algorithms/grpo.hpp>
#include <rlloop/envs/arithmetic.hpp>
#include <rlloop/remote.hpp>
#include <rlloop/rewards/combinators.hpp>
#include <rlloop/rewards/math.hpp>
#include <rlloop/rlloop.hpp>

using namespace rlloop;

namespace {

// A user-written reward: the share of printable ASCII in the completion. A randomly initialised model never
// answers the sum right, so the math reward alone would give every group equal rewards (dropped, nothing
// trained); this spreads each group's rewards out.
struct PrintableShare {
  template <class Problem>
  double operator()(const Problem&, std::string_view completion) const {
    if (completion.empty()) return 0.0;
    double printable = 0;
    for (unsigned char c : completion) printable += c >= 0x20 && c < 0x7f ? 1.0 : 0.0;
    return printable / static_cast<double>(completion.size());
  }
};

// The session's logprobs of a fixed text: they change exactly when the step changed the weights.
std::vector<double> probe(TrainingClient<RemoteSession>& client, const Tokenizer& tokenizer) {
  return client.live_sampling_client().compute_logprobs(ModelInput::from_tokens(tokenizer.encode("12+30=42"))).get();
}

std::string check(const algorithms::PolicyGradientStats& s, std::int64_t step_after, const std::vector<double>& before,
                  const std::vector<double>& after) {
  for (double v : {s.loss, s.reward_mean, s.reward_std, s.entropy, s.clip_fraction})
    if (!std::isfinite(v)) return "a stat is not finite";
  if (s.sampled_tokens <= 0) return "nothing was sampled";
  if (s.groups_used < 1 || s.trained_tokens <= 0) return "no group was trained on";
  if (step_after != 1) return "the session is at step " + std::to_string(step_after) + ", expected 1";
  if (before.empty() || before.size() != after.size()) return "the probe gave no logprobs, or not as many again";
  for (std::size_t i = 0; i < before.size(); ++i) {
    if (!std::isfinite(after[i])) return "a probe logprob is not finite";
    if (after[i] != before[i]) return {};
  }
  return "the optimizer step left the weights as they were";
}

int run(const std::string& url, const std::string& api_key, const std::string& base_model) {
  RemoteOptions remote;
  remote.endpoint = url;
  remote.bearer_key = api_key;
  ServiceClient<RemoteService> service{RemoteService(remote)};
  SessionOptions session;
  session.base_model = base_model;
  session.lora = LoraOptions{4, 8, {"all-linear"}};
  auto client = service.create_training_client(session);

  const auto tokenizer = load_tokenizer(client);
  algorithms::GRPO<RemoteSession> grpo(client, tokenizer,
                                       {.group_size = 4,
                                        .sampling = {.max_tokens = 8, .temperature = 1.0, .seed = 7},
                                        .adam = {.learning_rate = 1e-2}});
  envs::ArithmeticTask task(envs::ArithmeticOptions::for_difficulty(1), 5);
  const auto problems = task.sample(2, envs::Split::train);
  const auto reward =
      rewards::weighted_sum(std::pair{1.0, rewards::MathAnswerReward{}}, std::pair{0.5, PrintableShare{}});

  const auto before = probe(client, *tokenizer);
  const auto stats = grpo.step(problems, reward);
  const auto after = probe(client, *tokenizer);
  const auto step_after = client.get_info().step;
  client.session().stop();

  std::printf("%s\n", algorithms::to_json(stats).dump().c_str());
  const auto wrong = check(stats, step_after, before, after);
  if (!wrong.empty()) {
    std::fprintf(stderr, "remote_grpo_step: %s\n", wrong.c_str());
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: remote_grpo_step URL API_KEY BASE_MODEL\n");
    return 2;
  }
  try {
    return run(argv[1], argv[2], argv[3]);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "remote_grpo_step: %s\n", e.what());
    return 1;
  }
}
