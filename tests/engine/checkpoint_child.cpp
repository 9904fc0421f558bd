// A separate process for the checkpoint tests (tests/engine/checkpoint_test.cpp):
//   checkpoint_child run     DIR STEPS SAVE_AT   train STEPS steps, save_state "at-SAVE_AT" after that step
//                                                 and "final" at the end
//   checkpoint_child resume  DIR STEPS SAVE_AT   load "at-SAVE_AT", train the remaining steps, save "resumed"
//   checkpoint_child forever DIR                  train and save_state "latest" after every step until killed
// Every step samples with the session's own RNG (no seed) and trains on the samples, so a resume is only
// bit-identical if weights, optimizer moments, step count and RNG state all round-trip.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "session_util.hpp"

using namespace rlloop;
using namespace test_util;

namespace {
void train_step(TrainingClient<LocalSession>& tc, int step) {
  auto prompt = bytes(std::to_string(step % 7) + "+");
  auto s = tc.live_sampling_client().sample(ModelInput::from_tokens(prompt), 2, SamplingParams{.max_tokens = 4}).get();
  std::vector<Datum> batch{sft_datum("3+4=7\n")};
  for (const auto& seq : s.sequences) {
    auto full = prompt;
    full.insert(full.end(), seq.tokens.begin(), seq.tokens.end());
    Datum d;
    d.model_input = ModelInput::from_tokens(std::vector<token_id>(full.begin(), full.end() - 1));
    d.loss_fn_inputs["target_tokens"] = TensorData::from_tokens(std::vector<token_id>(full.begin() + 1, full.end()));
    d.loss_fn_inputs["weights"] = TensorData::from_floats(std::vector<float>(full.size() - 1, 0.5f));
    batch.push_back(std::move(d));
  }
  tc.forward_backward(batch, LossSpec::cross_entropy());
  tc.optim_step(AdamParams{.learning_rate = 5e-3, .weight_decay = 0.01, .grad_clip_norm = 1.0});
}
}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) return 2;
  const std::string mode = argv[1];
  LocalService svc(service_in(argv[2]));
  auto tc =
      ServiceClient<LocalService>(svc).create_lora_training_client("rlloop-tiny", {.rank = 4, .alpha = 8, .seed = 11});
  if (mode == "forever") {
    for (int step = 0;; ++step) {
      train_step(tc, step);
      tc.save_state("latest").get();
    }
  }
  if (argc < 5) return 2;
  const int steps = std::atoi(argv[3]), save_at = std::atoi(argv[4]);
  int first = 0;
  if (mode == "resume") {
    tc.load_state(std::string(argv[2]) + "/at-" + std::to_string(save_at), true).get();
    first = save_at;
  }
  for (int step = first; step < steps; ++step) {
    train_step(tc, step);
    if (mode == "run" && step + 1 == save_at) tc.save_state("at-" + std::to_string(save_at)).get();
  }
  tc.save_state(mode == "run" ? "final" : "resumed").get();
  return 0;
}
