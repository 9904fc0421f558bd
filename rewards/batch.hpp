// Scores many completions at once, in parallel with TBB. Rewards are pure functions of (context, completion),
// so every completion is scored independently; the order of the results matches the input.
// Needs TBB: link rlloop::sandbox (which carries TBB::tbb) or TBB::tbb yourself.
#pragma once
#include <cstddef>
#include <string>
#include <vector>

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/task_arena.h>

#include <rlloop/error.hpp>
#include <rlloop/reward.hpp>

namespace rlloop::rewards {

struct BatchOptions {
  // Most completions scored at the same time; 0 = TBB's default (one per core). Code rewards spend most of
  // their time waiting on sandboxed processes, 1 gives serial scoring (a baseline for benchmarks).
  int max_concurrency = 0;

  void validate() const {
    if (max_concurrency < 0) throw invalid_argument("BatchOptions::max_concurrency must be >= 0");
  }
};

namespace detail {
template <class F>
void parallel_indices(std::size_t n, const BatchOptions& opts, F&& body) {
  opts.validate();
  auto loop = [&] {
    tbb::parallel_for(tbb::blocked_range<std::size_t>(0, n, 1), [&](const tbb::blocked_range<std::size_t>& r) {
      for (std::size_t i = r.begin(); i != r.end(); ++i) body(i);
    });
  };
  if (opts.max_concurrency == 1) {
    for (std::size_t i = 0; i < n; ++i) body(i);
  } else if (opts.max_concurrency > 1) {
    tbb::task_arena arena(opts.max_concurrency);
    arena.execute(loop);
  } else {
    loop();
  }
}
}  // namespace detail

// contexts[i] with completions[i], for every i.
template <class Ctx, Reward<Ctx> R>
std::vector<Score> score_batch(const R& reward, const std::vector<Ctx>& contexts,
                               const std::vector<std::string>& completions, const BatchOptions& opts = {}) {
  if (contexts.size() != completions.size())
    throw invalid_argument("score_batch: " + std::to_string(contexts.size()) + " contexts but " +
                           std::to_string(completions.size()) + " completions");
  std::vector<Score> out(contexts.size());
  detail::parallel_indices(out.size(), opts,
                           [&](std::size_t i) { out[i] = score_one(reward, contexts[i], completions[i]); });
  return out;
}

}  // namespace rlloop::rewards
