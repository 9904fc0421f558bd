// Attention of one decoded token: one query row of one head against the S keys and values cached for it.
// The decoding step calls this for every (sequence, head); in a small model it is as much time as all the
// projections together, so it has an AVX2/FMA version (4 keys per pass, a vectorised exp), chosen at run time
// where it is compiled (simd.hpp); the portable loop runs everywhere else.
#pragma once
#include <cstdint>

namespace rlloop::engine {

// out[D] = softmax(q K^T * scale) V for q [D], K and V [S, D] (rows contiguous); p: S floats of scratch.
void attend_row(const float* q, const float* K, const float* V, std::int64_t S, std::int64_t D, float scale, float* p,
                float* out);
// The same with K and V stored as bf16 bits (the bf16 sampling precision's cache): half the bytes to read,
// widened exactly to fp32 on load, so the arithmetic is the fp32 kernel's.
void attend_row(const float* q, const std::uint16_t* K, const std::uint16_t* V, std::int64_t S, std::int64_t D,
                float scale, float* p, float* out);

}  // namespace rlloop::engine
