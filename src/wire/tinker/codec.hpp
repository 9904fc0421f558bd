// Tinker's wire format (docs/tinker_protocol.md): its protobuf messages (tinker_public.proto, regenerated from the
// SDK by scripts/tinker_proto.py), its JSON bodies and tinker 0.12's JSON forward_backward, translated to and from
// the core's plain types. Requests are read whole and checked here: a field of the wrong type, shape or dtype throws
// invalid_argument naming it, so that the server answers the SDK's `user` error before anything reaches a session.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include <rlloop/loss.hpp>
#include <rlloop/types.hpp>

namespace rlloop::wire::tinker {

// One run of a datum's provenance (Datum.with_provenance): `length` consecutive positions of the datum's field that
// are positions [offset, offset + length) of the prompt, or of the sampled tokens, of the sequence `sequence_id`.
struct ProvenanceSpan {
  std::string sequence_id;
  bool sampled = false;  // a run of the sampled tokens; else of the prompt
  std::int64_t offset = 0;
  std::int64_t length = 0;
};

// A datum's provenance, run by run: its model_input's positions and its loss inputs' (target_tokens'); both empty
// when the datum has none. stable_reinforce reads it (server/tinker_stability.hpp).
struct Provenance {
  std::vector<ProvenanceSpan> model_input;
  std::vector<ProvenanceSpan> targets;
};

// One forward_backward (or forward, with forward_only) request: a chunk of a training client's batch.
struct ForwardBackwardCall {
  std::string model_id;
  std::int64_t seq_id = 0;
  std::vector<Datum> data;
  std::vector<Provenance> provenance;  // one per datum
  LossSpec loss;
  bool forward_only = false;
};

// A protobuf ForwardBackwardRequest (tinker 0.38: application/x-protobuf). Loss inputs may come dense or as 2-D
// sparse CSR tensors of one row per token; image and dmel chunks and a loss other than kLosses' are refused by name.
// Provenance spans are checked as the SDK states them (each names a sequence, none is negative, together they tile
// their field) and kept.
ForwardBackwardCall forward_backward_from_proto(std::string_view bytes);

// A ForwardBackwardOutput as protobuf, in one ArrayRecord: each datum's outputs back to back with byte offsets.
// Metrics keep only keys that name their reduction ("loss:sum"): the SDK's chunk combiner splits every key at its
// one ':' and fails on any other.
std::string forward_backward_output_to_proto(const ForwardBackwardOutput& out);
// The metrics as the SDK combines them: keys with exactly one ':' (the others are rlloop's own summaries).
Metrics tinker_metrics(const Metrics& metrics);

// An asample body ({"prompt", "num_samples", "sampling_params", "prompt_logprobs", "topk_prompt_logprobs", ...}).
// `eos` is the model's end-of-sequence token: absent `stop` stops there, `stop: []` disables every stop, EOS
// included, as the SDK documents. Features rlloop does not compute (topk_sample_logprobs, prompt_alt_tokens_k,
// target_prompt_logprobs, prompt_logprobs_last_n) are refused by name.
struct SampleCall {
  std::string sampling_session_id;
  std::int64_t seq_id = 0;
  SampleRequest request;
  bool record_stability_info = false;  // keep the sequences for stable_reinforce (server/tinker_stability.hpp)
};
SampleCall sample_call_from_json(const nlohmann::json& body, std::optional<token_id> eos);

// A SampleResponse as protobuf: tokens int32, logprobs float32, prompt_logprobs float32 with NaN where none was
// computed (the first token), top-k prompt logprobs as k columns per token (id 0, logprob -99999 in empty cells).
std::string sample_response_to_proto(const SampleResponse& response);

// tinker 0.12's JSON generation (the one skyrl-tx serves): a ForwardBackwardRequest body ({"forward_backward_input":
// {"data", "loss_fn", "loss_fn_config"}, "model_id", "seq_id"}), or a ForwardRequest's with `forward_only`
// ("forward_input"), its loss inputs as {"data", "dtype", "shape"}; checked as the protobuf reader checks them.
ForwardBackwardCall forward_backward_from_json(const nlohmann::json& body, bool forward_only);
// Its results as JSON: a ForwardBackwardOutput with one record of named tensors per datum (metrics as
// tinker_metrics keeps them), and a SampleResponse (prompt logprobs null at the first token).
nlohmann::json forward_backward_output_to_json(const ForwardBackwardOutput& out);
nlohmann::json sample_response_to_json(const SampleResponse& response);

// optim_step's adam_params ({"learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"}; a clip
// norm of 0 means none).
AdamParams adam_params_from_json(const nlohmann::json& j, const std::string& path);

}  // namespace rlloop::wire::tinker
