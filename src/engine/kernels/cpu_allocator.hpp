// A caching allocator for large CPU tensors.
//
// LibTorch's default CPU allocator is posix_memalign/free. Blocks of more than 32 MiB (glibc's largest mmap
// threshold) are mmap'ed fresh and unmapped on free, so every training step page-faults its activations and
// gradients in again, and the kernel zeroes each page first: on rlloop-100m that was ~12% of a
// forward_backward step (perf: clear_page_erms, exc_page_fault). Steps repeat the same shapes, so freed blocks
// are kept in size buckets and handed out again, as LibTorch's CUDA allocator does on the GPU.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>

#include <c10/core/Allocator.h>
#include <torch/version.h>

// c10::Allocator's interface moved in LibTorch 2.x: copy_data() became pure virtual in 2.2 and allocate() lost
// its const in 2.3. Debian's LibTorch is 1.13; the GPU machines' (PyTorch's wheels) are 2.x.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
#define RLLOOP_ALLOCATE_CONST
#else
#define RLLOOP_ALLOCATE_CONST const
#endif
#define RLLOOP_ALLOCATOR_HAS_COPY_DATA (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 2))

namespace rlloop::engine {

class CachingCpuAllocator final : public c10::Allocator {
 public:
  // Blocks below min_block_bytes go to `fallback` untouched (glibc already reuses small blocks); at most
  // cap_bytes of freed blocks are kept, the oldest go back to the system first. An instance must outlive the
  // blocks it hands out (the installed one is never destroyed).
  CachingCpuAllocator(c10::Allocator* fallback, std::size_t cap_bytes, std::size_t min_block_bytes = 1 << 20);
  ~CachingCpuAllocator() override;
  CachingCpuAllocator(const CachingCpuAllocator&) = delete;
  CachingCpuAllocator& operator=(const CachingCpuAllocator&) = delete;

  // Every DataPtr's context is its data pointer (LibTorch's raw_allocate / raw_deallocate, used by its oneDNN
  // paths, require that), so raw_deleter() works for every block this allocator hands out.
  c10::DataPtr allocate(std::size_t bytes) RLLOOP_ALLOCATE_CONST override;
  c10::DeleterFnPtr raw_deleter() const override;
#if RLLOOP_ALLOCATOR_HAS_COPY_DATA
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
#endif

  // The size a request is served with: rounded up to 1/8 of its power of two (at most 12.5% more), so that
  // nearby sizes (sequences a few tokens longer) share blocks.
  static std::size_t bucket_size(std::size_t bytes);

  struct Stats {
    std::int64_t hits = 0, misses = 0;  // large allocations served from the cache / from the system
    std::size_t cached_bytes = 0;       // freed blocks held for reuse
    std::size_t in_use_bytes = 0;       // large blocks handed out and not freed (bucket sizes)
    std::size_t peak_in_use_bytes = 0;  // the most in_use_bytes reached since construction or reset_peak()
  };
  Stats stats() const;
  void reset_peak();      // peak_in_use_bytes = in_use_bytes: measures the peak of what runs next
  void release_cached();  // returns every cached block to the system

 private:
  struct Cached {
    void* data;
    std::uint64_t age;  // order of freeing: the oldest is evicted first when the cap is reached
  };
  static void delete_data(void* data);  // the deleter of every DataPtr (context == data)
  void give_back(void* data, std::size_t size);

  c10::Allocator* fallback_;
  std::size_t cap_bytes_, min_block_bytes_;
  mutable std::mutex mutex_;
  mutable std::multimap<std::size_t, Cached> free_;  // bucket size -> blocks, in the order they were freed
  mutable std::uint64_t next_age_ = 0;
  mutable Stats stats_;
};

// Installs one process-wide CachingCpuAllocator as LibTorch's CPU allocator (first call only). Its cap is
// RLLOOP_CPU_CACHE_MB if set (0 leaves LibTorch's allocator in place), else a quarter of the physical memory,
// at most 8 GiB. Returns the installed allocator, or nullptr when caching is off.
CachingCpuAllocator* install_caching_cpu_allocator();

// The allocator install_caching_cpu_allocator() installed, or nullptr (not yet, or caching off); never throws.
CachingCpuAllocator* installed_caching_cpu_allocator() noexcept;

}  // namespace rlloop::engine
