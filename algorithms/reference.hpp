// Completion logprobs under a frozen reference model (e.g. save_weights_and_get_sampling_client of the starting
// weights), as the preference objectives (DPO / IPO, KTO) need them: one sum per (prompt, completion), computed
// once and cached in the algorithm's state, so later epochs over the same data cost no reference calls.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include <rlloop/clients.hpp>

namespace rlloop::algorithms {

// (prompt length, prompt + completion): the completion is what follows the prompt.
using ReferenceKey = std::pair<std::size_t, std::vector<token_id>>;
// Summed completion logprob under the reference, per key.
using ReferenceCache = std::map<ReferenceKey, double>;

inline ReferenceKey reference_key(const std::vector<token_id>& prompt, const std::vector<token_id>& completion) {
  std::vector<token_id> full = prompt;
  full.insert(full.end(), completion.begin(), completion.end());
  return {prompt.size(), std::move(full)};
}

// Run state of the preference objectives (DPO / IPO, KTO), apart from their immutable options: the step counter
// and the cached reference logprobs. Save it (as JSON) beside the session's save_state.
struct PreferenceState {
  std::int64_t step = 0;
  ReferenceCache reference_logprobs;
  bool operator==(const PreferenceState&) const = default;
};
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(PreferenceState, step, reference_logprobs)

struct ReferenceSums {
  std::vector<double> sums;  // one per key, in the keys' order
  int calls = 0;             // compute_logprobs calls made (0 when every key was cached)
};

// The reference sums of `keys`, fetching the uncached ones into `cache` (all submitted before the first is
// awaited; a key repeated in the batch is fetched once).
template <Session S>
ReferenceSums reference_sums(const SamplingClient<S>& reference, ReferenceCache& cache,
                             std::span<const ReferenceKey> keys) {
  ReferenceSums out;
  std::map<ReferenceKey, Future<std::vector<double>>> pending;
  for (const auto& key : keys)
    if (!cache.count(key) && !pending.count(key)) {
      pending.emplace(key, reference.compute_logprobs(ModelInput::from_tokens(key.second)));
      ++out.calls;
    }
  for (auto& [key, fut] : pending) {
    const auto& lp = fut.get();  // lp[k] = log p(full[k] | full[:k]); the completion starts at the prompt length
    double s = 0;
    for (std::size_t k = key.first; k < lp.size(); ++k) s += lp[k];
    cache[key] = s;
  }
  for (const auto& key : keys) out.sums.push_back(cache.at(key));
  return out;
}

}  // namespace rlloop::algorithms
