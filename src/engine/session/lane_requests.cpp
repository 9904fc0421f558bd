// Requests decoded on this process's lane (lane_requests.hpp).
#include "session/lane_requests.hpp"

#include <numeric>

#include "comm/codec.hpp"
#include "runtime/sampler.hpp"

namespace rlloop::engine {

namespace {

// One sampling request across its lane callbacks, which share it.
struct LaneSample {
  SessionCore& core;
  SampleRequest request;
  dist::SamplePlacement placement;
  PostShares post;
  std::shared_ptr<dist::Replies> others;  // the other ranks' samples, once posted
  // The sampler model the run reads, counted in its `decoding` from the start of the run until its end, so that
  // another request of this session loading a checkpoint meanwhile does not drop it from the cache.
  SessionCore::SamplingModel* reading = nullptr;

  // What this rank decodes.
  struct Prepared {
    SampleRequest mine;
    StopStringCheck stop_check;
    SampleStream stream{0};
    SessionCore::SamplingModel* target = nullptr;
  };

  // Checks the request and posts the other ranks' samples (before this rank's prefill, so that they prefill theirs
  // at the same time).
  Prepared prepare() {
    Prepared p;
    p.target = &core.sampling_model(request.model_path);
    SessionCore::CheckedSample checked = core.check_sample(request, p.target->model->config());
    p.mine = std::move(checked.request);
    p.stop_check = std::move(checked.stop_check);
    if (post) others = post(p.mine, checked.seed);
    p.mine.num_samples = placement.count[0];
    p.stream = SampleStream(checked.seed, placement.first[0]);
    return p;
  }

  // The run reads the model until it finishes: this session's later operations wait for it, and its sampling
  // requests, which run beside it, do not drop it from the sampler cache (`decoding`). The prompt prefills in the
  // engine loop's steps, a chunk at a time beside the other requests' rows (unless the request asks for what only a
  // whole prompt's forward gives: DecodeRun's Prefill).
  std::unique_ptr<DecodeRun> start(const Executor::SampleProgress& on_step) {
    Prepared p = prepare();
    auto run = std::make_unique<DecodeRun>(*p.target->model, p.mine, p.stop_check, p.stream, core.decode_precision,
                                           core.rounded_slot(*p.target), Prefill::in_steps);
    ++p.target->decoding;
    reading = p.target;
    if (on_step) {
      // Each step's tokens; the first token of every sample at once where the run prefilled as it was made.
      if (!run->prefilling()) on_step(run->progress());
      run->on_step = on_step;
    }
    return run;
  }

  void done_reading() {
    if (reading) --reading->decoding;
    reading = nullptr;
  }

  bool ready() const { return !others || others->ready(); }

  // Every rank's samples in the request's order, billed: the prompt once, every sample's new tokens.
  SampleResponse finish(SampleResponse out) {
    if (others) {
      // Each rank decoded a contiguous run of the samples (placement): every sequence goes to its index.
      std::vector<SampledSequence> all(std::accumulate(placement.count.begin(), placement.count.end(), std::size_t{0}));
      auto put = [&](int rank, std::vector<SampledSequence> sequences) {
        for (std::size_t i = 0; i < sequences.size(); ++i) all.at(placement.first[rank] + i) = std::move(sequences[i]);
      };
      put(0, std::move(out.sequences));
      const auto replies = others->take();  // in the order of the ranks that have samples
      std::size_t next = 0;
      for (std::size_t r = 1; r < placement.count.size(); ++r)
        if (placement.count[r] > 0) put(static_cast<int>(r), dist::ByteReader(replies.at(next++)).get_sequences());
      out.sequences = std::move(all);
    }
    core.bill_sample(static_cast<std::int64_t>(request.prompt.length()), out.sequences);
    return out;
  }
};

}  // namespace

Future<SampleResponse> sample_on_lane(SessionCore& core, const SampleRequest& request,
                                      Executor::SampleProgress on_step, dist::SamplePlacement placement,
                                      PostShares post) {
  auto s = std::make_shared<LaneSample>(LaneSample{core, request, std::move(placement), std::move(post), nullptr});
  auto ready = [s] { return s->ready(); };
  const int here = s->placement.count[0];
  if (here == 0) {  // every sample is another rank's: this rank only waits for them
    return core.lane->submit_deferred<SampleResponse>([s, ready] {
      s->prepare();
      return EngineLoop::Deferred<SampleResponse>{ready, [s] { return s->finish(SampleResponse{}); }};
    });
  }
  // The KV cache this rank's samples may take (the session's model stands for its sampler models: one shape).
  SampleRequest mine = request;
  mine.num_samples = here;
  const std::int64_t kv_bytes = kv_bytes_needed(*core.model, mine, core.decode_precision);
  return core.lane->submit_sample(
      here, kv_bytes, [s, on_step = std::move(on_step)] { return s->start(on_step); },
      [s](DecodeRun& run) {
        s->done_reading();
        return s->finish(run.take());
      },
      std::move(ready), [s](std::exception_ptr) {
        // Other ranks may still decode their shares of a failed request (the lane waits for them): its sampler
        // then stays loaded, as dropping it would drop theirs under them.
        if (!s->others) s->done_reading();
      });
}

Future<std::vector<double>> logprobs_on_lane(SessionCore& core, const ComputeLogprobsRequest& request) {
  return core.lane->submit<std::vector<double>>([&core, request] {
    Transformer& m = *core.sampling_model(request.model_path).model;
    return compute_logprobs(m, core.checked_logprob_tokens(request, m));
  });
}

}  // namespace rlloop::engine
