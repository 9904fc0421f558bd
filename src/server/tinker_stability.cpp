#include "server/tinker_stability.hpp"

#include <optional>
#include <utility>

#include <rlloop/error.hpp>

#include "wire/tinker/codec.hpp"

namespace rlloop::server {

namespace {
namespace tk = wire::tinker;

// A sequence id is "<request id>-<index>" (asample's sample_sequence_ids): {request id, index}, or nothing.
std::optional<std::pair<std::string, std::size_t>> split_sequence_id(const std::string& id) {
  const auto dash = id.rfind('-');
  if (dash == std::string::npos || dash == 0 || dash + 1 == id.size()) return std::nullopt;
  std::size_t index = 0;
  for (std::size_t i = dash + 1; i < id.size(); ++i) {
    if (id[i] < '0' || id[i] > '9' || index > 1'000'000) return std::nullopt;
    index = index * 10 + static_cast<std::size_t>(id[i] - '0');
  }
  return std::pair{id.substr(0, dash), index};
}

const TensorData* input(const Datum& d, const char* key) {
  const auto it = d.loss_fn_inputs.find(key);
  return it == d.loss_fn_inputs.end() ? nullptr : &it->second;
}

std::string at(const std::string& field, std::size_t position) {
  return field + "[" + std::to_string(position) + "]";
}
}  // namespace

// The loss inputs apply gives one datum, worked out before any datum is changed.
struct StabilityRecords::Rewrite {
  std::vector<float> logprobs;
  std::vector<float> weights;
};

void StabilityRecords::expect(const std::string& session, const std::string& request_id, std::vector<token_id> prompt,
                              double now) {
  std::lock_guard lock(mu_);
  expire_locked(now);
  records_[request_id] = Record{session, std::move(prompt), nullptr, false, now, 0};
}

void StabilityRecords::complete(const std::string& request_id, std::shared_ptr<const SampleResponse> result) {
  std::lock_guard lock(mu_);
  const auto it = records_.find(request_id);
  if (it == records_.end() || it->second.done) return;  // dropped with its session meanwhile
  Record& r = it->second;
  r.done = true;
  r.result = std::move(result);
  r.tokens = static_cast<std::int64_t>(r.prompt.size());
  if (r.result)
    for (const auto& s : r.result->sequences) r.tokens += static_cast<std::int64_t>(s.tokens.size());
  session_tokens_[r.session] += r.tokens;
  evict_locked(r.session);
}

void StabilityRecords::drop(const std::string& session) {
  std::lock_guard lock(mu_);
  std::erase_if(records_, [&](const auto& entry) { return entry.second.session == session; });
  session_tokens_.erase(session);
}

// Records unused for a lifetime go; looked for at most once a minute (each look walks every record).
void StabilityRecords::expire_locked(double now) {
  if (now - last_expiry_ < 60) return;
  last_expiry_ = now;
  std::erase_if(records_, [&](const auto& entry) {
    const Record& r = entry.second;
    if (now - r.last_used <= kLifetimeSeconds) return false;
    session_tokens_[r.session] -= r.tokens;
    return true;
  });
}

// Over the cap, the session's least recently used completed records go until it is within it.
void StabilityRecords::evict_locked(const std::string& session) {
  while (session_tokens_[session] > kMaxTokensPerSession) {
    auto oldest = records_.end();
    for (auto it = records_.begin(); it != records_.end(); ++it)
      if (it->second.session == session && it->second.done &&
          (oldest == records_.end() || it->second.last_used < oldest->second.last_used))
        oldest = it;
    if (oldest == records_.end()) return;
    session_tokens_[session] -= oldest->second.tokens;
    records_.erase(oldest);
  }
}

const SampledSequence& StabilityRecords::sequence_locked(const std::string& session, const std::string& sequence_id,
                                                         const std::vector<token_id>** prompt, double now,
                                                         const std::string& where) {
  const auto split = split_sequence_id(sequence_id);
  const auto it = split ? records_.find(split->first) : records_.end();
  if (it == records_.end() || it->second.session != session)
    throw invalid_argument(where + ": sequence '" + sequence_id +
                           "' was not recorded in this session (stable_reinforce trains on sequences its own session "
                           "sampled with record_stability_info=True, for a day after their last use; records do not "
                           "survive a restart of the server)");
  Record& r = it->second;
  if (!r.done) throw invalid_argument(where + ": sequence '" + sequence_id + "' is still being sampled");
  if (!r.result) throw invalid_argument(where + ": the sample of sequence '" + sequence_id + "' failed");
  if (split->second >= r.result->sequences.size())
    throw invalid_argument(where + ": sequence '" + sequence_id + "' does not exist: its request sampled " +
                           std::to_string(r.result->sequences.size()));
  r.last_used = now;
  *prompt = &r.prompt;
  return r.result->sequences[split->second];
}

void StabilityRecords::apply(const std::string& session, tk::ForwardBackwardCall& call, double now) {
  std::lock_guard lock(mu_);
  // Checks one field's runs against its tokens; for the targets, fills the sampler's logprobs of sampled positions.
  auto check_runs = [&](const std::vector<tk::ProvenanceSpan>& runs, const std::vector<std::int64_t>& tokens,
                        const std::string& field, std::vector<float>* logprobs, std::vector<bool>* sampled) {
    std::size_t pos = 0;
    for (const tk::ProvenanceSpan& run : runs) {
      const std::vector<token_id>* prompt = nullptr;
      const SampledSequence& seq = sequence_locked(session, run.sequence_id, &prompt, now, at(field, pos));
      const auto& source = run.sampled ? seq.tokens : *prompt;
      const char* what = run.sampled ? "sampled tokens" : "prompt";
      const auto offset = static_cast<std::size_t>(run.offset), length = static_cast<std::size_t>(run.length);
      if (length > tokens.size() - pos)  // the reader checked the tiling against the field's size, not its dtype
        throw invalid_argument(field + ": its provenance covers more positions than its " +
                               std::to_string(tokens.size()) + " int64 tokens");
      // Compared without offset + length, which a hostile offset could wrap around.
      if (offset > source.size() || length > source.size() - offset ||
          (run.sampled && seq.logprobs.size() < source.size()))
        throw invalid_argument(at(field, pos) + ": its run names " + std::to_string(length) +
                               " positions from position " + std::to_string(offset) + " of the " + what +
                               " of sequence '" + run.sequence_id + "', which has " + std::to_string(source.size()));
      for (std::size_t k = 0; k < length; ++k) {
        if (tokens[pos + k] != source[offset + k])
          throw invalid_argument(at(field, pos + k) + " is token " + std::to_string(tokens[pos + k]) +
                                 ", but position " + std::to_string(offset + k) + " of the " + what +
                                 " of sequence '" + run.sequence_id + "' is token " +
                                 std::to_string(source[offset + k]));
        if (run.sampled && logprobs) {
          (*logprobs)[pos + k] = static_cast<float>(seq.logprobs[offset + k]);
          (*sampled)[pos + k] = true;
        }
      }
      pos += length;
    }
  };
  std::vector<Rewrite> rewrites;
  for (std::size_t i = 0; i < call.data.size(); ++i) {
    const std::string path = "data[" + std::to_string(i) + "]";
    const Datum& d = call.data[i];
    const tk::Provenance& provenance = call.provenance.at(i);
    const TensorData* targets = input(d, "target_tokens");
    if (provenance.targets.empty() || !targets)
      throw invalid_argument(path + ": stable_reinforce needs the datum's provenance (Datum.with_provenance, naming "
                             "sequences sampled with record_stability_info=True) and its target_tokens");
    const auto model_input = d.model_input.tokens();
    check_runs(provenance.model_input, std::vector<std::int64_t>(model_input.begin(), model_input.end()),
               path + ".model_input", nullptr, nullptr);
    const std::size_t n = targets->int_data.size();
    Rewrite w{std::vector<float>(n, 0.0f), std::vector<float>(n, 1.0f)};
    if (const TensorData* given = input(d, "weights")) {
      if (given->float_data.size() != n)
        throw invalid_argument(path + ".loss_fn_inputs.weights: needs one float32 value per target token (" +
                               std::to_string(n) + ")");
      w.weights = given->float_data;
    }
    std::vector<bool> sampled(n, false);
    check_runs(provenance.targets, targets->int_data, path + ".loss_fn_inputs.target_tokens", &w.logprobs, &sampled);
    const TensorData* advantages = input(d, "advantages");
    for (std::size_t j = 0; j < n; ++j) {
      if (sampled[j]) continue;
      if (advantages && j < advantages->float_data.size() && advantages->float_data[j] != 0.0f)
        throw invalid_argument(at(path + ".loss_fn_inputs.advantages", j) +
                               " is nonzero on a prompt token: stable_reinforce trains only on sampled tokens");
      w.weights[j] = 0.0f;
    }
    rewrites.push_back(std::move(w));
  }
  for (std::size_t i = 0; i < call.data.size(); ++i) {
    auto& inputs = call.data[i].loss_fn_inputs;
    inputs.insert_or_assign("logprobs", TensorData::from_floats(std::move(rewrites[i].logprobs)));
    inputs.insert_or_assign("weights", TensorData::from_floats(std::move(rewrites[i].weights)));
  }
}

}  // namespace rlloop::server
