// Attention of one decoded token: one query row of one head against the S keys and values cached for it.
// The decoding step calls this for every (sequence, head); in a small model it is as much time as all the
// projections together, so it has an AVX2/FMA version (4 keys per pass, a vectorised exp), chosen at run time
// where it is compiled (simd.hpp); the portable loop runs everywhere else.
#pragma once
#include <cstdint>

#include "kernels/kv_block.hpp"

namespace rlloop::engine {

// out[D] = softmax(q K^T * scale) V for q [D], K and V [S, D] (rows contiguous); p: S floats of scratch.
void attend_row(const float* q, const float* K, const float* V, std::int64_t S, std::int64_t D, float scale, float* p,
                float* out);
// The same with K and V stored as bf16 bits (the bf16 sampling precision's cache): half the bytes to read,
// widened exactly to fp32 on load, so the arithmetic is the fp32 kernel's.
void attend_row(const float* q, const std::uint16_t* K, const std::uint16_t* V, std::int64_t S, std::int64_t D,
                float scale, float* p, float* out);

// The rows of one decoding step over paged caches (kv_cache.hpp): row r's block table at tables + r * table_stride
// and its key count lengths[r] (its new position + 1, the new key already stored).
struct PagedRows {
  const std::int64_t* tables;
  std::int64_t table_stride;
  const std::int64_t* lengths;
  std::int64_t rows;
};
// Every query head of every row (q [rows, nh, D]) against its sequence's keys and values in a pool's storage
// (keys, values [slots, nkv, D]: T is float, or bf16 bits) into out [rows, nh, D]; query head h reads KV head
// h / (nh / nkv). Parallel over (row, head) when there is enough work. Each (row, head) computes exactly what
// attend_row computes over the same keys stored contiguously.
template <class T>
void attend_paged(const float* q, const T* keys, const T* values, const PagedRows& rows, std::int64_t nh,
                  std::int64_t nkv, std::int64_t D, float scale, float* out);

}  // namespace rlloop::engine
