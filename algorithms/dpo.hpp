// Direct preference optimisation (DPO) and IPO over any Session, trained through forward_backward_custom.
//
// For a pair (prompt, chosen y_w, rejected y_l), with sequence logprobs summed over the completion tokens under
// the policy (pi) and the frozen reference (ref):
//   z      = (pi(y_w) - ref(y_w)) - (pi(y_l) - ref(y_l))
//   DPO    loss = -log sigmoid(beta * z)                 (Rafailov et al. 2023)
//   IPO    loss = (z - 1 / (2 beta))^2                    (Azar et al. 2023; on summed logprobs here)
// The batch loss is the mean over pairs. The custom loss hands the engine d loss / d logprob per token:
// dL/dz * weight_t / N on the chosen completion, its negative on the rejected one. The implicit rewards
// beta * (pi - ref) of each side give the reported accuracy (chosen > rejected) and margin.
//
// The reference logprobs come from a SamplingClient of the base weights (compute_logprobs), once per completion:
// they are cached in DpoState (reference.hpp), so later epochs over the same pairs cost no reference calls.
//
//   auto reference = client.save_weights_and_get_sampling_client("reference");
//   rlloop::algorithms::DPO<S> dpo(client, reference, {.beta = 0.1});
//   for (...) auto stats = dpo.step(next_pairs());   // the user owns the loop
#pragma once
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include <rlloop/clients.hpp>

#include <rlloop/algorithms/completion.hpp>
#include <rlloop/algorithms/custom_objective.hpp>
#include <rlloop/algorithms/reference.hpp>
#include <rlloop/algorithms/sigmoid.hpp>

namespace rlloop::algorithms {

struct PreferencePair {
  std::vector<token_id> prompt;
  std::vector<token_id> chosen;  // the preferred completion
  std::vector<token_id> rejected;
};

// A preference loss as a function of z (see above): its value and d loss / d z.
struct PreferenceTerm {
  double loss = 0, dloss_dz = 0;
};

// DPO: -log sigmoid(beta z); with label_smoothing e (conservative DPO) -(1-e) log s(beta z) - e log s(-beta z).
struct SigmoidPreference {
  double label_smoothing = 0.0;
  PreferenceTerm operator()(double z, double beta) const {
    using detail::log_sigmoid, detail::sigmoid;
    const double x = beta * z;
    const double e = label_smoothing;
    return {-(1 - e) * log_sigmoid(x) - e * log_sigmoid(-x), -beta * (1 - e) * sigmoid(-x) + beta * e * sigmoid(x)};
  }
};

// IPO: (z - 1/(2 beta))^2, a squared loss that does not push the margin to infinity on deterministic preferences.
struct IpoPreference {
  PreferenceTerm operator()(double z, double beta) const {
    const double d = z - 1 / (2 * beta);
    return {d * d, 2 * d};
  }
};

struct DpoOptions {
  double beta = 0.1;  // strength of the KL anchor to the reference (the implicit reward's scale)
  AdamParams adam{.learning_rate = 1e-5};

  void validate() const {
    if (!(beta > 0 && std::isfinite(beta))) throw invalid_argument("DpoOptions::beta must be a finite number > 0");
    if (!(adam.learning_rate > 0)) throw invalid_argument("DpoOptions::adam.learning_rate must be > 0");
  }
};

struct DpoStats {
  std::int64_t step = 0;
  double loss = 0;           // mean over pairs
  double accuracy = 0;       // share of pairs whose chosen implicit reward beats the rejected one
  double reward_chosen = 0;  // mean beta * (pi - ref) of the chosen completions
  double reward_rejected = 0;
  double margin = 0;  // reward_chosen - reward_rejected
  int pairs = 0;
  int reference_calls = 0;  // compute_logprobs calls this step (0 once every pair is cached)
};

inline nlohmann::json to_json(const DpoStats& s) {
  return {{"step", s.step},
          {"loss", s.loss},
          {"accuracy", s.accuracy},
          {"reward_chosen", s.reward_chosen},
          {"reward_rejected", s.reward_rejected},
          {"margin", s.margin},
          {"pairs", s.pairs},
          {"reference_calls", s.reference_calls}};
}

using DpoState = PreferenceState;

// The preference objective on a batch laid out [chosen_0, rejected_0, chosen_1, rejected_1, ...], with the
// reference sums of each side. Pure: golden-tested on its own, and the body of the custom loss. Metrics carry
// the stats ("dpo:accuracy", "dpo:margin", "dpo:reward_chosen", "dpo:reward_rejected").
template <class LossPolicy>
CustomLossResult preference_objective(const std::vector<Datum>& data, const std::vector<std::vector<double>>& logprobs,
                                      std::span<const double> ref_chosen, std::span<const double> ref_rejected,
                                      double beta, const LossPolicy& policy) {
  const std::size_t n = ref_chosen.size();
  if (data.size() != 2 * n || logprobs.size() != 2 * n || ref_rejected.size() != n)
    throw invalid_argument("preference_objective: expected " + std::to_string(2 * n) +
                           " datums (chosen, rejected) for " + std::to_string(n) + " pairs, got " +
                           std::to_string(data.size()));
  CustomLossResult out;
  double acc = 0, rc = 0, rr = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const Datum &dc = data[2 * i], &dr = data[2 * i + 1];
    const double chosen = weighted_logprob_sum(dc, logprobs[2 * i]) - ref_chosen[i];
    const double rejected = weighted_logprob_sum(dr, logprobs[2 * i + 1]) - ref_rejected[i];
    const PreferenceTerm t = policy(chosen - rejected, beta);
    out.loss += t.loss / static_cast<double>(n);
    const double g = t.dloss_dz / static_cast<double>(n);
    for (const auto& [d, sign] : {std::pair{&dc, 1.0}, std::pair{&dr, -1.0}}) {
      auto w = d->loss_fn_inputs.at("weights").as_doubles();
      for (double& x : w) x *= sign * g;
      out.grad_logprobs.push_back(std::move(w));
    }
    acc += chosen > rejected ? 1.0 : 0.0;
    rc += beta * chosen;
    rr += beta * rejected;
  }
  const double nd = static_cast<double>(std::max<std::size_t>(n, 1));
  out.metrics = {{"dpo:accuracy", acc / nd},
                 {"dpo:reward_chosen", rc / nd},
                 {"dpo:reward_rejected", rr / nd},
                 {"dpo:margin", (rc - rr) / nd}};
  return out;
}

template <Session S, class LossPolicy = SigmoidPreference>
class PreferenceOptimization {
 public:
  PreferenceOptimization(TrainingClient<S> client, SamplingClient<S> reference, DpoOptions options,
                         LossPolicy policy = {})
      : client_(std::move(client)), reference_(std::move(reference)), options_(options), policy_(std::move(policy)) {
    options_.validate();
  }

  // One optimizer step on a batch of pairs.
  DpoStats step(const std::vector<PreferencePair>& batch) {
    const auto p = prepare(batch);
    DpoStats stats = stats_from(objective_step(client_, p.data, objective(p), options_.adam), batch.size(), p);
    ++state_.step;
    return stats;
  }

  // The same statistics on held-out pairs, without a gradient (forward only).
  DpoStats evaluate(const std::vector<PreferencePair>& batch) {
    const auto p = prepare(batch);
    return stats_from(objective_value(client_, p.data, objective(p)), batch.size(), p);
  }

  const DpoOptions& options() const { return options_; }
  const DpoState& state() const { return state_; }
  DpoState& state() { return state_; }
  TrainingClient<S>& client() { return client_; }

 private:
  struct Prepared {
    std::vector<Datum> data;
    std::vector<double> ref_chosen, ref_rejected;
    int reference_calls = 0;
  };

  // Datums [chosen, rejected] per pair, and the reference sums (fetched for uncached completions).
  Prepared prepare(const std::vector<PreferencePair>& batch) {
    if (batch.empty()) throw invalid_argument("DPO: the batch holds no preference pair");
    Prepared p;
    std::vector<ReferenceKey> keys;
    for (std::size_t i = 0; i < batch.size(); ++i) {
      const auto& pair = batch[i];
      if (pair.prompt.empty() || pair.chosen.empty() || pair.rejected.empty())
        throw invalid_argument("DPO: pair " + std::to_string(i) +
                               " has an empty prompt, chosen or rejected completion");
      for (const auto* completion : {&pair.chosen, &pair.rejected}) {
        p.data.push_back(completion_datum(pair.prompt, *completion));
        keys.push_back(reference_key(pair.prompt, *completion));
      }
    }
    const auto ref = reference_sums(reference_, state_.reference_logprobs, std::span<const ReferenceKey>(keys));
    for (std::size_t k = 0; k < keys.size(); ++k) (k % 2 == 0 ? p.ref_chosen : p.ref_rejected).push_back(ref.sums[k]);
    p.reference_calls = ref.calls;
    return p;
  }

  // The custom loss of a prepared batch; it owns copies of what it needs (it may run after this call returns).
  CustomLossFn objective(const Prepared& p) const {
    return [ref_c = p.ref_chosen, ref_r = p.ref_rejected, beta = options_.beta, policy = policy_](
               const std::vector<Datum>& d, const std::vector<std::vector<double>>& lp) {
      return preference_objective(d, lp, ref_c, ref_r, beta, policy);
    };
  }

  DpoStats stats_from(const Metrics& m, std::size_t pairs, const Prepared& p) const {
    DpoStats s;
    s.step = state_.step;
    s.loss = m.at("loss:sum");
    s.accuracy = m.at("dpo:accuracy");
    s.reward_chosen = m.at("dpo:reward_chosen");
    s.reward_rejected = m.at("dpo:reward_rejected");
    s.margin = m.at("dpo:margin");
    s.pairs = static_cast<int>(pairs);
    s.reference_calls = p.reference_calls;
    return s;
  }

  TrainingClient<S> client_;
  SamplingClient<S> reference_;
  DpoOptions options_;
  LossPolicy policy_;
  DpoState state_;
};

template <Session S>
using DPO = PreferenceOptimization<S, SigmoidPreference>;

template <Session S>
using IPO = PreferenceOptimization<S, IpoPreference>;

}  // namespace rlloop::algorithms
