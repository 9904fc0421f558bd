// The benches' inputs: deterministic pseudo-random tokens in [0, 256), byte ids, valid in every built-in
// vocabulary.
#pragma once
#include <cstdint>
#include <vector>

#include <rlloop/types.hpp>

namespace rlloop::bench {

inline std::vector<token_id> synthetic_tokens(int n, std::uint32_t seed) {
  std::vector<token_id> v(n);
  for (auto& t : v) {
    seed = seed * 1664525u + 1013904223u;  // a linear congruential step (Numerical Recipes' constants)
    t = static_cast<token_id>((seed >> 16) % 256);
  }
  return v;
}

}  // namespace rlloop::bench
