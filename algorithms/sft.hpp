// Supervised fine-tuning: cross_entropy on datums whose weights select the tokens to learn (e.g. the
// assistant turns of a chat, see <rlloop/chat.hpp> SupervisedExample::to_datum()).
#pragma once
#include <cstdint>
#include <vector>

#include <rlloop/clients.hpp>

namespace rlloop::algorithms {

// Prompt + completion as one next-token datum: weight 0 on the prompt, 1 on the completion.
inline Datum completion_datum(const std::vector<token_id>& prompt, const std::vector<token_id>& completion) {
  if (prompt.empty() || completion.empty())
    throw invalid_argument("completion_datum: prompt and completion must be non-empty");
  std::vector<token_id> full = prompt;
  full.insert(full.end(), completion.begin(), completion.end());
  std::vector<float> w(full.size() - 1, 0.0f);
  for (std::size_t j = prompt.size() - 1; j < w.size(); ++j) w[j] = 1.0f;
  Datum d;
  d.model_input = ModelInput::from_tokens(std::vector<token_id>(full.begin(), full.end() - 1));
  d.loss_fn_inputs["target_tokens"] = TensorData::from_tokens(std::vector<token_id>(full.begin() + 1, full.end()));
  d.loss_fn_inputs["weights"] = TensorData::from_floats(std::move(w));
  return d;
}

struct SftOptions {
  AdamParams adam{.learning_rate = 1e-4};
  void validate() const {
    if (!(adam.learning_rate > 0)) throw invalid_argument("SftOptions::adam.learning_rate must be > 0");
  }
};

struct SftStats {
  std::int64_t step = 0;
  double loss_per_token = 0;  // weighted loss / total weight
  double weight = 0;          // tokens trained on (sum of weights)
};

template <Session S>
class Sft {
 public:
  Sft(TrainingClient<S> client, SftOptions options) : client_(std::move(client)), options_(std::move(options)) {
    options_.validate();
  }

  // One optimizer step on one batch.
  SftStats step(const std::vector<Datum>& batch) {
    double weight = 0;
    for (const auto& d : batch)
      if (auto it = d.loss_fn_inputs.find("weights"); it != d.loss_fn_inputs.end())
        for (double w : it->second.as_doubles()) weight += w;
    auto fb = client_.forward_backward(batch, LossSpec::cross_entropy());
    auto opt = client_.optim_step(options_.adam);  // submitted without waiting for forward_backward
    SftStats stats{step_++, fb.get().metrics.at("loss:sum") / std::max(weight, 1e-9), weight};
    opt.get();
    return stats;
  }

  TrainingClient<S>& client() { return client_; }

 private:
  TrainingClient<S> client_;
  SftOptions options_;
  std::int64_t step_ = 0;
};

}  // namespace rlloop::algorithms
