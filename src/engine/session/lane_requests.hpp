// Sampling and compute_logprobs requests decoded on this process's lane, beside the other requests of the base's
// engine loop: all of a single-rank session's, and a data-parallel session's share (the other ranks' shares posted
// to them and merged in when their replies come). Checks and billing are the session's (SessionCore).
#pragma once
#include <functional>
#include <memory>
#include <vector>

#include <rlloop/future.hpp>
#include <rlloop/types.hpp>

#include "dist/coordinator.hpp"
#include "dist/replica_ops.hpp"
#include "session/executor.hpp"
#include "session/session_core.hpp"

namespace rlloop::engine {

// Posts the other ranks' shares of a request (checked: SessionCore::check_sample) drawn from `seed`; returns their
// replies, or null where this rank decodes every sample.
using PostShares = std::function<std::shared_ptr<dist::Replies>(const SampleRequest& checked, std::uint64_t seed)>;

// `request` decoded as `placement` shares it out: this rank (rank 0 of the placement) decodes its run of the
// samples as a decode run of the lane, `post` (null: none) hands out the others' before this rank prefills, and the
// response holds every rank's samples in the request's order, billed once.
Future<SampleResponse> sample_on_lane(SessionCore& core, const SampleRequest& request,
                                      Executor::SampleProgress on_step, dist::SamplePlacement placement,
                                      PostShares post);

// compute_logprobs of `request` with this rank's model (the session's or a sampler model), on the lane.
Future<std::vector<double>> logprobs_on_lane(SessionCore& core, const ComputeLogprobsRequest& request);

}  // namespace rlloop::engine
