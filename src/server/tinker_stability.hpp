// stable_reinforce over Tinker's protocol (docs/tinker_protocol.md, "stable_reinforce"): the sequences a Tinker
// session sampled with record_stability_info, kept as the sampler returned them, and the rewriting of a training
// request whose datums name those sequences in their provenance. The loss (LossFn::stable_reinforce) weighs each
// token by its ratio to the sampler; here the sampler's logprob of every sampled position comes from the record,
// not from the client, and every position a datum attributes to a sequence is checked against the token the
// sequence really holds there, so a misaligned datum is refused instead of trained on.
//
// A record lives for a day after its sampling or its last use in training (Tinker's documented lifetime), within
// kMaxTokensPerSession tokens a session (the least recently used go first), and not across a restart of the server.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <rlloop/types.hpp>

namespace rlloop::wire::tinker {
struct ForwardBackwardCall;
}

namespace rlloop::server {

class StabilityRecords {
 public:
  static constexpr double kLifetimeSeconds = 24 * 3600;
  static constexpr std::int64_t kMaxTokensPerSession = std::int64_t{1} << 24;  // prompts and sampled tokens

  // Sample request `request_id` of Tinker session `session` was queued with record_stability_info: its sequences,
  // "<request_id>-<i>", are kept once `complete` brings them.
  void expect(const std::string& session, const std::string& request_id, std::vector<token_id> prompt, double now);
  // The sample's result (null: the sample failed, and training on its sequences is refused saying so).
  void complete(const std::string& request_id, std::shared_ptr<const SampleResponse> result);

  // Rewrites the datums of a stable_reinforce request of `session` from their provenance: "logprobs" becomes the
  // recorded sampler logprob at each position of sampled tokens, and "weights" 0 at every other position (a prompt
  // token bears no loss). Throws invalid_argument naming the datum and the position when a datum has no provenance,
  // names a sequence this session did not record (another session's, an expired one, one sampled without
  // record_stability_info), or attributes a position to a token its sequence does not hold there, and when a
  // position of prompt tokens carries a nonzero advantage. Every datum is checked before any is changed.
  void apply(const std::string& session, wire::tinker::ForwardBackwardCall& call, double now);

  // Drops the records of a finished session.
  void drop(const std::string& session);

 private:
  struct Record {
    std::string session;
    std::vector<token_id> prompt;
    std::shared_ptr<const SampleResponse> result;
    bool done = false;
    double last_used = 0;
    std::int64_t tokens = 0;  // counted towards the session's cap once done
  };
  struct Rewrite;

  // The record of a sequence id, used now, for a datum of `session` (mu_ held); throws invalid_argument.
  const SampledSequence& sequence_locked(const std::string& session, const std::string& sequence_id,
                                         const std::vector<token_id>** prompt, double now, const std::string& where);
  void expire_locked(double now);
  void evict_locked(const std::string& session);

  std::mutex mu_;  // a leaf: nothing else is locked while it is held
  std::map<std::string, Record> records_;           // by request id
  std::map<std::string, std::int64_t> session_tokens_;  // the tokens of each session's completed records
  double last_expiry_ = 0;
};

}  // namespace rlloop::server
