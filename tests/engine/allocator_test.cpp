// The caching CPU allocator: bucket sizes, reuse, the cap, thread safety, tensors allocated through it, and
// the release when a session closes.
#include <gtest/gtest.h>

#include <c10/core/CPUAllocator.h>
#include <torch/torch.h>

#include <cstdlib>
#include <thread>
#include <vector>

#include <rlloop/local.hpp>

#include "kernels/cpu_allocator.hpp"

using rlloop::engine::CachingCpuAllocator;

namespace {
constexpr std::size_t MiB = std::size_t{1} << 20;
}

TEST(CachingCpuAllocator, BucketsRoundUpByAtMostAnEighth) {
  EXPECT_EQ(CachingCpuAllocator::bucket_size(MiB), MiB);
  EXPECT_EQ(CachingCpuAllocator::bucket_size(MiB + 1), MiB + MiB / 8);
  EXPECT_EQ(CachingCpuAllocator::bucket_size(3'000'000), 3 * MiB);  // steps of 256 KiB between 2 and 4 MiB
  for (std::size_t bytes = MiB; bytes < 600 * MiB; bytes = bytes * 9 / 7 + 12345) {
    const std::size_t b = CachingCpuAllocator::bucket_size(bytes);
    EXPECT_GE(b, bytes);
    EXPECT_LE(b, bytes + bytes / 8);
    EXPECT_EQ(CachingCpuAllocator::bucket_size(b), b);  // a bucket size is its own bucket
  }
}

TEST(CachingCpuAllocator, ReusesAFreedBlockOfTheSameBucket) {
  CachingCpuAllocator alloc(c10::GetDefaultCPUAllocator(), 64 * MiB);
  c10::DataPtr first = alloc.allocate(4 * MiB);
  void* address = first.get();
  static_cast<char*>(address)[4 * MiB - 1] = 7;  // the whole request is usable
  first.clear();
  EXPECT_EQ(alloc.stats().cached_bytes, 4 * MiB);

  c10::DataPtr second = alloc.allocate(4 * MiB - 100);  // same bucket
  EXPECT_EQ(second.get(), address);
  c10::DataPtr third = alloc.allocate(4 * MiB);  // the cached block is taken: a new one
  EXPECT_NE(third.get(), address);
  const auto s = alloc.stats();
  EXPECT_EQ(s.hits, 1);
  EXPECT_EQ(s.misses, 2);
  EXPECT_EQ(s.cached_bytes, 0u);
}

TEST(CachingCpuAllocator, HandsOutTheMostRecentlyFreedBlockFirst) {
  CachingCpuAllocator alloc(c10::GetDefaultCPUAllocator(), 64 * MiB);
  c10::DataPtr a = alloc.allocate(2 * MiB), b = alloc.allocate(2 * MiB);
  void* b_address = b.get();
  a.clear();
  b.clear();  // b was freed last: still warm in the CPU caches
  EXPECT_EQ(alloc.allocate(2 * MiB).get(), b_address);
}

TEST(CachingCpuAllocator, EvictsTheOldestBlocksWhenTheCapIsReached) {
  CachingCpuAllocator alloc(c10::GetDefaultCPUAllocator(), 8 * MiB);
  c10::DataPtr a = alloc.allocate(2 * MiB), b = alloc.allocate(4 * MiB), c = alloc.allocate(4 * MiB);
  void* c_address = c.get();
  a.clear();
  b.clear();
  c.clear();  // 2 + 4 + 4 MiB > 8: the oldest (a, the 2 MiB bucket) goes
  EXPECT_EQ(alloc.stats().cached_bytes, 8 * MiB);
  const auto before = alloc.stats();
  c10::DataPtr again4 = alloc.allocate(4 * MiB);
  EXPECT_EQ(again4.get(), c_address);
  c10::DataPtr again2 = alloc.allocate(2 * MiB);
  EXPECT_EQ(alloc.stats().hits, before.hits + 1);
  EXPECT_EQ(alloc.stats().misses, before.misses + 1);
}

TEST(CachingCpuAllocator, RawAllocateAndDeallocateWorkForLargeAndSmallBlocks) {
  // LibTorch's oneDNN paths use raw_allocate / raw_deallocate, which need context == data and a raw deleter.
  CachingCpuAllocator alloc(c10::GetDefaultCPUAllocator(), 64 * MiB);
  ASSERT_NE(alloc.raw_deleter(), nullptr);
  for (std::size_t bytes : {4 * MiB, std::size_t{100}}) {
    void* p = alloc.raw_allocate(bytes);
    ASSERT_NE(p, nullptr);
    static_cast<char*>(p)[bytes - 1] = 1;
    alloc.raw_deallocate(p);
  }
  EXPECT_EQ(alloc.stats().cached_bytes, 4 * MiB);  // the large one came back to the cache
}

TEST(CachingCpuAllocator, SmallRequestsBypassTheCache) {
  CachingCpuAllocator alloc(c10::GetDefaultCPUAllocator(), 64 * MiB);
  {
    c10::DataPtr p = alloc.allocate(1000);
    ASSERT_NE(p.get(), nullptr);
  }
  const auto s = alloc.stats();
  EXPECT_EQ(s.hits + s.misses, 0);
  EXPECT_EQ(s.cached_bytes, 0u);
}

TEST(CachingCpuAllocator, KeepsAtMostTheCapAndReleasesOnRequest) {
  CachingCpuAllocator alloc(c10::GetDefaultCPUAllocator(), 8 * MiB);
  {
    std::vector<c10::DataPtr> blocks;
    for (int i = 0; i < 3; ++i) blocks.push_back(alloc.allocate(4 * MiB));
  }  // three freed, two fit under the cap, the third went back to the system
  EXPECT_EQ(alloc.stats().cached_bytes, 8 * MiB);
  alloc.release_cached();
  EXPECT_EQ(alloc.stats().cached_bytes, 0u);
}

TEST(CachingCpuAllocator, ConcurrentAllocateAndFreeKeepCountsConsistent) {
  CachingCpuAllocator alloc(c10::GetDefaultCPUAllocator(), 32 * MiB);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) {
        c10::DataPtr p = alloc.allocate((1 + (i + t) % 3) * MiB);
        static_cast<char*>(p.get())[0] = static_cast<char>(i);
      }
    });
  for (auto& th : threads) th.join();
  const auto s = alloc.stats();
  EXPECT_EQ(s.hits + s.misses, 800);
  EXPECT_GT(s.hits, 0);
  EXPECT_LE(s.cached_bytes, 32 * MiB);
}

TEST(CachingCpuAllocator, InstalledForLibTorchTensors) {
  if (std::getenv("RLLOOP_CPU_CACHE_MB"))
    GTEST_SKIP() << "RLLOOP_CPU_CACHE_MB is set: the installed cap is not the default";
  CachingCpuAllocator* alloc = rlloop::engine::install_caching_cpu_allocator();
  ASSERT_NE(alloc, nullptr);
  EXPECT_EQ(c10::GetCPUAllocator(), alloc);
  void* address = nullptr;
  {
    torch::Tensor t = torch::full({2048, 1024}, 1.5f);  // 8 MiB
    address = t.data_ptr();
    EXPECT_EQ(t.sum().item<double>(), 1.5 * 2048 * 1024);
  }
  const auto before = alloc->stats();
  torch::Tensor again = torch::zeros({1024, 2048});  // same size: the same block, zeroed as asked
  EXPECT_EQ(again.data_ptr(), address);
  EXPECT_EQ(again.abs().sum().item<double>(), 0.0);
  EXPECT_EQ(alloc->stats().hits, before.hits + 1);
  // oneDNN (MKLDNN) tensors go through raw_allocate / raw_deallocate: large and small round trips.
  for (std::int64_t n : {1024, 8}) {
    auto dense = torch::randn({n, n});
    EXPECT_TRUE(torch::equal(dense.to_mkldnn().to_dense(), dense));
  }
}

TEST(CachingCpuAllocator, ClosingASessionReturnsTheCachedBlocks) {
  if (std::getenv("RLLOOP_CPU_CACHE_MB")) GTEST_SKIP() << "RLLOOP_CPU_CACHE_MB is set: caching may be off";
  ASSERT_TRUE(rlloop::configure_engine_process({.num_threads = 1}).caching_cpu_allocator);
  CachingCpuAllocator* alloc = rlloop::engine::installed_caching_cpu_allocator();
  ASSERT_NE(alloc, nullptr);
  rlloop::LocalService service(rlloop::LocalServiceOptions{.device = "cpu"});
  {
    auto session = service.create_session(rlloop::SessionOptions{.base_model = "rlloop-tiny"});
    { torch::Tensor t = torch::empty({1 << 20}); }  // 4 MiB, freed into the cache
    EXPECT_GE(alloc->stats().cached_bytes, 4 * MiB);
  }
  EXPECT_EQ(alloc->stats().cached_bytes, 0u);
}
