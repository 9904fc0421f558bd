// ggml's K-quant super-blocks written from fp32 (quantize_k.cpp): one block of 256 values at a time.
#pragma once
#include <cstdint>

namespace rlloop::gguf::detail {

constexpr int kSuperBlock = 256;  // ggml's QK_K

// 256 values as block_q4_K (144 bytes) and as block_q6_K (210 bytes) at `out`.
void quantize_q4_k_block(const float* x, std::uint8_t* out);
void quantize_q6_k_block(const float* x, std::uint8_t* out);

}  // namespace rlloop::gguf::detail
