// KV-cached sampling: one prefill of the prompt, then all samples decode in lockstep in one batch.
#include "runtime/sampler.hpp"

#include <cmath>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string_view>
#include <utility>

#include <rlloop/error.hpp>
#include <rlloop/limits.hpp>

#include "model/cpu_decoder.hpp"
#include "kernels/device.hpp"
#include "runtime/target_logprobs.hpp"
#include "kernels/token_draw.hpp"

namespace rlloop::engine {
namespace {

// RLLOOP_DECODER=aten: the ATen decoding step (Transformer::decode_step, the one CUDA and bf16 take) on the CPU too,
// to test and measure it there; auto (or unset): the CPU decoder wherever it applies.
bool aten_decoder_forced() {
  const char* choice = std::getenv("RLLOOP_DECODER");
  if (!choice || !*choice) return false;
  const std::string_view c(choice);
  if (c == "aten") return true;
  if (c != "auto")
    throw invalid_argument(std::string("RLLOOP_DECODER: unknown decoder '") + choice + "' (auto or aten)");
  return false;
}

// The dtype a run's cache holds: the CPU decoder's (fp32, or bf16 at the bf16 precisions) where it decodes,
// the model's own elsewhere.
torch::ScalarType run_cache_dtype(Transformer& model, DecodePrecision precision, bool use_cpu_decoder) {
  return use_cpu_decoder ? CpuDecoder::cache_dtype(precision) : model.parameters().front().scalar_type();
}

torch::Tensor to_ids(std::span<const token_id> tokens, torch::Device device) {
  std::vector<std::int64_t> v(tokens.begin(), tokens.end());
  return to_device(torch::tensor(v, torch::kLong), device).unsqueeze(0);
}

// One draw per row of `logits` [A, V] following params: temperature, then top-k, then top-p, then the CDF
// inverted at the row's uniform.
torch::Tensor choose_tokens(const torch::Tensor& logits, const SamplingParams& p, const torch::Tensor& uniforms) {
  if (p.temperature == 0.0) return logits.argmax(-1);
  const std::int64_t V = logits.size(-1);
  const double neg_inf = -std::numeric_limits<double>::infinity();
  torch::Tensor scaled = logits.to(torch::kFloat32);
  if (p.temperature != 1.0) scaled = scaled / p.temperature;
  if (p.top_k > 0 && p.top_k < V) {
    torch::Tensor kth = std::get<0>(scaled.topk(p.top_k, -1)).narrow(-1, p.top_k - 1, 1);
    scaled = scaled.masked_fill(scaled < kth, neg_inf);
  }
  if (p.top_p < 1.0) {
    auto [sorted, order] = scaled.sort(-1, /*descending=*/true);
    torch::Tensor probs = torch::softmax(sorted, -1);
    // Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it already does.
    // The top token always survives (the mass before it is 0).
    torch::Tensor drop_sorted = (probs.cumsum(-1) - probs) >= p.top_p;
    torch::Tensor drop = torch::zeros_like(drop_sorted).scatter(-1, order, drop_sorted);
    scaled = scaled.masked_fill(drop, neg_inf);
  }
  return draw_inverse_cdf(torch::softmax(scaled, -1), uniforms);
}

// The next token of every row and its logprob at temperature 1 (the model's own, unfiltered, as
// compute_logprobs gives it), both [A]. `uniforms`: [A] float64 (empty when greedy). CPU fp32 logits without
// top-k / top-p take the one-pass kernel.
struct Draw {
  torch::Tensor tokens, logprobs;
};
Draw draw_next(const torch::Tensor& logits, const SamplingParams& p, const torch::Tensor& uniforms) {
  const std::int64_t A = logits.size(0), V = logits.size(-1);
  const bool truncated = (p.top_k > 0 && p.top_k < V) || p.top_p < 1.0;
  if (logits.device().is_cpu() && logits.scalar_type() == torch::kFloat32 && logits.stride(-1) == 1 && !truncated) {
    Draw d{torch::empty({A}, torch::kLong), torch::empty({A}, torch::kFloat32)};
    draw_tokens(logits.data_ptr<float>(), A, V, logits.stride(0), p.temperature,
                uniforms.defined() ? uniforms.data_ptr<double>() : nullptr, d.tokens.data_ptr<std::int64_t>(),
                d.logprobs.data_ptr<float>());
    return d;
  }
  torch::Tensor next = choose_tokens(logits, p, uniforms);
  torch::Tensor lp = torch::log_softmax(logits.to(torch::kFloat32), -1).gather(-1, next.unsqueeze(-1)).squeeze(-1);
  return {next, lp};
}

}  // namespace

torch::Tensor draw_inverse_cdf(const torch::Tensor& probs, const torch::Tensor& uniforms) {
  // The uniforms move to the probabilities' device and the CDF is inverted there, instead of copying [A, V]
  // probabilities to the host every step. right=true means the first index whose CDF exceeds the target, so
  // zero-probability tokens (flat CDF steps) are never chosen.
  const std::int64_t V = probs.size(-1);
  torch::Tensor cdf = probs.to(torch::kFloat32).cumsum(-1);
  torch::Tensor u = uniforms.to(probs.device(), torch::kFloat32).reshape({probs.size(0), 1});
  torch::Tensor target = u * cdf.narrow(-1, V - 1, 1);
  return torch::searchsorted(cdf, target, /*out_int32=*/false, /*right=*/true).squeeze(-1).clamp_max(V - 1);
}

bool prefills_at_once(const SampleRequest& req) {
  return req.include_prompt_logprobs || req.topk_prompt_logprobs > 0 || req.include_routed_experts ||
         req.params.max_tokens == 0;
}

DecodeRun::DecodeRun(Transformer& model, const SampleRequest& req, StopStringCheck stop_check, SampleStream stream,
                     DecodePrecision precision, std::shared_ptr<const RoundedWeights>* rounded, Prefill prefill)
    : model_(model),
      params_(req.params),
      stop_check_(std::move(stop_check)),
      stream_(stream),
      precision_(precision),
      rounded_(rounded),
      device_(model.parameters().front().device()),
      num_samples_(req.num_samples) {
  const ModelConfig& cfg = model.config();
  const std::vector<token_id> prompt = req.prompt.tokens();
  // The same checks as every entry point's (rlloop/limits.hpp), against this model's vocabulary and context.
  validate(req, Naming{}, ModelShape{cfg.max_position_embeddings, cfg.vocab_size});
  const auto P = static_cast<std::int64_t>(prompt.size());
  const int n = req.num_samples;
  const int max_new = params_.max_tokens;

  c10::InferenceMode inference;
  // The CPU decoding backend, where it applies (built at the first step: one with bf16 rounds the whole model, which
  // a prompt prefilled here and every sample stopping at its first token would waste). Its cache's dtype is the
  // backend's from the start: a prefill here stores the prompt's keys and values rounded (its own attention reads
  // them unrounded).
  use_cpu_decoder_ = !aten_decoder_forced() && CpuDecoder::supports(model);
  const torch::ScalarType cache_dtype = run_cache_dtype(model, precision_, use_cpu_decoder_);
  // The last generated token is never fed back, so the cache needs room for P + max_new - 1 positions. Its blocks
  // come from the base model's pool, so that runs of sessions sharing the base decode in one step.
  cache_ = KVCache(model.kv_pools(), cache_dtype, 1, P + std::max(max_new - 1, 0));
  if (req.include_routed_experts && cfg.num_experts == 0)
    throw invalid_argument("SampleRequest.include_routed_experts: this " + cfg.model_type + " model has no experts");
  SampleResponse& resp = response_;
  resp.sequences.resize(n);
  for (auto& s : resp.sequences) {
    s.prefill_tokens = P;  // every sample conditions on the whole prompt (computed once, shared)
    s.tokens.reserve(max_new);
    s.logprobs.reserve(max_new);
  }
  if (prefill == Prefill::in_steps && !prefills_at_once(req)) {
    prompt_ids_ = to_ids(prompt, device_)[0];  // decode_step feeds it a chunk at a time
    return;
  }
  std::optional<ExpertRouting> prompt_routing;
  if (req.include_routed_experts) prompt_routing.emplace();
  torch::Tensor hidden =
      model.hidden_states(to_ids(prompt, device_), &cache_, prompt_routing ? &*prompt_routing : nullptr);
  if (prompt_routing) prompt_routes_ = to_host(prompt_routing->recorded);  // [P, sparse layers, k]

  // Only the last row's unembedding is needed to sample; the prompt's own logprobs take the others, a chunk of
  // rows at a time (at most kLogitChunkValues logits exist at once, as in training).
  const torch::Tensor last_logits = model.logits(hidden.narrow(1, P - 1, 1))[0][0];  // [V]
  const std::int64_t k =
      req.topk_prompt_logprobs > 0 ? std::min<std::int64_t>(req.topk_prompt_logprobs, cfg.vocab_size) : 0;
  if (req.include_prompt_logprobs) resp.prompt_logprobs = std::vector<double>(P, 0.0);
  if (k > 0) resp.topk_prompt_logprobs = std::vector<std::vector<TokenLogprob>>(P);
  if (req.include_prompt_logprobs || k > 0) {
    const std::int64_t rows = logit_chunk_rows(cfg.vocab_size);
    for (std::int64_t r0 = 0; r0 < P - 1; r0 += rows) {  // row i predicts prompt token i + 1
      const std::int64_t len = std::min(rows, P - 1 - r0);
      const torch::Tensor lp =
          to_host(torch::log_softmax(model.logits(hidden[0].narrow(0, r0, len)).to(torch::kFloat32), -1));
      if (req.include_prompt_logprobs) {
        auto acc = lp.accessor<float, 2>();
        for (std::int64_t i = 0; i < len; ++i) (*resp.prompt_logprobs)[r0 + i + 1] = acc[i][prompt[r0 + i + 1]];
      }
      if (k > 0) {
        auto [values, indices] = lp.topk(k, -1);
        auto va = values.accessor<float, 2>();
        auto ia = indices.accessor<std::int64_t, 2>();
        for (std::int64_t i = 0; i < len; ++i)
          for (std::int64_t j = 0; j < k; ++j)
            (*resp.topk_prompt_logprobs)[r0 + i + 1].push_back(TokenLogprob{static_cast<token_id>(ia[i][j]), va[i][j]});
      }
    }
  }

  if (prompt_routing) fed_routes_.resize(n);
  if (max_new == 0) return;  // stop_reason stays "length"; no rows to decode
  start_decoding(last_logits);
}

void DecodeRun::start_decoding(const torch::Tensor& last) {
  // The samples share the prompt's blocks; each copies only the prompt's last block, if partly filled, when it
  // writes its first token's keys there.
  const int n = num_samples_;
  cache_.repeat_batch(n);
  active_.resize(n);
  for (int i = 0; i < n; ++i) active_[i] = i;
  absorb(last.unsqueeze(0).expand({n, last.size(0)}));
}

void DecodeRun::absorb(const torch::Tensor& logits) {
  torch::Tensor uniforms;  // [A]: each row's draw for its sample's next token
  if (params_.temperature > 0) {
    uniforms = torch::empty({static_cast<std::int64_t>(active_.size())}, torch::kFloat64);
    double* u = uniforms.data_ptr<double>();
    for (std::size_t r = 0; r < active_.size(); ++r)
      u[r] = stream_.uniform(active_[r], static_cast<std::int64_t>(response_.sequences[active_[r]].tokens.size()));
    uniforms = to_device(uniforms, logits.device());
  }
  auto [next, chosen_lp] = draw_next(logits, params_, uniforms);  // [A] each
  // The step's one copy back to the host: the tokens (exact in float64) and their logprobs together.
  const auto A = static_cast<std::int64_t>(active_.size());
  const torch::Tensor drawn = to_host(torch::cat({next.to(torch::kFloat64), chosen_lp.to(torch::kFloat64)}));
  const double* tok = drawn.data_ptr<double>();
  const double* lp = tok + A;
  const int max_new = params_.max_tokens;

  std::vector<std::int64_t> keep;
  keep.reserve(active_.size());
  for (std::size_t r = 0; r < active_.size(); ++r) {
    SampledSequence& s = response_.sequences[active_[r]];
    const auto t = static_cast<token_id>(tok[r]);
    s.tokens.push_back(t);
    s.logprobs.push_back(lp[r]);
    ++s.decode_tokens;
    const auto& stops = params_.stop_token_ids;
    if (std::find(stops.begin(), stops.end(), t) != stops.end()) {
      s.stop_reason = StopReason::stop;
    } else if (stop_check_ && stop_check_(std::span<const token_id>(s.tokens))) {
      s.stop_reason = StopReason::stop;
    } else if (static_cast<int>(s.tokens.size()) >= max_new) {
      s.stop_reason = StopReason::length;
    } else {
      keep.push_back(static_cast<std::int64_t>(r));
    }
  }
  if (keep.empty()) {
    cache_ = KVCache();  // every sample has stopped: the blocks go back now, not when the run is dropped
  } else if (keep.size() < active_.size()) {
    // Finished samples leave the batch so later steps compute only live rows; their blocks return to the pool.
    const torch::Tensor rows = torch::tensor(keep, torch::kLong);  // the cache's tables are on the host
    cache_.select_batch(rows);
    next = next.index_select(0, to_device(rows, device_));
  }
  std::vector<int> still;
  for (auto r : keep) still.push_back(active_[r]);
  active_ = std::move(still);
  next_ = next;
  if (on_step) on_step(response_);
}

void DecodeRun::record_routes(const torch::Tensor& routes) {
  // Row r fed the last token of sequence active_[r].
  const std::int64_t per_row = routes.numel() / std::max<std::int64_t>(routes.size(0), 1);
  const std::int64_t* ids = routes.data_ptr<std::int64_t>();
  for (std::size_t r = 0; r < active_.size(); ++r) {
    std::vector<std::int64_t>& own = fed_routes_[active_[r]];
    own.insert(own.end(), ids + r * per_row, ids + (r + 1) * per_row);
  }
}

SampleResponse DecodeRun::take() {
  if (prompt_routes_.defined()) {
    // Each sequence's routes: the prompt's, then those of every generated token fed back (all but the last).
    const std::int64_t P = prompt_routes_.size(0), layers = prompt_routes_.size(1), k = prompt_routes_.size(2);
    const std::int64_t* prompt = prompt_routes_.data_ptr<std::int64_t>();
    for (std::size_t i = 0; i < response_.sequences.size(); ++i) {
      const std::vector<std::int64_t>& fed = fed_routes_[i];
      TensorData t;
      t.dtype = DType::int64;
      t.int_data.reserve(static_cast<std::size_t>(P * layers * k) + fed.size());
      t.int_data.assign(prompt, prompt + P * layers * k);
      t.int_data.insert(t.int_data.end(), fed.begin(), fed.end());
      t.shape = {static_cast<std::int64_t>(t.int_data.size()) / (layers * k), layers, k};
      response_.sequences[i].routed_experts = std::move(t);
    }
  }
  return std::move(response_);
}

CpuDecoder* DecodeRun::cpu_decoder() {
  if (use_cpu_decoder_ && !decoder_) {
    // The caller's snapshot moves in (a stale one is freed before the new one is made) and back out.
    decoder_.emplace(model_, precision_, rounded_ ? std::exchange(*rounded_, nullptr) : nullptr);
    if (rounded_) *rounded_ = decoder_->rounded();
  }
  return decoder_ ? &*decoder_ : nullptr;
}

std::int64_t kv_bytes_needed(Transformer& model, const SampleRequest& req, DecodePrecision precision) {
  const auto P = static_cast<std::int64_t>(req.prompt.length());
  const std::int64_t last = P + std::max(req.params.max_tokens - 1, 0);  // positions a sample fills, at most
  const std::int64_t shared = P / kKVBlockTokens;                        // the prompt's full blocks
  const std::int64_t own = (last + kKVBlockTokens - 1) / kKVBlockTokens - shared;
  // Called where the request is submitted, which must not throw for what the run itself reports (through the
  // request's future): an unreadable RLLOOP_DECODER counts as unset here.
  bool forced = false;
  try {
    forced = aten_decoder_forced();
  } catch (const invalid_argument&) {
  }
  const torch::ScalarType dtype = run_cache_dtype(model, precision, !forced && CpuDecoder::supports(model));
  return (shared + req.num_samples * own) * model.kv_pools()->pool(dtype).bytes_per_block();
}

std::vector<std::size_t> DecodeRun::step_members(std::span<DecodeRun* const> runs, std::size_t lead,
                                                 std::vector<bool>& stepped) {
  CpuDecoder* decoder = runs[lead]->cpu_decoder();
  std::vector<std::size_t> members;
  for (std::size_t j = lead; j < runs.size(); ++j) {
    if (stepped[j]) continue;
    CpuDecoder* other = runs[j]->cpu_decoder();
    const bool joins = decoder ? other && decoder->shares_base(*other)
                               : !other && runs[lead]->model_.shares_base(runs[j]->model_);
    if (!joins) continue;
    members.push_back(j);
    stepped[j] = true;
  }
  return members;
}

void decode_step(std::span<DecodeRun* const> runs, std::int64_t prefill_tokens) {
  if (prefill_tokens < 1)
    throw invalid_argument("decode_step: prefill_tokens must be at least 1, got " + std::to_string(prefill_tokens));
  c10::InferenceMode inference;
  // What each run feeds this step: its samples' last tokens, or the next chunk of its prompt (oldest first, within
  // the budget; 0: the run sits this step out).
  std::vector<std::int64_t> chunk(runs.size(), 0);
  std::vector<bool> stepped(runs.size(), false);
  for (std::size_t i = 0; i < runs.size(); ++i) {
    DecodeRun& run = *runs[i];
    if (!run.prefilling()) continue;
    chunk[i] = std::min(prefill_tokens, run.prompt_ids_.size(0) - run.prefilled_);
    prefill_tokens -= chunk[i];
    stepped[i] = chunk[i] == 0;
  }
  for (std::size_t i = 0; i < runs.size(); ++i) {
    if (stepped[i]) continue;
    DecodeRun& lead = *runs[i];
    CpuDecoder* decoder = lead.cpu_decoder();
    const std::vector<std::size_t> members = DecodeRun::step_members(runs, i, stepped);  // one step for their rows
    // A member's tokens this step, and whether it wants logits: every row's, or a chunk's last when it ends the
    // prompt.
    std::vector<torch::Tensor> chunks(members.size());
    std::vector<bool> completes(members.size(), true);
    for (std::size_t m = 0; m < members.size(); ++m) {
      const DecodeRun& run = *runs[members[m]];
      if (!run.prefilling()) continue;
      chunks[m] = run.prompt_ids_.narrow(0, run.prefilled_, chunk[members[m]]);
      completes[m] = run.prefilled_ + chunk[members[m]] == run.prompt_ids_.size(0);
    }
    auto tokens_of = [&](std::size_t m) -> const torch::Tensor& {
      return chunks[m].defined() ? chunks[m] : runs[members[m]]->next_;
    };
    torch::Tensor logits, routes;
    bool want_routes = false;  // only models with experts are asked (DecodeRun's constructor), never the CPU decoder
    for (std::size_t j : members) want_routes = want_routes || runs[j]->prompt_routes_.defined();
    if (decoder) {
      std::vector<CpuDecoder::Group> groups;
      for (std::size_t m = 0; m < members.size(); ++m) {
        DecodeRun& run = *runs[members[m]];
        groups.push_back({&run.cpu_decoder()->weights(), &tokens_of(m), &run.cache_, completes[m]});
      }
      logits = decoder->step(groups);
    } else {
      std::vector<DecodeGroup> groups;
      for (std::size_t m = 0; m < members.size(); ++m) {
        DecodeRun& run = *runs[members[m]];
        groups.push_back({&run.model_, &tokens_of(m), &run.cache_, completes[m]});
      }
      logits = lead.model_.decode_step(groups, want_routes ? &routes : nullptr);
      if (want_routes) routes = to_host(routes);  // the step's one more copy to the host, only when asked for
    }
    std::int64_t row = 0, logit_row = 0;  // the member's first row of the step, and of its logits
    for (std::size_t m = 0; m < members.size(); ++m) {
      DecodeRun& run = *runs[members[m]];
      if (chunks[m].defined()) {
        row += chunks[m].size(0);
        run.prefilled_ += chunks[m].size(0);
        if (!completes[m]) continue;
        run.prompt_ids_ = torch::Tensor();
        run.start_decoding(logits[logit_row++]);
        continue;
      }
      const std::int64_t n = run.rows();
      if (run.prompt_routes_.defined()) run.record_routes(routes.narrow(0, row, n));
      run.absorb(logits.narrow(0, logit_row, n));
      row += n;
      logit_row += n;
    }
  }
}

SampleResponse sample(Transformer& model, const SampleRequest& req, const StopStringCheck& stop_check,
                      SampleStream stream, DecodePrecision precision, std::shared_ptr<const RoundedWeights>* rounded) {
  DecodeRun run(model, req, stop_check, stream, precision, rounded);
  DecodeRun* const runs[] = {&run};
  while (!run.done()) decode_step(runs);
  return run.take();
}

std::vector<double> compute_logprobs(Transformer& model, std::span<const token_id> tokens) {
  if (tokens.empty()) return {};
  std::vector<double> out(tokens.size(), 0.0);
  if (tokens.size() == 1) return out;
  c10::InferenceMode inference;
  const torch::Device device = model.parameters().front().device();
  const auto N = static_cast<std::int64_t>(tokens.size());
  torch::Tensor ids = to_ids(tokens, device);
  // Positions 0..N-2 predict tokens 1..N-1; the last position's unembedding is not needed.
  // (The logits a chunk at a time, as in training: a long prompt over a large vocabulary never holds them all.)
  torch::Tensor hidden = model.hidden_states(ids).narrow(1, 0, N - 1);
  torch::Tensor lp = to_host(target_logprobs(model, hidden, ids.narrow(1, 1, N - 1)).reshape({N - 1}));
  const float* p = lp.data_ptr<float>();
  for (std::int64_t i = 1; i < N; ++i) out[i] = p[i - 1];
  return out;
}

}  // namespace rlloop::engine
