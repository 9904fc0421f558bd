// How the few-row products (small_gemm.cpp, bf16_gemm.cpp) share their column blocks between threads. A
// product, or a group of products of the same input, numbers its blocks one product after the other; threads
// take chunks of those numbers from a shared counter until none are left, so a thread the machine slows down
// (another process, a virtual CPU descheduled) takes fewer chunks instead of holding the others at the end of
// the region. Which thread computes a block does not change its result: each output is still computed by one
// thread in a fixed order.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <span>

namespace rlloop::engine::product_blocks {

// Calls run(begin, end) for ranges covering blocks [0, blocks) exactly once. Up to `grain` blocks (about 1M
// multiply-adds) everything runs on the calling thread, as in at::parallel_for: a parallel region would cost
// more than it saves.
template <class Run>
void parallel(std::int64_t blocks, std::int64_t grain, Run run) {
  const std::int64_t threads = at::get_num_threads();
  if (threads == 1 || blocks <= grain || at::in_parallel_region()) {
    if (blocks > 0) run(0, blocks);
    return;
  }
  // ~8 chunks per thread: enough to even out, few enough that each chunk's first block (whose weights nobody
  // prefetched) stays rare. Not `grain` sized: with 1-4 grains of work that would leave a few big chunks
  // and one thread idle for most of the region.
  const std::int64_t chunk = std::max<std::int64_t>(1, blocks / (8 * threads));
  std::atomic<std::int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](std::int64_t, std::int64_t) {
    // The join at the end of the region orders everything, so the counter needs no stronger ordering.
    std::int64_t begin = next.fetch_add(chunk, std::memory_order_relaxed);
    while (begin < blocks) {
      run(begin, std::min(blocks, begin + chunk));
      begin = next.fetch_add(chunk, std::memory_order_relaxed);
    }
  });
}

// The part of a group's blocks in [begin, end): on_range(product, b0, b1) for each product with blocks there,
// [b0, b1) counted within that product; blocks_of(product) is how many it has.
template <class Product, class BlocksOf, class OnRange>
void visit(std::span<const Product> products, std::int64_t begin, std::int64_t end, BlocksOf blocks_of,
           OnRange on_range) {
  std::int64_t first = 0;  // the number of the product's first block
  for (const Product& p : products) {
    const std::int64_t count = blocks_of(p), b0 = std::max(begin, first), b1 = std::min(end, first + count);
    if (b0 < b1) on_range(p, b0 - first, b1 - first);
    first += count;
  }
}

}  // namespace rlloop::engine::product_blocks
