// SessionCore: what a local session does the same in every parallel mode (session_core.hpp).
#include "session/session_core.hpp"

#include <filesystem>

#include <ATen/CPUGeneratorImpl.h>

#include <rlloop/batch_checks.hpp>

#include "io/model_io.hpp"
#include "runtime/batch.hpp"

namespace rlloop::engine {
namespace fs = std::filesystem;

namespace {

DecodePrecision decode_precision_of(SamplingPrecision p) {
  switch (p) {
    case SamplingPrecision::fp32: return DecodePrecision::fp32;
    case SamplingPrecision::bf16: return DecodePrecision::bf16;
    case SamplingPrecision::int8: return DecodePrecision::int8;
  }
  return DecodePrecision::fp32;
}

}  // namespace

SessionCore::SessionCore(const SessionOptions& opts, const LocalServiceOptions& svc,
                         std::shared_ptr<BaseModelRegistry> registry)
    : options(opts), service(svc), bases(std::move(registry)) {
  decode_precision = decode_precision_of(service.sampling_precision);
  dev = choose_device(service.device, service.dtype);
  dev.quantized_base = service.quantized_base;
  dev.activation_checkpointing = service.activation_checkpointing;
  resolved_base = resolve_base_model(service, options.base_model);
  key = base_key(resolved_base, dev);
  experts = expert_group_of(*bases);
  shard_group = shard_group_of(*bases);
  model = make_model(/*sampler=*/false);
  // The KV pool is allocated for the whole budget at its first request (shared with the base's other sessions),
  // so that it does not grow step by step leaving each smaller storage behind.
  model->kv_pools()->set_capacity_bytes(service.kv_cache_mb << 20);
  live.model = model;
  build_optimizer();
  generator = at::detail::createCPUGenerator(static_cast<std::uint64_t>(options.seed));
  try {
    tokenizer = load_tokenizer(tokenizer_spec(model->config(), resolved_base));
  } catch (const error&) {
    tokenizer = nullptr;  // stop strings then need a tokenizer: sample() says so
  }
  executor = make_executor(*this);
  lane = EngineLoop::open_lane(bases->loop(key));
}

std::shared_ptr<Transformer> SessionCore::make_model(bool sampler) {
  SessionModel made = make_session_model(*bases, resolved_base, dev, options, experts, shard_group, sampler);
  if (made.shared_base) shared_base = made.shared_base;
  if (!sampler) weights_hash = made.weights_hash;
  return made.model;
}

std::uint64_t SessionCore::next_seed() {
  std::lock_guard lock(generator.mutex());
  return at::check_generator<at::CPUGeneratorImpl>(generator)->random64();
}

void SessionCore::add_usage(const TokenUsage& u) {
  std::lock_guard lock(usage_mu);
  usage += u;
}

SessionCore::CheckedSample SessionCore::check_sample(const SampleRequest& request, const ModelConfig& cfg) {
  validate_sample_request(request, cfg, tokenizer != nullptr);
  CheckedSample checked;
  checked.request = request;
  SampleRequest& req = checked.request;
  if (auto eos = cfg.eos_token_id) req.params.stop_token_ids.push_back(static_cast<token_id>(*eos));
  if (!req.params.stop.empty()) checked.stop_check = make_stop_string_check(*tokenizer, req.params.stop);
  checked.seed = req.params.seed ? static_cast<std::uint64_t>(*req.params.seed) : next_seed();
  return checked;
}

void SessionCore::bill_sample(std::int64_t prompt_tokens, const std::vector<SampledSequence>& sequences) {
  TokenUsage u;
  u.prefill = prompt_tokens;
  for (const auto& s : sequences) u.sample += s.decode_tokens;
  add_usage(u);
}

std::vector<token_id> SessionCore::checked_logprob_tokens(const ComputeLogprobsRequest& request,
                                                          const Transformer& m) {
  validate_model_input(request.prompt, m.config().vocab_size, "compute_logprobs: ");
  auto tokens = request.prompt.tokens();
  add_usage({static_cast<std::int64_t>(tokens.size()), 0, 0});
  return tokens;
}

std::shared_ptr<const RoundedWeights>* SessionCore::rounded_slot(SamplingModel& target) {
  return shared_base ? &shared_base->rounded : &target.rounded;
}

std::string SessionCore::sampler_key(const std::optional<std::string>& path) {
  return path && !path->empty() ? fs::absolute(*path).lexically_normal().string() : std::string();
}

SessionCore::SamplingModel& SessionCore::sampling_model(const std::optional<std::string>& path) {
  const std::string key = sampler_key(path);
  if (key.empty()) return live;
  auto it = samplers.find(key);
  if (it != samplers.end()) {
    it->second.last_used = ++sampler_clock;
    return it->second;
  }
  auto state = read_state_dir(*path, false);
  check_same_base(state.meta, *path);
  auto m = make_model(/*sampler=*/true);
  load_trainable(*m, state.weights);
  if (samplers.size() >= kLoadedSamplerModels) {
    // The least recently used of those no request is decoding with (while all are, the cache holds one more).
    auto oldest = samplers.end();
    for (auto i = samplers.begin(); i != samplers.end(); ++i)
      if (i->second.decoding == 0 && (oldest == samplers.end() || i->second.last_used < oldest->second.last_used))
        oldest = i;
    if (oldest != samplers.end()) drop_sampler(oldest);
  }
  // Other ranks hold what this cache holds, so that they can decode its models' samples too.
  executor->load_sampler(key, *m, state.weights);
  return samplers.emplace(key, SamplingModel{m, nullptr, ++sampler_clock}).first->second;
}

void SessionCore::drop_sampler(std::map<std::string, SamplingModel>::iterator it) {
  executor->drop_sampler(it->first);
  samplers.erase(it);
}

void SessionCore::check_same_base(const CheckpointMeta& meta, const std::string& path) const {
  const std::string& saved = meta.base_model;
  std::string saved_resolved;
  try {
    saved_resolved = resolve_base_model(service, saved);
  } catch (const not_found&) {
    // No longer served here: it cannot be this session's base.
  }
  if (saved_resolved != resolved_base)
    throw invalid_argument("checkpoint '" + path + "' was trained on base model '" + saved +
                           "', this session's base model is '" + options.base_model + "'");
}

}  // namespace rlloop::engine
