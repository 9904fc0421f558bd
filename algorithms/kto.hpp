// Kahneman-Tversky optimisation (KTO, Ethayarajh et al. 2024) over any Session, trained through
// forward_backward_custom: preference learning from unpaired feedback, each completion labelled desirable or
// undesirable (a thumbs up or down), anchored to a frozen reference model.
//
// For example i, with sequence logprobs summed over the completion tokens under the policy (pi) and the reference:
//   r_i    = pi(y_i | x_i) - ref(y_i | x_i)                     (beta * r_i is the implicit reward)
//   z_ref  = max(0, mean over the batch of r_i), detached         (the reference point, an estimate of KL(pi || ref))
//   l_i    = lambda_D * (1 - sigmoid(beta * (r_i - z_ref)))      desirable
//   l_i    = lambda_U * (1 - sigmoid(beta * (z_ref - r_i)))      undesirable
//   loss   = mean over the batch of l_i
// The paper and TRL estimate z_ref from mismatched pairs (prompt x_i with the completion of x_j), which costs a
// forward pass over completions nobody labelled; here it is the mean log-ratio of the batch's own completions,
// clamped at 0 as a KL is, and, as in the paper, held constant when differentiating (no gradient flows through
// it). The custom loss hands the engine d loss / d logprob_t = weight_t * (d l_i / d r_i) / N per completion token:
//   desirable    d l_i / d r_i = -lambda_D * beta * s * (1 - s),  s = sigmoid(beta * (r_i - z_ref))
//   undesirable  d l_i / d r_i = +lambda_U * beta * s * (1 - s),  s = sigmoid(beta * (z_ref - r_i))
//
//   auto reference = client.save_weights_and_get_sampling_client("reference");
//   rlloop::algorithms::KTO<S> kto(client, reference, {.beta = 0.1});
//   for (...) auto stats = kto.step(next_examples());   // the user owns the loop
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <rlloop/clients.hpp>

#include <rlloop/algorithms/completion.hpp>
#include <rlloop/algorithms/custom_objective.hpp>
#include <rlloop/algorithms/reference.hpp>
#include <rlloop/algorithms/sigmoid.hpp>

namespace rlloop::algorithms {

struct KtoExample {
  std::vector<token_id> prompt;
  std::vector<token_id> completion;
  bool desirable = true;  // the label: a thumbs up (true) or down (false)
};

struct KtoOptions {
  double beta = 0.1;                // scale of the implicit reward, as DPO's
  double desirable_weight = 1.0;    // lambda_D
  double undesirable_weight = 1.0;  // lambda_U; the paper keeps lambda_D n_D / (lambda_U n_U) in [1, 4/3]
  AdamParams adam{.learning_rate = 1e-5};

  void validate() const {
    if (!(beta > 0 && std::isfinite(beta))) throw invalid_argument("KtoOptions::beta must be a finite number > 0");
    if (!(desirable_weight >= 0 && std::isfinite(desirable_weight)))
      throw invalid_argument("KtoOptions::desirable_weight must be a finite number >= 0");
    if (!(undesirable_weight >= 0 && std::isfinite(undesirable_weight)))
      throw invalid_argument("KtoOptions::undesirable_weight must be a finite number >= 0");
    if (desirable_weight == 0 && undesirable_weight == 0)
      throw invalid_argument("KtoOptions::desirable_weight and undesirable_weight must not both be 0");
    if (!(adam.learning_rate > 0)) throw invalid_argument("KtoOptions::adam.learning_rate must be > 0");
  }
};

struct KtoStats {
  std::int64_t step = 0;
  double loss = 0;                // mean over the examples
  double kl = 0;                  // z_ref of the batch
  double reward_desirable = 0;    // mean beta * r of the desirable examples (0 when the batch has none)
  double reward_undesirable = 0;  // the same for the undesirable ones
  double margin = 0;              // reward_desirable - reward_undesirable
  int desirable = 0, undesirable = 0;
  int reference_calls = 0;  // compute_logprobs calls this step (0 once every completion is cached)
};

inline nlohmann::json to_json(const KtoStats& s) {
  return {{"step", s.step},
          {"loss", s.loss},
          {"kl", s.kl},
          {"reward_desirable", s.reward_desirable},
          {"reward_undesirable", s.reward_undesirable},
          {"margin", s.margin},
          {"desirable", s.desirable},
          {"undesirable", s.undesirable},
          {"reference_calls", s.reference_calls}};
}

using KtoState = PreferenceState;

// r_i = (policy - reference) summed over each datum's completion tokens (its "weights").
inline std::vector<double> kto_log_ratios(const std::vector<Datum>& data,
                                          const std::vector<std::vector<double>>& logprobs,
                                          std::span<const double> reference) {
  if (logprobs.size() != data.size() || reference.size() != data.size())
    throw invalid_argument("kto: " + std::to_string(data.size()) + " datums, " + std::to_string(logprobs.size()) +
                           " logprob rows and " + std::to_string(reference.size()) + " reference sums");
  std::vector<double> r;
  for (std::size_t i = 0; i < data.size(); ++i) r.push_back(weighted_logprob_sum(data[i], logprobs[i]) - reference[i]);
  return r;
}

// z_ref = max(0, mean r_i): the batch's estimate of KL(pi || ref).
inline double kto_reference_point(std::span<const double> log_ratios) {
  double s = 0;
  for (double r : log_ratios) s += r;
  return log_ratios.empty() ? 0.0 : std::max(0.0, s / static_cast<double>(log_ratios.size()));
}

// The KTO objective with the reference point given (a constant: d z_ref / d logprob = 0). Pure: golden-tested on
// its own. Metrics carry the stats ("kto:kl", "kto:reward_desirable", "kto:reward_undesirable", "kto:margin").
inline CustomLossResult kto_objective_at(const std::vector<Datum>& data,
                                         const std::vector<std::vector<double>>& logprobs,
                                         std::span<const double> reference, const std::vector<bool>& desirable,
                                         double z_ref, const KtoOptions& options) {
  if (desirable.size() != data.size())
    throw invalid_argument("kto: " + std::to_string(desirable.size()) + " labels for " + std::to_string(data.size()) +
                           " datums");
  const auto r = kto_log_ratios(data, logprobs, reference);
  const double n = static_cast<double>(std::max<std::size_t>(data.size(), 1)), beta = options.beta;
  CustomLossResult out;
  double reward[2] = {0, 0}, count[2] = {0, 0};  // [undesirable, desirable]
  for (std::size_t i = 0; i < data.size(); ++i) {
    const bool good = desirable[i];
    const double lambda = good ? options.desirable_weight : options.undesirable_weight;
    const double s = detail::sigmoid(good ? beta * (r[i] - z_ref) : beta * (z_ref - r[i]));
    out.loss += lambda * (1 - s) / n;
    // d/dr (1 - sigmoid(+-beta (r - z))) = -+beta s (1 - s); 1 - s is sigmoid(-x), accurate in the tails.
    const double s_complement = detail::sigmoid(good ? beta * (z_ref - r[i]) : beta * (r[i] - z_ref));
    const double dl_dr = (good ? -1.0 : 1.0) * lambda * beta * s * s_complement;
    auto w = data[i].loss_fn_inputs.at("weights").as_doubles();
    for (double& x : w) x *= dl_dr / n;
    out.grad_logprobs.push_back(std::move(w));
    reward[good] += beta * r[i];
    count[good] += 1;
  }
  const double rd = count[1] ? reward[1] / count[1] : 0.0, ru = count[0] ? reward[0] / count[0] : 0.0;
  out.metrics = {{"kto:kl", z_ref}, {"kto:reward_desirable", rd}, {"kto:reward_undesirable", ru}, {"kto:margin", rd - ru}};
  return out;
}

// The KTO objective, its reference point estimated from the same logprobs (see the top of this file).
inline CustomLossResult kto_objective(const std::vector<Datum>& data, const std::vector<std::vector<double>>& logprobs,
                                      std::span<const double> reference, const std::vector<bool>& desirable,
                                      const KtoOptions& options) {
  const double z_ref = kto_reference_point(kto_log_ratios(data, logprobs, reference));
  return kto_objective_at(data, logprobs, reference, desirable, z_ref, options);
}

template <Session S>
class KTO {
 public:
  KTO(TrainingClient<S> client, SamplingClient<S> reference, KtoOptions options)
      : client_(std::move(client)), reference_(std::move(reference)), options_(options) {
    options_.validate();
  }

  // One optimizer step on a batch of labelled examples.
  KtoStats step(const std::vector<KtoExample>& batch) {
    const auto p = prepare(batch);
    KtoStats stats = stats_from(objective_step(client_, p.data, objective(p), options_.adam), p);
    ++state_.step;
    return stats;
  }

  // The same statistics on held-out examples, without a gradient (forward only).
  KtoStats evaluate(const std::vector<KtoExample>& batch) {
    const auto p = prepare(batch);
    return stats_from(objective_value(client_, p.data, objective(p)), p);
  }

  const KtoOptions& options() const { return options_; }
  const KtoState& state() const { return state_; }
  KtoState& state() { return state_; }
  TrainingClient<S>& client() { return client_; }

 private:
  struct Prepared {
    std::vector<Datum> data;
    std::vector<double> reference;
    std::vector<bool> desirable;
    int reference_calls = 0;
  };

  Prepared prepare(const std::vector<KtoExample>& batch) {
    if (batch.empty()) throw invalid_argument("KTO: the batch holds no example");
    Prepared p;
    std::vector<ReferenceKey> keys;
    for (std::size_t i = 0; i < batch.size(); ++i) {
      const auto& e = batch[i];
      if (e.prompt.empty() || e.completion.empty())
        throw invalid_argument("KTO: example " + std::to_string(i) + " has an empty prompt or completion");
      p.data.push_back(completion_datum(e.prompt, e.completion));
      keys.push_back(reference_key(e.prompt, e.completion));
      p.desirable.push_back(e.desirable);
    }
    auto ref = reference_sums(reference_, state_.reference_logprobs, std::span<const ReferenceKey>(keys));
    p.reference = std::move(ref.sums);
    p.reference_calls = ref.calls;
    return p;
  }

  // The custom loss of a prepared batch; it owns copies of what it needs (it may run after this call returns).
  CustomLossFn objective(const Prepared& p) const {
    return [ref = p.reference, labels = p.desirable, options = options_](const std::vector<Datum>& d,
                                                                        const std::vector<std::vector<double>>& lp) {
      return kto_objective(d, lp, ref, labels, options);
    };
  }

  KtoStats stats_from(const Metrics& m, const Prepared& p) const {
    KtoStats s;
    s.step = state_.step;
    s.loss = m.at("loss:sum");
    s.kl = m.at("kto:kl");
    s.reward_desirable = m.at("kto:reward_desirable");
    s.reward_undesirable = m.at("kto:reward_undesirable");
    s.margin = m.at("kto:margin");
    s.desirable = static_cast<int>(std::count(p.desirable.begin(), p.desirable.end(), true));
    s.undesirable = static_cast<int>(p.desirable.size()) - s.desirable;
    s.reference_calls = p.reference_calls;
    return s;
  }

  TrainingClient<S> client_;
  SamplingClient<S> reference_;
  KtoOptions options_;
  KtoState state_;
};

}  // namespace rlloop::algorithms
