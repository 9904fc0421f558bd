// Running an objective written as a pure function of the per-token logprobs (the body of a CustomLossFn, as
// DPO / IPO and KTO are): one optimizer step through forward_backward_custom, or its value on the current
// weights without a gradient. Both return the metrics the objective reports, with its loss as "loss:sum".
#pragma once
#include <vector>

#include <rlloop/clients.hpp>

namespace rlloop::algorithms {

template <Session S>
Metrics objective_step(TrainingClient<S>& client, const std::vector<Datum>& data, CustomLossFn objective,
                       const AdamParams& adam) {
  auto fb = client.forward_backward_custom(data, std::move(objective));
  auto opt = client.optim_step(adam);  // submitted back to back
  Metrics metrics = fb.get().metrics;
  opt.get();
  return metrics;
}

template <Session S>
Metrics objective_value(TrainingClient<S>& client, const std::vector<Datum>& data, const CustomLossFn& objective) {
  const auto out = client.forward(data, LossSpec::cross_entropy()).get();
  std::vector<std::vector<double>> logprobs;
  for (std::size_t i = 0; i < data.size(); ++i) logprobs.push_back(out.logprobs(i));
  auto result = objective(data, logprobs);
  result.metrics["loss:sum"] = result.loss;  // as forward_backward_custom reports it
  return result.metrics;
}

}  // namespace rlloop::algorithms
