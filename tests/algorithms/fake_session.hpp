// A deterministic in-memory training session for algorithm tests: no LibTorch, instant, exact.
//
// The "model" is a table of logits per context, where the context is the last `context_length` tokens
// (1 = a bigram model). Rows are created lazily; a fresh row holds seeded values in [-init_scale, init_scale]
// derived from (seed, context, token), so the same options always give the same model. The built-in losses use
// the formulas of src/engine/runtime/loss.hpp (per token, summed; for the RL losses a datum's optional `weights` multiply each
// token's term, exactly like src/engine/runtime/loss.cpp), their gradient w.r.t. each logprob is written out by hand and
// chained through log-softmax into the table, and optim_step is the engine's AdamW (bias-corrected, decoupled
// weight decay, global grad-norm clipping). Operations run synchronously; errors come back as failed futures,
// as with LocalSession.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <rlloop/batch_checks.hpp>
#include <rlloop/session.hpp>
#include <rlloop/tokenizer.hpp>

namespace rlloop::testing {

struct FakeSessionOptions {
  std::int64_t vocab_size = 8;
  int context_length = 1;   // tokens of context a row is keyed by
  double init_scale = 0.0;  // 0 = every row starts uniform
  std::int64_t seed = 0;
  std::optional<token_id> eos_token_id;
  std::string tokenizer = "fake";  // what info().tokenizer reports
  // Decodes tokens for stop strings; without it a request with stop strings is rejected.
  std::shared_ptr<const Tokenizer> decoder;

  void validate() const {
    if (vocab_size < 2) throw invalid_argument("FakeSessionOptions::vocab_size must be >= 2");
    if (context_length < 1) throw invalid_argument("FakeSessionOptions::context_length must be >= 1");
    if (!(init_scale >= 0)) throw invalid_argument("FakeSessionOptions::init_scale must be >= 0");
    if (eos_token_id && (*eos_token_id < 0 || *eos_token_id >= vocab_size))
      throw invalid_argument("FakeSessionOptions::eos_token_id is out of range");
  }
};

class FakeSession {
 public:
  using Context = std::vector<token_id>;
  using Table = std::map<Context, std::vector<double>>;

  explicit FakeSession(FakeSessionOptions options = {}) : options_(std::move(options)) { options_.validate(); }

  Future<ForwardBackwardOutput> forward(const std::vector<Datum>& data, const LossSpec& loss) {
    return run<ForwardBackwardOutput>([&] { return builtin(data, loss, false); });
  }
  Future<ForwardBackwardOutput> forward_backward(const std::vector<Datum>& data, const LossSpec& loss) {
    return run<ForwardBackwardOutput>([&] { return builtin(data, loss, true); });
  }
  Future<ForwardBackwardOutput> forward_backward_custom(const std::vector<Datum>& data, const CustomLossFn& fn) {
    return run<ForwardBackwardOutput>([&] { return custom(data, fn); });
  }
  Future<OptimStepOutput> optim_step(const AdamParams& p) {
    return run<OptimStepOutput>([&] { return adam_step(p); });
  }
  Future<CheckpointRef> save_state(const std::string& name) {
    return run<CheckpointRef>([&] {
      const std::string path = "fake://state/" + name;
      states_[path] = Snapshot{weights_, m_, v_, step_};
      return CheckpointRef{path};
    });
  }
  Future<LoadStateOutput> load_state(const std::string& path, bool with_optimizer) {
    return run<LoadStateOutput>([&] {
      auto it = states_.find(path);
      if (it == states_.end()) throw not_found("load_state: no saved state '" + path + "'");
      weights_ = it->second.weights;
      grads_.clear();
      if (with_optimizer) {
        m_ = it->second.m, v_ = it->second.v, step_ = it->second.step;
      } else {  // as the engine: weights only means fresh moments
        m_.clear(), v_.clear(), step_ = 0;
      }
      return LoadStateOutput{};
    });
  }
  Future<CheckpointRef> save_weights_for_sampler(const std::string& name) {
    return run<CheckpointRef>([&] {
      const std::string path = "fake://sampler/" + name;
      samplers_[path] = weights_;
      return CheckpointRef{path};
    });
  }
  Future<SampleResponse> sample(const SampleRequest& req) {
    return run<SampleResponse>([&] { return do_sample(req); });
  }
  Future<std::vector<double>> compute_logprobs(const ComputeLogprobsRequest& req) {
    return run<std::vector<double>>([&] {
      validate_model_input(req.prompt, options_.vocab_size, "compute_logprobs: ");
      return prompt_logprobs(weights_for(req.model_path), req.prompt.tokens());
    });
  }
  SessionInfo info() {
    std::lock_guard lock(mu_);
    SessionInfo i;
    i.name = "fake";
    i.base_model = "fake-table";
    i.model_type = "table";
    i.vocab_size = options_.vocab_size;
    i.max_position_embeddings = 1 << 20;
    i.num_parameters = i.num_trainable_parameters = static_cast<std::int64_t>(weights_.size()) * options_.vocab_size;
    i.tokenizer = options_.tokenizer;
    i.eos_token_id = options_.eos_token_id;
    i.device = "fake";
    i.step = step_;
    return i;
  }
  TokenUsage usage() {
    std::lock_guard lock(mu_);
    return usage_;
  }

  // For tests: the current log-probability of `target` after `context` (its last context_length tokens).
  double logprob(const std::vector<token_id>& context, token_id target) {
    std::lock_guard lock(mu_);
    return log_softmax(row(weights_, context_of(context, context.size())))[static_cast<std::size_t>(target)];
  }

  // d loss / d logprob of one token for a built-in loss (src/engine/runtime/loss.hpp); `m` is the token's weight. Public and
  // static so tests can check it against hand-computed values.
  struct TokenTerm {
    double loss = 0, grad = 0;
    bool clipped = false;  // the clipped branch of the objective is the one taken (ppo, cispo, stable_reinforce)
  };
  static TokenTerm token_term(const LossSpec& spec, double lp, double q, double adv, double m) {
    const double r = std::exp(lp - q);
    const double rc = std::clamp(r, spec.min_ratio(), spec.max_ratio());
    switch (spec.fn) {
      case LossFn::cross_entropy:
        return {-lp * m, -m, false};
      case LossFn::importance_sampling:
        return {-r * adv * m, -r * adv * m, false};
      case LossFn::ppo: {
        // min(r A, clamp(r) A): the gradient flows through r unless the clamped term is the smaller one and the
        // clamp is active (then d/dr is 0). Ties (r inside the clip range) give the full gradient, as in torch.
        const bool inside = r >= spec.min_ratio() && r <= spec.max_ratio();
        const bool unclipped_min = inside || r * adv < rc * adv;
        return {-std::min(r * adv, rc * adv) * m, unclipped_min ? -r * adv * m : 0.0, rc * adv < r * adv};
      }
      case LossFn::cispo:
        return {-rc * lp * adv * m, -rc * adv * m, rc != r};
      case LossFn::dro: {
        const double d = lp - q;
        return {-(lp * adv - 0.5 * spec.beta * d * d) * m, -(adv - spec.beta * d) * m, false};
      }
      case LossFn::stable_reinforce: {
        // The weight min(r, C) is a constant; the KL penalty k3 = (r - 1) - log r has d/dlp = r - 1.
        const double w = std::min(r, spec.truncation), k3 = (r - 1) - (lp - q);
        return {-(w * lp * adv - spec.kl_coeff * k3) * m, -(w * adv - spec.kl_coeff * (r - 1)) * m,
                r > spec.truncation};
      }
      case LossFn::value:
        throw invalid_argument("the fake session has no value head: loss 'value' is not a token term");
      case LossFn::gspo:
        break;
    }
    throw invalid_argument("gspo's token term needs its sequence's ratio: gspo_terms");
  }

  // GSPO-token's terms of one sequence: PPO's at each token with the sequence's ratio s = exp(mean(lp - q)) over its
  // loss-bearing tokens (w != 0) as the ratio's value, i.e. PPO's term with q' = lp - log s.
  static std::vector<TokenTerm> gspo_terms(const LossSpec& spec, const std::vector<double>& lp,
                                           const std::vector<double>& q, const std::vector<double>& adv,
                                           const std::vector<double>& w) {
    double sum = 0, n = 0;
    for (std::size_t j = 0; j < lp.size(); ++j)
      if (w[j] != 0.0) sum += lp[j] - q[j], n += 1;
    const double log_s = n > 0 ? sum / n : 0.0;
    LossSpec ppo = spec;
    ppo.fn = LossFn::ppo;
    std::vector<TokenTerm> out;
    for (std::size_t j = 0; j < lp.size(); ++j) out.push_back(token_term(ppo, lp[j], lp[j] - log_s, adv[j], w[j]));
    return out;
  }

 private:
  struct Snapshot {
    Table weights, m, v;
    std::int64_t step = 0;
  };

  // Runs an operation under the lock and turns an exception into a failed future (errors surface on get()).
  template <class T, class F>
  Future<T> run(F&& f) {
    Promise<T> p;
    auto fut = p.future();
    std::lock_guard lock(mu_);
    p.fulfil(std::forward<F>(f));
    return fut;
  }

  static std::uint64_t mix(std::uint64_t x) {  // splitmix64 finaliser: a cheap, well-spread hash
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
  }

  // The last context_length tokens of tokens[0, end) (fewer at the start of a sequence).
  Context context_of(const std::vector<token_id>& tokens, std::size_t end) const {
    const std::size_t k = std::min<std::size_t>(end, static_cast<std::size_t>(options_.context_length));
    return Context(tokens.begin() + static_cast<std::ptrdiff_t>(end - k),
                   tokens.begin() + static_cast<std::ptrdiff_t>(end));
  }

  // The logits of a context; an unseen row gets its seeded initial values (not stored: reading is pure).
  std::vector<double> row(const Table& table, const Context& ctx) const {
    if (auto it = table.find(ctx); it != table.end()) return it->second;
    std::vector<double> out(static_cast<std::size_t>(options_.vocab_size), 0.0);
    if (options_.init_scale == 0) return out;
    std::uint64_t h = mix(static_cast<std::uint64_t>(options_.seed));
    for (token_id t : ctx) h = mix(h ^ static_cast<std::uint64_t>(t));
    for (std::size_t j = 0; j < out.size(); ++j) {
      const double u = static_cast<double>(mix(h + j) >> 11) * 0x1.0p-53;  // [0, 1)
      out[j] = options_.init_scale * (2 * u - 1);
    }
    return out;
  }
  std::vector<double>& stored_row(Table& table, const Context& ctx) {
    auto it = table.find(ctx);
    if (it == table.end()) it = table.emplace(ctx, row(weights_, ctx)).first;
    return it->second;
  }

  static std::vector<double> log_softmax(std::vector<double> logits) {
    const double mx = *std::max_element(logits.begin(), logits.end());
    double z = 0;
    for (double x : logits) z += std::exp(x - mx);
    const double lz = mx + std::log(z);
    for (double& x : logits) x -= lz;
    return logits;
  }

  const Table& weights_for(const std::optional<std::string>& path) const {
    if (!path) return weights_;
    auto it = samplers_.find(*path);
    if (it == samplers_.end()) throw not_found("no sampler weights at '" + *path + "'");
    return it->second;
  }

  std::vector<double> prompt_logprobs(const Table& w, const std::vector<token_id>& tokens) const {
    std::vector<double> out(tokens.size(), 0.0);
    for (std::size_t i = 1; i < tokens.size(); ++i)
      out[i] = log_softmax(row(w, context_of(tokens, i)))[static_cast<std::size_t>(tokens[i])];
    return out;
  }

  // logprob of each target token of a datum; with `grad` given, adds grad[j] * d lp_j / d logits to grads_.
  std::vector<double> datum_logprobs(const Datum& d) const {
    const auto input = d.model_input.tokens();
    const auto targets = d.loss_fn_inputs.at("target_tokens").as_doubles();
    std::vector<double> lp(input.size());
    for (std::size_t j = 0; j < input.size(); ++j)
      lp[j] = log_softmax(row(weights_, context_of(input, j + 1)))[static_cast<std::size_t>(targets[j])];
    return lp;
  }
  void accumulate(const Datum& d, const std::vector<double>& dloss_dlp) {
    const auto input = d.model_input.tokens();
    const auto targets = d.loss_fn_inputs.at("target_tokens").as_doubles();
    for (std::size_t j = 0; j < input.size(); ++j) {
      if (dloss_dlp[j] == 0) continue;
      const Context ctx = context_of(input, j + 1);
      const auto lsm = log_softmax(row(weights_, ctx));
      auto& g = grads_.try_emplace(ctx, lsm.size(), 0.0).first->second;
      // d log_softmax(z)[y] / d z_k = [k == y] - softmax(z)_k
      for (std::size_t k = 0; k < lsm.size(); ++k)
        g[k] += dloss_dlp[j] * ((k == static_cast<std::size_t>(targets[j]) ? 1.0 : 0.0) - std::exp(lsm[k]));
    }
  }

  static std::vector<double> input_or(const Datum& d, const char* key, double fallback) {
    auto it = d.loss_fn_inputs.find(key);
    if (it == d.loss_fn_inputs.end()) return std::vector<double>(d.model_input.length(), fallback);
    return it->second.as_doubles();
  }

  ForwardBackwardOutput builtin(const std::vector<Datum>& data, const LossSpec& spec, bool backward) {
    spec.validate();
    validate_batch(data, spec.fn, options_.vocab_size);
    ForwardBackwardOutput out;
    double loss = 0, clipped = 0, bearing = 0;
    std::int64_t tokens = 0;
    for (const auto& d : data) {
      const auto lp = datum_logprobs(d);
      const auto w = input_or(d, "weights", 1.0), q = input_or(d, "logprobs", 0.0), a = input_or(d, "advantages", 0.0);
      std::vector<double> grad(lp.size());
      const auto gspo = spec.fn == LossFn::gspo ? gspo_terms(spec, lp, q, a, w) : std::vector<TokenTerm>{};
      for (std::size_t j = 0; j < lp.size(); ++j) {
        const auto t = spec.fn == LossFn::gspo ? gspo[j] : token_term(spec, lp[j], q[j], a[j], w[j]);
        loss += t.loss;
        grad[j] = t.grad;
        // clip_fraction's count, as the engine's: loss-bearing tokens (weight != 0) where the clip branch won.
        bearing += w[j] != 0.0;
        clipped += t.clipped && w[j] != 0.0;
      }
      if (backward) accumulate(d, grad);
      tokens += static_cast<std::int64_t>(lp.size());
      out.loss_fn_outputs.push_back({{"logprobs", TensorData::from_floats(std::vector<float>(lp.begin(), lp.end()))}});
    }
    out.metrics["loss:sum"] = loss;
    if (const std::string_view clip = loss_info(spec.fn).clip_metric; !clip.empty())
      out.metrics[std::string(clip)] = bearing > 0 ? clipped / bearing : 0.0;
    out.training_tokens = tokens;
    usage_.training += tokens;
    return out;
  }

  ForwardBackwardOutput custom(const std::vector<Datum>& data, const CustomLossFn& fn) {
    if (!fn) throw invalid_argument("forward_backward_custom: no loss function given");
    validate_custom_batch(data, options_.vocab_size);
    std::vector<std::vector<double>> lps;
    ForwardBackwardOutput out;
    for (const auto& d : data) {
      lps.push_back(datum_logprobs(d));
      out.loss_fn_outputs.push_back(
          {{"logprobs", TensorData::from_floats(std::vector<float>(lps.back().begin(), lps.back().end()))}});
      out.training_tokens += static_cast<std::int64_t>(lps.back().size());
    }
    CustomLossResult r = fn(data, lps);
    if (r.grad_logprobs.size() != data.size())
      throw invalid_argument("forward_backward_custom: the loss function returned gradients for " +
                             std::to_string(r.grad_logprobs.size()) + " datums, expected " +
                             std::to_string(data.size()));
    for (std::size_t i = 0; i < data.size(); ++i) {
      if (r.grad_logprobs[i].size() != lps[i].size())
        throw invalid_argument("forward_backward_custom: gradient of datum " + std::to_string(i) + " has " +
                               std::to_string(r.grad_logprobs[i].size()) + " values, expected " +
                               std::to_string(lps[i].size()));
      for (double g : r.grad_logprobs[i])
        if (!std::isfinite(g))
          throw invalid_argument("forward_backward_custom: gradient of datum " + std::to_string(i) + " is not finite");
    }
    for (std::size_t i = 0; i < data.size(); ++i) accumulate(data[i], r.grad_logprobs[i]);
    out.metrics = r.metrics;
    out.metrics["loss:sum"] = r.loss;
    usage_.training += out.training_tokens;
    return out;
  }

  OptimStepOutput adam_step(const AdamParams& p) {
    if (!(p.learning_rate > 0 && std::isfinite(p.learning_rate)))
      throw invalid_argument("AdamParams.learning_rate must be > 0");
    if (!(p.beta1 >= 0 && p.beta1 < 1)) throw invalid_argument("AdamParams.beta1 must be in [0, 1)");
    if (!(p.beta2 >= 0 && p.beta2 < 1)) throw invalid_argument("AdamParams.beta2 must be in [0, 1)");
    if (!(p.eps > 0)) throw invalid_argument("AdamParams.eps must be > 0");
    if (!(p.weight_decay >= 0 && p.weight_decay <= 1))
      throw invalid_argument("AdamParams.weight_decay must be in [0, 1]");
    double sq = 0;
    for (const auto& [ctx, g] : grads_)
      for (double x : g) sq += x * x;
    const double norm = std::sqrt(sq);
    if (!std::isfinite(norm)) {
      grads_.clear();
      throw invalid_argument("optim_step: the gradient norm is not finite; the step was skipped and gradients cleared");
    }
    const double scale =
        p.grad_clip_norm && *p.grad_clip_norm > 0 && norm > *p.grad_clip_norm ? *p.grad_clip_norm / (norm + 1e-6) : 1.0;
    ++step_;
    const double b1 = 1 - std::pow(p.beta1, double(step_)), b2 = 1 - std::pow(p.beta2, double(step_));
    for (const auto& [ctx, g] : grads_) {
      auto& w = stored_row(weights_, ctx);
      auto& m = m_.try_emplace(ctx, g.size(), 0.0).first->second;
      auto& v = v_.try_emplace(ctx, g.size(), 0.0).first->second;
      for (std::size_t k = 0; k < g.size(); ++k) {
        const double gk = g[k] * scale;
        m[k] = p.beta1 * m[k] + (1 - p.beta1) * gk;
        v[k] = p.beta2 * v[k] + (1 - p.beta2) * gk * gk;
        w[k] *= 1 - p.learning_rate * p.weight_decay;
        w[k] -= p.learning_rate * (m[k] / b1) / (std::sqrt(v[k] / b2) + p.eps);
      }
    }
    // Only rows that received a gradient move (sparse Adam): the table is created lazily, so a row never
    // touched since the last step has no gradient at all, like an engine parameter whose grad is undefined.
    grads_.clear();
    return {{{"grad_norm", norm}, {"lr", p.learning_rate}, {"step", double(step_)}}};
  }

  SampleResponse do_sample(const SampleRequest& req) {
    validate_model_input(req.prompt, options_.vocab_size, "sample: prompt: ");
    const auto& p = req.params;
    if (req.num_samples < 1) throw invalid_argument("sample: num_samples must be >= 1");
    if (p.max_tokens < 1) throw invalid_argument("sample: max_tokens must be >= 1");
    if (!(p.temperature >= 0)) throw invalid_argument("sample: temperature must be >= 0");
    if (!(p.top_p > 0 && p.top_p <= 1)) throw invalid_argument("sample: top_p must be in (0, 1]");
    if (!p.stop.empty() && !options_.decoder)
      throw unsupported("sample: stop strings need FakeSessionOptions::decoder");
    const Table& w = weights_for(req.model_path);
    const auto prompt = req.prompt.tokens();
    // Same seed + input => same output; without a seed, a per-session counter keeps runs reproducible.
    const std::uint64_t base =
        p.seed ? mix(static_cast<std::uint64_t>(*p.seed)) : mix(options_.seed ^ ++unseeded_calls_);
    SampleResponse out;
    for (int s = 0; s < req.num_samples; ++s) {
      std::mt19937_64 rng(mix(base + static_cast<std::uint64_t>(s)));
      SampledSequence seq;
      std::vector<token_id> all = prompt;
      for (int k = 0; k < p.max_tokens; ++k) {
        const auto lsm = log_softmax(row(w, context_of(all, all.size())));
        const token_id t = pick(lsm, p, rng);
        all.push_back(t);
        seq.tokens.push_back(t);
        seq.logprobs.push_back(lsm[static_cast<std::size_t>(t)]);  // the model's own distribution (temperature 1)
        const bool stop_id = std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), t) != p.stop_token_ids.end() ||
                             (options_.eos_token_id && t == *options_.eos_token_id);
        if (stop_id || hits_stop_string(seq.tokens, p.stop)) {
          seq.stop_reason = StopReason::stop;
          break;
        }
      }
      seq.prefill_tokens = static_cast<std::int64_t>(prompt.size());
      seq.decode_tokens = static_cast<std::int64_t>(seq.tokens.size());
      usage_.sample += seq.decode_tokens;
      out.sequences.push_back(std::move(seq));
    }
    usage_.prefill += static_cast<std::int64_t>(prompt.size());  // billed once per call, as the engine does
    if (req.include_prompt_logprobs) out.prompt_logprobs = prompt_logprobs(w, prompt);
    if (req.topk_prompt_logprobs > 0) {
      std::vector<std::vector<TokenLogprob>> topk(prompt.size());
      for (std::size_t i = 1; i < prompt.size(); ++i) {
        const auto lsm = log_softmax(row(w, context_of(prompt, i)));
        std::vector<token_id> ids(lsm.size());
        std::iota(ids.begin(), ids.end(), 0);
        const auto k = std::min<std::size_t>(ids.size(), static_cast<std::size_t>(req.topk_prompt_logprobs));
        std::partial_sort(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(k), ids.end(),
                          [&](token_id a, token_id b) { return lsm[std::size_t(a)] > lsm[std::size_t(b)]; });
        for (std::size_t j = 0; j < k; ++j) topk[i].push_back({ids[j], lsm[std::size_t(ids[j])]});
      }
      out.topk_prompt_logprobs = std::move(topk);
    }
    return out;
  }

  bool hits_stop_string(const std::vector<token_id>& tokens, const std::vector<std::string>& stop) const {
    if (stop.empty()) return false;
    const std::string text = options_.decoder->decode(tokens);
    for (const auto& s : stop)
      if (!s.empty() && text.size() >= s.size() && text.compare(text.size() - s.size(), s.size(), s) == 0) return true;
    return false;
  }

  // Greedy at temperature 0; otherwise softmax(logits / T) restricted by top_k and top_p.
  static token_id pick(const std::vector<double>& lsm, const SamplingParams& p, std::mt19937_64& rng) {
    if (p.temperature == 0) return static_cast<token_id>(std::max_element(lsm.begin(), lsm.end()) - lsm.begin());
    std::vector<token_id> ids(lsm.size());
    std::iota(ids.begin(), ids.end(), 0);
    std::stable_sort(ids.begin(), ids.end(),
                     [&](token_id a, token_id b) { return lsm[std::size_t(a)] > lsm[std::size_t(b)]; });
    if (p.top_k > 0 && static_cast<std::size_t>(p.top_k) < ids.size()) ids.resize(static_cast<std::size_t>(p.top_k));
    std::vector<double> prob;
    for (token_id t : ids) prob.push_back(std::exp((lsm[std::size_t(t)] - lsm[std::size_t(ids[0])]) / p.temperature));
    const double total = std::accumulate(prob.begin(), prob.end(), 0.0);
    double kept = 0;
    std::size_t n = 0;
    while (n < prob.size() && (n == 0 || kept / total < p.top_p)) kept += prob[n++];
    const double u = std::uniform_real_distribution<double>(0.0, kept)(rng);
    double acc = 0;
    for (std::size_t i = 0; i < n; ++i)
      if ((acc += prob[i]) > u) return ids[i];
    return ids[n - 1];
  }

  FakeSessionOptions options_;
  std::mutex mu_;
  Table weights_, grads_, m_, v_;
  std::int64_t step_ = 0;
  std::uint64_t unseeded_calls_ = 0;
  TokenUsage usage_;
  std::map<std::string, Snapshot> states_;
  std::map<std::string, Table> samplers_;
};
static_assert(Session<FakeSession>);

// Creates FakeSessions (satisfies Service), so ServiceClient works unchanged.
class FakeService {
 public:
  using session_type = FakeSession;
  explicit FakeService(FakeSessionOptions options = {}) : options_(std::move(options)) {}
  std::shared_ptr<FakeSession> create_session(const SessionOptions& o) {
    auto opts = options_;
    opts.seed = o.seed;
    return std::make_shared<FakeSession>(opts);
  }
  std::shared_ptr<FakeSession> create_session_from_state(const std::string&, const SessionOptions&) {
    throw unsupported("FakeService: states live in their session's memory; use load_state on that session");
  }
  std::shared_ptr<FakeSession> open_sampler(const std::string&) {
    throw unsupported("FakeService: sampler weights live in their session's memory; use its SamplingClient");
  }
  std::vector<std::string> list_base_models() { return {"fake-table"}; }
  ServerCapabilities capabilities() {
    return {{"fake-table"},
            {"cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce"},
            true,
            0};
  }

 private:
  FakeSessionOptions options_;
};
static_assert(Service<FakeService>);

// A tokenizer over a small alphabet: id i is the i-th character, then EOS. Pairs with FakeSession for tests
// that go through text (rewards).
class CharTokenizer final : public Tokenizer {
 public:
  explicit CharTokenizer(std::string alphabet) : alphabet_(std::move(alphabet)) {}
  std::vector<token_id> encode(std::string_view text, bool = true) const override {
    std::vector<token_id> out;
    for (char c : text) {
      const auto pos = alphabet_.find(c);
      if (pos == std::string::npos)
        throw invalid_argument(std::string("CharTokenizer: character '") + c + "' is not in the alphabet");
      out.push_back(static_cast<token_id>(pos));
    }
    return out;
  }
  std::string decode(std::span<const token_id> ids, bool skip_special = false) const override {
    std::string out;
    for (token_id t : ids) {
      if (t == eos()) {
        if (!skip_special) out += "<eos>";
      } else if (t >= 0 && t < eos()) {
        out += alphabet_[static_cast<std::size_t>(t)];
      } else {
        throw invalid_argument("CharTokenizer: id " + std::to_string(t) + " is out of range");
      }
    }
    return out;
  }
  std::int64_t vocab_size() const override { return static_cast<std::int64_t>(alphabet_.size()) + 1; }
  std::optional<token_id> token_to_id(std::string_view token) const override {
    if (token == "<eos>") return eos();
    if (token.size() == 1 && alphabet_.find(token[0]) != std::string::npos)
      return static_cast<token_id>(alphabet_.find(token[0]));
    return std::nullopt;
  }
  std::optional<token_id> eos_token_id() const override { return eos(); }

 private:
  token_id eos() const { return static_cast<token_id>(alphabet_.size()); }
  std::string alphabet_;
};

}  // namespace rlloop::testing
