// What every rank of a data-parallel group does for one command on one session's replica: its share of the
// computation and the collectives that combine the shares. Rank 0 and the workers call the same function with
// the same arguments (the workers decode them from the command), so the collectives line up; only rank 0 gets
// the combined result. A rank whose share fails still takes part in every collective and reports its error
// through them, so no rank is left waiting.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <rlloop/session.hpp>

#include "comm/group.hpp"
#include "dist/command.hpp"
#include "runtime/optimizer.hpp"
#include "runtime/sampler.hpp"
#include "runtime/session_model.hpp"
#include "model/transformer.hpp"

namespace rlloop::engine::dist {

// A rank's reply to an asynchronous share (Group::post_reply): its result's bytes, or the error it met; rank 0
// reads it with reply_result, which throws io_error naming the rank and the error.
std::string ok_reply(const std::string& result);
std::string failure_reply(const std::exception& e);
std::string reply_result(const std::string& reply, int rank);

// A request's samples cut into `parts` contiguous shares: share j is samples bounds[j] .. bounds[j + 1], the
// first shares one more where they do not divide evenly.
std::vector<int> split_samples(int samples, int parts);

// Which samples of a request each rank decodes: rank r decodes samples first[r] .. first[r] + count[r] - 1.
struct SamplePlacement {
  std::vector<int> first, count;
};
// split_samples's shares given to ranks first_rank, first_rank + 1, ... (mod parts): requests take turns at
// which rank gets the larger shares, so single samples go to every rank in turn.
SamplePlacement place_samples(int samples, int parts, int first_rank);

// The datums of each rank: `parts` contiguous runs (bounds[r] .. bounds[r + 1]) with about equal token
// counts, so the ranks finish at about the same time and rank order is the caller's order.
std::vector<std::size_t> split_by_tokens(const std::vector<Datum>& data, int parts);

// open: every rank holds the session's model (`made`; null when `error` says why it could not); rank 0 checks
// that every rank's model has the same shape and the same frozen weights, then sends its trainable weights to
// all. Throws on rank 0 naming the first rank that differs; every rank then drops the replica. With `shard`,
// every rank then keeps its shards of the model only (Transformer::set_fully_sharded; a model it cannot shard is
// refused as a differing one is): the caller makes the optimizer afresh.
void open_replica(Group& group, const SessionModel* made, const std::string& error, const std::string& base_model,
                  bool shard = false);

// One rank's datums of a batch: a contiguous run (split_by_tokens) and where it starts in the batch. Rank 0
// sends each worker only its own (Group::post_command's shares).
struct Share {
  std::vector<Datum> data;
  std::uint64_t first = 0;
};
std::vector<Share> shares_of(const std::vector<Datum>& data, int parts);
std::string encode(const Share& share);
Share decode_share(const std::string& bytes);

// forward / forward_backward with a built-in loss: each rank runs its share (`mine`); rank 0 returns the outputs
// in the caller's order, the summed loss and tokens, and clip fractions over the whole batch.
ForwardBackwardOutput forward_share(Group& group, Transformer& model, const std::vector<Datum>& mine,
                                    const LossSpec& loss, bool backward);

// forward_backward_custom: each rank computes its share's logprobs; rank 0 runs `fn` (null elsewhere) once
// over all of them (`all`: the whole batch, rank 0 only) and sends each rank the gradients of its share.
ForwardBackwardOutput custom_share(Group& group, Transformer& model, const Share& mine, const std::vector<Datum>* all,
                                   const CustomLossFn* fn);

// optim_step: the gradients summed over the ranks (the losses are sums over tokens), then the same AdamW step
// on every rank. An expert-parallel model's experts are not summed (each is whole on its rank) and the step clips
// by the norm over every rank's experts.
Metrics optim_step_share(Group& group, Transformer& model, AdamW& optimizer, const AdamParams& params);

// Before a save of the gradients accumulated since the last step (save_state between forward_backward and
// optim_step): every rank's gradients summed into rank 0's, the others' zeroed, so that rank 0 holds and saves
// the whole accumulation and the next optim_step's sum is the same. (An expert's stays on the rank that holds it:
// gather_experts_share reads it from there.)
void fold_gradients_share(Group& group, Transformer& model, AdamW& optimizer);

// A checkpoint's contents by name: trainable weights, optimizer state entries, pending gradients.
struct NamedState {
  TensorMap weights, optimizer, gradients;
};
// save_state of an expert-parallel session: rank 0 gets the other ranks' experts — their weights and, with
// `with_optimizer`, their optimizer state, with `with_gradients` their pending gradients (after fold_gradients).
// Rank 0's own it reads itself; the others get an empty NamedState.
NamedState gather_experts_share(Group& group, Transformer& model, AdamW& optimizer, bool with_optimizer,
                                bool with_gradients);
// load_state of an expert-parallel session, after rank 0 loaded its own part of `state` (rank 0's checkpoint,
// every expert's; null elsewhere): every other rank receives its slice of it (the tensors every rank holds and its
// own experts', Group::scatter: not the whole checkpoint) and loads the weights, by name, a fresh optimizer with
// (`with_optimizer`) the state and `step` saved, and its experts' saved gradients. Throws group_failure on rank 0
// naming a rank that could not.
void load_state_share(Group& group, Transformer& model, std::unique_ptr<AdamW>& optimizer, bool with_optimizer,
                      const NamedState* state, std::int64_t step);

// save_state of a fully sharded session: every trainable weight whole on rank 0, with `with_optimizer` its
// optimizer state and with `with_gradients` its pending gradient, under the names one rank would save (one
// all-gather per tensor, every rank together); the others get an empty NamedState.
NamedState gather_shards_share(Group& group, Transformer& model, AdamW& optimizer, bool with_optimizer,
                               bool with_gradients);
// load_state of a fully sharded session: rank 0 cuts `state` (a whole checkpoint, saved at any world size; null
// elsewhere) into every rank's parts and scatters them; each rank loads its weights, a fresh optimizer with
// (`with_optimizer`) the state and `step` saved, and its part of the saved gradients. Throws group_failure on rank 0
// naming a rank that could not.
void load_shards_share(Group& group, Transformer& model, std::unique_ptr<AdamW>& optimizer, bool with_optimizer,
                       const NamedState* state, std::int64_t step);

// After rank 0 changed its replica alone (load_state, without expert parallelism): its trainable weights, and with
// `with_optimizer` its optimizer state, to every rank. Without, every rank starts a fresh optimizer (`optimizer` is replaced).
void sync_state_share(Group& group, Transformer& model, std::unique_ptr<AdamW>& optimizer, bool with_optimizer);

// load_sampler: rank 0's trainable weights of a sampler model (loaded from a checkpoint) into every rank's copy,
// made as the session's model is. An expert-parallel model's come from `checkpoint` (rank 0's: the checkpoint's
// weights, every expert's): each rank receives its slice and loads it by name.
void load_sampler_share(Group& group, Transformer& model, const TensorMap* checkpoint);

// What one rank decodes of one request of an expert-parallel session's batch: its share of the samples (`req`'s
// num_samples, 0 for none) as DecodeRun takes them. `error`, when set, is why this rank could not make its run: it
// then only takes part in the others' steps, and reports it.
struct LockstepShare {
  SampleRequest req;
  StopStringCheck stop_check;
  std::uint64_t seed = 0;  // the request's; `stream` draws this rank's samples from it
  SampleStream stream{0};
  std::function<void(const SampleResponse&)> on_step;  // rank 0's streaming, when asked for
  // prefills_at_once of the whole request (rank 0's: prompt logprobs are not sent): every rank owes that forward.
  bool at_once = false;
  std::string error;
};
// A sampling model's tensor-parallel slice, kept between sample commands while the model's weights are those it was
// cut from (`version`: the sum of their tensors' version counters, which every in-place update bumps).
struct TensorParallelSlice {
  std::shared_ptr<Transformer> model;
  std::uint64_t version = 0;
};
// One rank's part of a batch of an expert-parallel session's sampling requests: the model they sample, and a share
// and a placement per request, in the batch's order (the same on every rank).
struct LockstepBatch {
  Transformer* model = nullptr;
  DecodePrecision precision = DecodePrecision::fp32;
  std::shared_ptr<const RoundedWeights>* rounded = nullptr;
  std::int64_t prefill_tokens = kPrefillChunkTokens;  // decode_step's, per rank
  // Tensor-parallel decoding (a fully sharded session's, tensor_parallel.hpp): every rank decodes every sample of
  // the batch (the placements give each rank all of them) with its slice of `model`, built for the batch; the
  // tokens are rank 0's (every rank draws the same).
  bool tensor_parallel = false;
  std::int64_t kv_capacity_bytes = 0;  // the slice's KV budget (the service's)
  TensorParallelSlice* slice = nullptr;  // the sampling model's, kept for its next batch (null: cut for this one)
  std::vector<LockstepShare> shares;
  std::vector<SamplePlacement> placements;
};
// What became of one request of a batch, on rank 0: its response with every rank's sequences in the order of its
// samples, or `error` naming the first rank whose share failed.
struct LockstepOutcome {
  SampleResponse response;
  std::string error;
};
// sample of an expert-parallel session, a batch of requests at a time: every rank makes its shares' runs (their
// prompts prefill in the steps, `prefill_tokens` at a time; a request that prefills at once, `at_once`, costs every
// rank a forward, the ranks without a share of it running the model over no rows), then decodes all of them in
// one step per token in step with the others (a rank whose samples have all stopped, or that has none, runs the model
// over no rows), until every rank's samples have stopped (one all-reduce of a flag per step says when). A step that
// fails fails this rank's runs still decoding. Rank 0 returns one outcome per request; the others return nothing.
// The same for a fully sharded session, whose every forward gathers its layers (or, with `tensor_parallel`, every
// rank decoding the whole batch over its slice of the model).
std::vector<LockstepOutcome> sample_lockstep_share(Group& group, LockstepBatch& mine);

// compute_logprobs of an expert-parallel session: rank 0 scores `tokens` (at least 2) while the others run the model
// over no rows, so that the sparse layers' exchanges line up. Rank 0 returns the logprobs.
std::vector<double> logprobs_lockstep_share(Group& group, Transformer& model, const std::vector<token_id>& tokens);

// Close and shutdown: every rank has done it.
void acknowledge(Group& group);

}  // namespace rlloop::engine::dist
