#include "kernels/cpu_allocator.hpp"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstdlib>
#include <iterator>
#include <limits>
#include <string>
#include <unordered_map>
#include <vector>

#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <rlloop/error.hpp>

namespace rlloop::engine {

namespace {
// Large blocks handed out and not yet freed, by data pointer: the deleter gets only the pointer (context ==
// data), so it finds its allocator and bucket size here. One table for all instances (tests make several).
struct LiveBlock {
  CachingCpuAllocator* owner;
  std::size_t size;
};
struct LiveTable {
  std::mutex mutex;
  std::unordered_map<void*, LiveBlock> blocks;
};
LiveTable& live() {
  static auto* table = new LiveTable();  // never destroyed: tensors may be freed after static destruction
  return *table;
}
}  // namespace

CachingCpuAllocator::CachingCpuAllocator(c10::Allocator* fallback, std::size_t cap_bytes, std::size_t min_block_bytes)
    : fallback_(fallback), cap_bytes_(cap_bytes), min_block_bytes_(std::max<std::size_t>(1, min_block_bytes)) {}

CachingCpuAllocator::~CachingCpuAllocator() { release_cached(); }

std::size_t CachingCpuAllocator::bucket_size(std::size_t bytes) {
  if (bytes > (std::numeric_limits<std::size_t>::max() >> 2)) return bytes;  // no allocation succeeds anyway
  const std::size_t step = std::max<std::size_t>(std::size_t{64} << 10, std::bit_floor(bytes) / 8);
  return (bytes + step - 1) / step * step;
}

c10::DataPtr CachingCpuAllocator::allocate(std::size_t bytes) RLLOOP_ALLOCATE_CONST {
  if (bytes < min_block_bytes_) return fallback_->allocate(bytes);
  const std::size_t size = bucket_size(bytes);
  void* data = nullptr;
  {
    std::lock_guard lock(mutex_);
    // The most recently freed block of the bucket (equal keys keep insertion order): it is likely still in
    // the CPU caches, where the oldest one is not (FIFO reuse cost the small model ~15% of a step).
    if (auto it = free_.upper_bound(size); it != free_.begin() && std::prev(it)->first == size) {
      --it;
      data = it->second.data;
      free_.erase(it);
      stats_.cached_bytes -= size;
      ++stats_.hits;
    } else {
      ++stats_.misses;
    }
  }
  if (!data) {
    try {
      data = c10::alloc_cpu(size);
    } catch (const c10::Error&) {
      // Out of memory with blocks of other sizes parked here: give them back and try once more.
      const_cast<CachingCpuAllocator*>(this)->release_cached();
      data = c10::alloc_cpu(size);
    }
  }
  {
    std::lock_guard lock(mutex_);
    stats_.in_use_bytes += size;
    stats_.peak_in_use_bytes = std::max(stats_.peak_in_use_bytes, stats_.in_use_bytes);
  }
  {
    std::lock_guard lock(live().mutex);
    live().blocks[data] = LiveBlock{const_cast<CachingCpuAllocator*>(this), size};
  }
  return {data, data, &CachingCpuAllocator::delete_data, c10::Device(c10::DeviceType::CPU)};
}

c10::DeleterFnPtr CachingCpuAllocator::raw_deleter() const { return &CachingCpuAllocator::delete_data; }

void CachingCpuAllocator::delete_data(void* data) {
  if (!data) return;
  LiveBlock block{nullptr, 0};
  {
    LiveTable& table = live();
    std::lock_guard lock(table.mutex);
    if (auto it = table.blocks.find(data); it != table.blocks.end()) {
      block = it->second;
      table.blocks.erase(it);
    }
  }
  // Not ours: a small block raw_allocate took from the fallback (DefaultCPUAllocator: posix_memalign).
  if (!block.owner) return c10::free_cpu(data);
  block.owner->give_back(data, block.size);
}

void CachingCpuAllocator::give_back(void* data, std::size_t size) {
  std::vector<void*> evicted;
  {
    std::lock_guard lock(mutex_);
    stats_.in_use_bytes -= size;
    if (size > cap_bytes_) {
      evicted.push_back(data);
    } else {
      // Oldest first: in RL loops sequence lengths drift, and buckets no step asks for any more should not
      // fill the cap while the current ones are turned away.
      while (stats_.cached_bytes + size > cap_bytes_ && !free_.empty()) {
        auto oldest = free_.begin();
        for (auto it = free_.begin(); it != free_.end(); ++it)
          if (it->second.age < oldest->second.age) oldest = it;
        evicted.push_back(oldest->second.data);
        stats_.cached_bytes -= oldest->first;
        free_.erase(oldest);
      }
      free_.emplace(size, Cached{data, next_age_++});
      stats_.cached_bytes += size;
    }
  }
  for (void* p : evicted) c10::free_cpu(p);
}

CachingCpuAllocator::Stats CachingCpuAllocator::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

void CachingCpuAllocator::reset_peak() {
  std::lock_guard lock(mutex_);
  stats_.peak_in_use_bytes = stats_.in_use_bytes;
}

void CachingCpuAllocator::release_cached() {
  std::multimap<std::size_t, Cached> blocks;
  {
    std::lock_guard lock(mutex_);
    blocks.swap(free_);
    stats_.cached_bytes = 0;
  }
  for (const auto& [size, block] : blocks) c10::free_cpu(block.data);
}

namespace {
std::size_t default_cap_bytes() {
  if (const char* env = std::getenv("RLLOOP_CPU_CACHE_MB")) {
    char* end = nullptr;
    const long long mb = std::strtoll(env, &end, 10);
    if (end == env || *end != '\0' || mb < 0 || mb > (1LL << 30))
      throw invalid_argument("RLLOOP_CPU_CACHE_MB must be a non-negative number of MiB, got '" + std::string(env) +
                             "'");
    return static_cast<std::size_t>(mb) << 20;
  }
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  const std::size_t physical =
      pages > 0 && page > 0 ? static_cast<std::size_t>(pages) * static_cast<std::size_t>(page) : 0;
  return std::min<std::size_t>(physical / 4, std::size_t{8} << 30);
}

std::atomic<CachingCpuAllocator*> g_installed{nullptr};
}  // namespace

CachingCpuAllocator* install_caching_cpu_allocator() {
  // Installed once and never destroyed: tensors allocated through it may outlive every static object.
  static CachingCpuAllocator* const installed = []() -> CachingCpuAllocator* {
    const std::size_t cap = default_cap_bytes();
    if (cap == 0) return nullptr;
    auto* allocator = new CachingCpuAllocator(c10::GetDefaultCPUAllocator(), cap);
    c10::SetCPUAllocator(allocator, /*priority=*/1);
    g_installed.store(allocator);
    return allocator;
  }();
  return installed;
}

CachingCpuAllocator* installed_caching_cpu_allocator() noexcept { return g_installed.load(); }

}  // namespace rlloop::engine
