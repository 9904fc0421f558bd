// Supervised fine-tuning: cross_entropy on datums whose weights select the tokens to learn (e.g. the
// assistant turns of a chat, see <rlloop/chat.hpp> SupervisedExample::to_datum()).
#pragma once
#include <cstdint>
#include <vector>

#include <nlohmann/json.hpp>

#include <rlloop/clients.hpp>

#include <rlloop/algorithms/completion.hpp>

namespace rlloop::algorithms {

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

inline nlohmann::json to_json(const SftStats& s) {
  return {{"step", s.step}, {"loss_per_token", s.loss_per_token}, {"weight", s.weight}};
}

// Run state, apart from the immutable options: save it (as JSON) beside the session's save_state.
struct SftState {
  std::int64_t step = 0;
  bool operator==(const SftState&) const = default;
};
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(SftState, step)

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
    SftStats stats{state_.step, fb.get().metrics.at("loss:sum") / std::max(weight, 1e-9), weight};
    opt.get();
    ++state_.step;
    return stats;
  }

  const SftOptions& options() const { return options_; }
  const SftState& state() const { return state_; }
  SftState& state() { return state_; }
  TrainingClient<S>& client() { return client_; }

 private:
  TrainingClient<S> client_;
  SftOptions options_;
  SftState state_;
};

}  // namespace rlloop::algorithms
