// Drawing the next token of every sample from CPU logits in one pass per row.
//
// The ATen way (softmax, multinomial, then log_softmax + gather for the reported logprob) makes four passes
// over [rows, vocabulary] and multinomial draws an exponential variate per vocabulary entry: on rlloop-100m
// (32k vocabulary) that was 1.3 s of a 7 s sampling call. Here each row needs its maximum, one exponential
// per entry and a cumulative scan up to a single uniform draw (inverse CDF, as draw_inverse_cdf on the GPU).
#pragma once
#include <cstdint>

namespace rlloop::engine {

// For each row r of `logits` (row r at logits + r * row_stride; a stride of 0 repeats one row):
//   temperature > 0: token ~ softmax(logits / temperature), the first index whose cumulative probability
//                    exceeds uniforms[r] (in [0, 1));
//   temperature == 0: the first index of the largest logit (argmax).
// logprobs[r] is the chosen token's log-probability at temperature 1 (the model's own, unfiltered).
// Throws invalid_argument when a row has a NaN or +inf logit or no finite one.
void draw_tokens(const float* logits, std::int64_t rows, std::int64_t vocab, std::int64_t row_stride,
                 double temperature, const double* uniforms, std::int64_t* tokens, float* logprobs);

}  // namespace rlloop::engine
