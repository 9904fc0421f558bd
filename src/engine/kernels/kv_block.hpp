// The KV cache's block size, apart from kv_cache.hpp so that the kernels that read blocks need no LibTorch header.
#pragma once
#include <cstdint>

namespace rlloop::engine {

// Positions per block. A multiple of 4, so that the CPU attention kernel's four-key passes never straddle blocks
// (its sums are then those of a contiguous cache, bit for bit).
inline constexpr std::int64_t kKVBlockTokens = 16;

}  // namespace rlloop::engine
